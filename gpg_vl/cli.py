"""Entry points behind scripts/train.py and scripts/eval.py: load the config, `setup(cfg)`, `train(run)`; evaluation.

Nothing heavy is imported at module level: scripts/train.py reads and checks the config (gpg_vl/config/) before
torch, transformers or the model code load, so a bad key or value is refused in well under a second
(docs/robustness.md, "Errors in a second").
"""

from __future__ import annotations

import json
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from gpg_vl.errors import Interrupted, UserError

_LAZY = {"build_policy": "gpg_vl.train.build", "build_task": "gpg_vl.train.build"}


def __getattr__(name: str):
    """`from gpg_vl.cli import build_policy, build_task` (scripts, tests): imported on first use."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'gpg_vl.cli' has no attribute {name!r}")


def train_main(cfg: DictConfig) -> dict:
    """Train from a composed config: build the run once (gpg_vl/train/setup.py's `setup`), train it, and end
    the process group; a UserError reaches scripts/train.py, which prints its sentence. Ctrl-C ends the run
    with `Interrupted` (the output folder released): one line naming the step and how to continue."""
    from gpg_vl.train.loop import setup, train

    try:
        run = setup(cfg)
    except KeyboardInterrupt:
        raise Interrupted(f"interrupted before training started; nothing was trained in {cfg.output_dir}.") from None
    try:
        summary = train(run)
    except KeyboardInterrupt:
        run.bar.close()  # the message on a line of its own
        raise Interrupted(_interrupted(run)) from None
    except BaseException:
        run.bar.close()  # an error's sentence (or traceback) on a line of its own, not on the progress bar's
        raise
    if run.main and summary.get("accuracy_before") is not None:
        print(f"accuracy before: {summary['accuracy_before']:.3f}  after: {summary.get('accuracy_after', 0):.3f}"
              f"  ({cfg.output_dir}/summary.json)")
    _close_process_group(run.accelerator)
    return summary


def _interrupted(run) -> str:
    """Where an interrupted run stopped: its step, its folder, the newest intact checkpoint it can continue from."""
    from gpg_vl.train.checkpoint import latest_checkpoint

    newest = latest_checkpoint(run.output_dir)
    kept = f"the newest intact checkpoint is {newest}" if newest else "no checkpoint was written yet (step 0)"
    return (f"interrupted at step {run.state.step}; continue with resume=auto (output_dir={run.output_dir}; "
            f"{kept}).")


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
    """Evaluation of a model on a task split (greedy, or eval.samples completions per row), or re-scoring of a
    saved predictions file."""
    from gpg_vl.config.validate import check_model_folder
    from gpg_vl.observe.viewer import write_predictions_html
    from gpg_vl.train import build
    from gpg_vl.train.checkpoint import write_failure
    from gpg_vl.train.evaluate import decoding, evaluate, prediction_records, read_predictions, rescore
    from gpg_vl.train.outdir import check_output_dir

    task = build.build_task(cfg.task, cfg.data)
    build.build_judge(cfg.get("reward"), task, "cuda" if _cuda() else "cpu")  # before the rows and the policy
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
        from gpg_vl.rollout.engine import build_engine, prepare_tools

        # rollout.* as training has it (the engine and its own section, the multi-turn keys, the tools'
        # sections), typed by the config's schema; greedy decoding takes no sampling key from it
        engine_settings = OmegaConf.to_object(cfg.rollout)
        check_model_folder(cfg.model)
        prepare_tools(engine_settings, task.tools)  # a tool's sandbox that cannot start: one sentence, before the model
        policy = build.build_policy(cfg.model, "cuda" if _cuda() else "cpu")
        metrics, decoded = evaluate(policy, task, rows, batch_size=cfg.eval.batch_size,
                                    max_new_tokens=cfg.eval.max_new_tokens or cfg.rollout.max_new_tokens,
                                    engine=build_engine(engine_settings, policy, tools=task.tools),
                                    reward_workers=cfg.eval.reward_workers, reward_budget_s=cfg.eval.reward_budget_s,
                                    decoding=decoding(cfg.eval, cfg.rollout, seed=cfg.seed))
        records = prediction_records(task, decoded, split, tokenizer=policy.family.tokenizer)
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
    rows_seen = len({record["index"] for record in records})
    several = f", {len(records) // max(rows_seen, 1)} samples each" if len(records) > rows_seen else ""
    print(f"{task.name} / {split}: {rows_seen} rows{several}{masks}  ({output_dir}; open predictions.html to look)")
    for name, value in metrics.items():
        print(f"  {name:<{width}}  {value:.4f}")
    return metrics


def _attach_segmenter(task, cfg: DictConfig) -> None:
    """Give a task that scores masks (it has a `segmenter` attribute: lisa) the segmenter `segmenter=` names."""
    if hasattr(task, "segmenter"):
        from gpg_vl.reward.segment import load_segmenter

        task.segmenter = load_segmenter(cfg.segmenter, cfg.segmenter_model, batch_size=cfg.segmenter_batch_size,
                                        device="cuda" if _cuda() else "cpu")
