"""Entry points behind scripts/train.py: one place that builds every object from the config."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from omegaconf import DictConfig, ListConfig, OmegaConf

from gpg_vl.config.validate import check_model_folder
from gpg_vl.data.task import get_task
from gpg_vl.errors import UserError
from gpg_vl.models.load import RAW_TEMPLATE, load_policy
from gpg_vl.models.lora import adapter_base, adapter_folder, apply_lora, freeze_vision, load_adapter
from gpg_vl.train.checkpoint import write_failure
from gpg_vl.train.loop import setup, train
from gpg_vl.train.outdir import check_output_dir


def build_policy(model_cfg: DictConfig, device):
    """The policy of a model alias, with its memory options: LoRA (`model.lora.r > 0`) and a frozen vision tower.

    A checkpoint holding a LoRA adapter loads its base model, then the adapter: trainable when LoRA is on
    (resuming), merged into the weights otherwise (evaluating).
    """
    lora = model_cfg.get("lora") or {}
    training_lora = int(lora.get("r") or 0) > 0
    if training_lora and lora.get("save") not in ("adapter", "merged"):
        raise UserError(f"unknown model.lora.save {lora.get('save')!r}; use adapter (the LoRA weights alone) "
                        "or merged (full weights in Hugging Face format).")
    name_or_path = model_cfg.name_or_path
    adapter = adapter_folder(name_or_path) if Path(str(name_or_path)).is_dir() else None
    if adapter is not None and not training_lora and (Path(name_or_path) / "config.json").is_file():
        adapter = None  # merged weights sit next to the adapter: evaluate them as they are
    if adapter is not None:
        name_or_path = adapter_base(adapter)
    policy = load_policy(
        name_or_path, family=model_cfg.family, dtype=model_cfg.dtype, min_pixels=model_cfg.min_pixels,
        max_pixels=model_cfg.max_pixels, trust_remote_code=model_cfg.trust_remote_code,
        attn_implementation=model_cfg.attn_implementation, device=device,
        prompt_style=model_cfg.get("prompt_style") or "chat",
        raw_template=model_cfg.get("raw_template") or RAW_TEMPLATE,
        enable_thinking=bool(model_cfg.get("enable_thinking", True)),
        router_aux_loss_coef=float(model_cfg.get("router_aux_loss_coef") or 0.0),
    )
    if model_cfg.get("box_frame"):
        policy.adapter.box_frame = _box_frame(model_cfg.box_frame)
    model = policy.model
    if adapter is not None:
        model = load_adapter(model, adapter, trainable=training_lora)
        if not training_lora:
            model = model.merge_and_unload()
    elif training_lora:
        model = apply_lora(model, r=int(lora.r), alpha=float(lora.alpha), dropout=float(lora.dropout),
                           target_modules=_plain(lora.target_modules), include_vision=bool(lora.include_vision),
                           vision_modules=policy.adapter.vision_modules(model),
                           target_parameters=_plain(lora.get("target_parameters")) or None)
    if model_cfg.get("freeze_vision"):
        freeze_vision(model, policy.adapter.vision_modules(model))
    return replace(policy, model=model, save_format=str(lora.save) if training_lora else "full")


def _box_frame(frame: str) -> str:
    from gpg_vl.models.family import BOX_FRAMES

    if frame not in BOX_FRAMES:
        raise UserError(f"unknown model.box_frame {frame!r}; use one of {', '.join(BOX_FRAMES)} (null = the family's).")
    return frame


def _plain(value):
    """A config list as a Python list (a string stays a string: a regular expression)."""
    return OmegaConf.to_container(value) if isinstance(value, DictConfig | ListConfig) else value


def build_task(task_cfg: DictConfig, data_cfg: DictConfig | None = None):
    options = OmegaConf.to_container(task_cfg.options, resolve=True) if task_cfg.options is not None else {}
    data_cfg = data_cfg or {}
    return get_task(task_cfg.name, data_path=data_cfg.get("path"), image_root=data_cfg.get("image_root"),
                    allow_outside_paths=bool(data_cfg.get("allow_outside_paths", False)), **options)


def train_main(cfg: DictConfig) -> dict:
    """Train from a composed config: build the run once (gpg_vl/train/loop.py's `setup`), train it, and end
    the process group; a UserError reaches scripts/train.py, which prints its sentence."""
    run = setup(cfg)
    summary = train(run)
    if run.main and summary.get("accuracy_before") is not None:
        print(f"accuracy before: {summary['accuracy_before']:.3f}  after: {summary.get('accuracy_after', 0):.3f}"
              f"  ({cfg.output_dir}/summary.json)")
    _close_process_group(run.accelerator)
    return summary


def _close_process_group(accelerator) -> None:
    """End the run's process group on every process (collective: after the last save and evaluation). Left
    to interpreter exit, gloo's threads are torn down in no set order and a process can abort with
    `terminate called without an active exception` after the run has finished."""
    if accelerator.num_processes > 1:
        accelerator.wait_for_everyone()
        accelerator.state.destroy_process_group()  # accelerate's own teardown (what end_training ends with)


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def eval_main(cfg: DictConfig) -> dict[str, float]:
    """Greedy evaluation of a model on a task split, or re-scoring of a saved predictions file."""
    from gpg_vl.observe.viewer import write_predictions_html
    from gpg_vl.train.evaluate import evaluate, prediction_records, read_predictions, rescore

    task = build_task(cfg.task, cfg.data)
    split = cfg.eval.split or task.eval_split
    rows = task.load(split)
    output_dir = Path(cfg.output_dir)
    check_output_dir(output_dir)  # before the model loads: the results are written at the end
    if cfg.predictions:
        records = read_predictions(cfg.predictions)
        _attach_segmenter(task, cfg)
        metrics, records = rescore(task, records, rows, reward_workers=cfg.eval.reward_workers)
    else:
        import torch

        torch.manual_seed(cfg.seed)
        rows = rows[:cfg.eval.limit] if cfg.eval.limit else rows
        _attach_segmenter(task, cfg)  # before the policy: a segmenter that cannot load fails fast
        from gpg_vl.config.schema import RolloutSettings
        from gpg_vl.rollout.engine import build_engine

        chosen = OmegaConf.to_container(cfg.rollout, resolve=True)  # the engine, checked before the model loads
        engine_settings = RolloutSettings(**{k: v for k, v in chosen.items() if k in ("engine", "hf", "vllm")})
        check_model_folder(cfg.model)
        policy = build_policy(cfg.model, "cuda" if _cuda() else "cpu")
        metrics, decoded = evaluate(policy, task, rows, batch_size=cfg.eval.batch_size,
                                    max_new_tokens=cfg.eval.max_new_tokens or cfg.rollout.max_new_tokens,
                                    engine=build_engine(engine_settings, policy),
                                    reward_workers=cfg.eval.reward_workers, reward_budget_s=cfg.eval.reward_budget_s)
        records = prediction_records(task, decoded, split)
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        with (output_dir / "predictions.jsonl").open("w") as handle:
            for record in records:
                handle.write(json.dumps(record) + "\n")
        (output_dir / "metrics.json").write_text(json.dumps(metrics, indent=2))
        write_predictions_html(output_dir / "predictions.html", task, records, rows, metrics, split=split)
    except OSError as error:
        raise UserError(f"could not write the evaluation's results in {str(output_dir)!r}: "
                        f"{write_failure(error, 'they')}; accuracy was {metrics.get('accuracy', float('nan')):.4f}: "
                        "free space or pick another output_dir, then evaluate again.") from None
    width = max(len(name) for name in metrics)
    segmenter = getattr(task, "segmenter", None)
    masks = f", masks by segmenter {segmenter.name}" if segmenter is not None else ""
    print(f"{task.name} / {split}: {len(records)} rows{masks}  ({output_dir}; open predictions.html to look)")
    for name, value in metrics.items():
        print(f"  {name:<{width}}  {value:.4f}")
    return metrics


def _attach_segmenter(task, cfg: DictConfig) -> None:
    """Give a task that scores masks (it has a `segmenter` attribute: lisa) the segmenter `segmenter=` names."""
    if hasattr(task, "segmenter"):
        from gpg_vl.reward.segment import load_segmenter

        task.segmenter = load_segmenter(cfg.segmenter, cfg.segmenter_model, batch_size=cfg.segmenter_batch_size,
                                        device="cuda" if _cuda() else "cpu")
