"""Entry points behind scripts/train.py: one place that builds every object from the config."""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import replace
from pathlib import Path

from omegaconf import DictConfig, ListConfig, OmegaConf

from gpg_vl.config.schema import ModelSettings
from gpg_vl.config.validate import check_model_folder
from gpg_vl.data.task import get_task
from gpg_vl.errors import UserError
from gpg_vl.models.load import load_policy
from gpg_vl.models.lora import adapter_base, adapter_folder, apply_lora, freeze_vision, load_adapter
from gpg_vl.train.checkpoint import compare_settings, resolve_resume, write_failure
from gpg_vl.train.loop import EvalSettings, RolloutSettings, TrainerSettings, needs_reference, train
from gpg_vl.train.outdir import check_output_dir, claim_output_dir


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
    policy = load_policy(ModelSettings(**OmegaConf.to_container(model_cfg, resolve=True)), device,
                         name_or_path=str(name_or_path))
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


def _plain(value):
    """A config list as a Python list (a string stays a string: a regular expression)."""
    return OmegaConf.to_container(value) if isinstance(value, DictConfig | ListConfig) else value


def build_task(task_cfg: DictConfig, data_cfg: DictConfig | None = None):
    options = OmegaConf.to_container(task_cfg.options, resolve=True) if task_cfg.options is not None else {}
    data_cfg = data_cfg or {}
    return get_task(task_cfg.name, data_path=data_cfg.get("path"), image_root=data_cfg.get("image_root"),
                    allow_outside_paths=bool(data_cfg.get("allow_outside_paths", False)), **options)


def train_main(cfg: DictConfig) -> dict:
    from accelerate import Accelerator

    task = build_task(cfg.task, cfg.data)
    mixed = "bf16" if cfg.model.dtype in ("auto", "bfloat16") and _cuda() else "no"
    report_to = cfg.trainer.report_to
    # Several processes and no GPU (`accelerate launch --multi_gpu --num_processes 2` or torchrun on a CPU
    # machine): cpu=True makes accelerate join them with gloo; otherwise each would train alone.
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    accelerator = Accelerator(mixed_precision=mixed, project_dir=str(cfg.output_dir), cpu=launched > 1 and not _cuda(),
                              log_with=None if report_to == "none" else report_to)
    if accelerator.num_processes != launched:
        raise UserError(f"{launched} processes were launched but accelerate joined {accelerator.num_processes}; "
                        "launch with `accelerate launch --multi_gpu --num_processes N` (or torchrun) on a machine "
                        "whose devices accelerate supports.")
    if accelerator.num_processes > 1:  # collective, on every process: one output_dir (${now} differs by process)
        from accelerate.utils import broadcast_object_list

        cfg.output_dir = broadcast_object_list([str(cfg.output_dir)])[0]
    model_cfg = cfg.model
    container = OmegaConf.to_container(cfg, resolve=True)
    with contextlib.ExitStack() as held:  # the output folder is this run's until it ends (gpg_vl/train/outdir.py)
        resume = _on_main(accelerator, lambda: _claim(held, cfg, container))
        if resume is not None:  # the weights come from the checkpoint; the optimizer, data position and RNG follow
            model_cfg = OmegaConf.merge(cfg.model, {"name_or_path": str(resume)})
        check_model_folder(model_cfg)  # before the weights load
        policy = build_policy(model_cfg, accelerator.device)
        settings = TrainerSettings(**container["trainer"])
        # A loss with a KL term scores the initial weights: with LoRA the base model (adapters disabled); else a
        # copy rebuilt from the model source, so that a resumed run gets the same reference as an uninterrupted one.
        reference = None
        if needs_reference(settings) and not int((cfg.model.get("lora") or {}).get("r") or 0):
            reference = build_policy(cfg.model, accelerator.device).model
        summary = train(
            policy, task,
            trainer=settings,
            rollout=RolloutSettings(**container["rollout"]),
            evaluation=EvalSettings(**container["eval"]),
            output_dir=cfg.output_dir, seed=cfg.seed, resume_from=resume, accelerator=accelerator,
            config=container, max_bad_fraction=cfg.data.max_bad_fraction, reference=reference,
        )
    if accelerator.is_main_process and summary.get("accuracy_before") is not None:
        print(f"accuracy before: {summary['accuracy_before']:.3f}  after: {summary.get('accuracy_after', 0):.3f}"
              f"  ({cfg.output_dir}/summary.json)")
    _close_process_group(accelerator)
    return summary


def _claim(held: contextlib.ExitStack, cfg: DictConfig, container: dict) -> Path | None:
    """Lock and check the output folder (held until `held` closes), then pick the checkpoint to resume from,
    intact and made with compatible settings (printing the legitimate changes); None: start afresh."""
    held.enter_context(claim_output_dir(cfg.output_dir, resume=cfg.resume, overwrite=bool(cfg.get("overwrite"))))
    resume = resolve_resume(cfg.resume, cfg.output_dir)  # resume=auto: the newest intact checkpoint, if any
    if str(cfg.resume) == "auto" and resume is None:
        print(f"resume=auto: no complete checkpoint in {cfg.output_dir}; starting at step 0")
    changes = compare_settings(resume, container) if resume is not None else []
    if changes:
        print(f"resuming {resume} with changed settings: {'; '.join(changes)}")
    return resume


def _on_main(accelerator, action):
    """`action()` on the main process alone, its result given to every process; a UserError it raises is
    raised on every process (collective when there are several: each reaches it once, at the same point)."""
    result, problem = None, None
    if accelerator.is_main_process:
        try:
            result = action()
        except UserError as error:
            problem = str(error)
    if accelerator.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        result, problem = broadcast_object_list([result, problem])
    if problem is not None:
        raise UserError(problem)
    return result


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
