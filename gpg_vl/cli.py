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
    from gpg_vl.distributed import lost_peer
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
    except RuntimeError as error:
        run.bar.close()  # an error's sentence (or traceback) on a line of its own, not on the progress bar's
        reason = lost_peer(error) if run.accelerator.num_processes > 1 else None
        if reason is None:
            raise
        _stop_without_peers(run, reason)
    except BaseException:
        run.bar.close()
        raise
    if run.main and summary.get("accuracy_before") is not None:
        print(f"accuracy before: {summary['accuracy_before']:.3f}  after: {summary.get('accuracy_after', 0):.3f}"
              f"  ({cfg.output_dir}/summary.json)")
    _close_process_group(run.accelerator)
    return summary


def _stop_without_peers(run, reason: str) -> None:
    """Another trainer process is gone (killed, crashed, its machine lost: `reason`, what the collective said): no
    collective can run any more, so no checkpoint can be written either. Stop in one sentence naming the newest
    intact checkpoint, from which the same launch on every machine continues with resume=auto."""
    from gpg_vl.train.checkpoint.folder import latest_checkpoint

    accelerator = run.accelerator
    newest = latest_checkpoint(run.output_dir)
    kept = f"its newest intact checkpoint is {newest.name}" if newest else "no checkpoint was written yet"
    run.stop(f"process {accelerator.process_index} of {accelerator.num_processes} lost another trainer process "
             f"({reason}), so the run stopped at step {run.state.step}; {kept} (output_dir={run.output_dir}): "
             "once every machine is back, launch the same command on each with resume=auto (docs/many-nodes.md).")


def _interrupted(run) -> str:
    """Where an interrupted run stopped: its step, its folder, the newest intact checkpoint it can continue from."""
    from gpg_vl.train.checkpoint.folder import latest_checkpoint

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
    saved predictions file. task=mix: each task on its own split with its own settings, as training's held-out
    evaluation does, into <output_dir>/<task>/; metrics.json holds `<task>/<metric>` and `accuracy`, the mean of
    the tasks' accuracies."""
    from gpg_vl.config.validate import check_model_folder
    from gpg_vl.data.mixture import Mixture
    from gpg_vl.data.task import load_split
    from gpg_vl.rollout.engine import prepare_tools, require_reachable
    from gpg_vl.train import build
    from gpg_vl.train.checkpoint.outdir import check_output_dir
    from gpg_vl.train.eval.evaluate import decoding, evaluate, prediction_records, read_predictions, rescore

    task = build.build_task(cfg.task, cfg.data)
    build.build_judge(cfg.get("reward"), task, "cuda" if _cuda() else "cpu")  # before the rows and the policy
    mixed = isinstance(task, Mixture)
    if mixed and cfg.predictions:
        raise UserError("predictions= re-scores one task's predictions, and task=mix evaluates several; re-score each "
                        "task's file with that task (task=<entry> predictions=<output_dir>/<entry>/predictions.jsonl, "
                        "where a mixture's evaluation writes them).")
    tasks = task.tasks if mixed else {task.name: task}
    splits = {name: cfg.eval.split or one.eval_split for name, one in tasks.items()}
    rows = {name: load_split(one, splits[name]) for name, one in tasks.items()}
    output_dir = Path(cfg.output_dir)
    check_output_dir(output_dir)  # before the model loads: the results are written at the end
    results = {}  # name -> (metrics, records)
    if cfg.predictions:
        _attach_segmenter(task, cfg)
        results[task.name] = rescore(task, read_predictions(cfg.predictions), rows[task.name],
                                     reward_workers=cfg.eval.reward_workers)
    else:
        import torch

        torch.manual_seed(cfg.seed)
        rows = {name: found[:cfg.eval.limit] if cfg.eval.limit else found for name, found in rows.items()}
        for one in tasks.values():
            _attach_segmenter(one, cfg)  # before the policy: a segmenter that cannot load fails fast
        # rollout.* as training has it (the engine and its own section, the multi-turn keys, the tools'
        # sections), typed by the config's schema; greedy decoding takes no sampling key from it
        rollout = OmegaConf.to_object(cfg.rollout)
        require_reachable(rollout)  # a server that does not answer: one sentence, before the model loads
        check_model_folder(cfg.model)
        for one in tasks.values():  # a tool's sandbox that cannot start: one sentence, before the model
            prepare_tools(rollout, one.tools)
        policy = build.build_policy(cfg.model, "cuda" if _cuda() else "cpu")
        rollouts, engines, lengths = _engines(task, rollout, policy)
        for name, one in tasks.items():
            metrics, decoded = evaluate(policy, one, rows[name], batch_size=cfg.eval.batch_size,
                                        max_new_tokens=cfg.eval.max_new_tokens or lengths[name],
                                        engine=engines[name], reward_workers=cfg.eval.reward_workers,
                                        reward_budget_s=cfg.eval.reward_budget_s,
                                        decoding=decoding(cfg.eval, rollouts[name], seed=cfg.seed))
            results[name] = metrics, prediction_records(one, decoded, splits[name], tokenizer=policy.family.tokenizer)
    for name, (metrics, records) in results.items():
        _write_results(output_dir / name if mixed else output_dir, tasks[name], records, rows[name], metrics,
                       splits[name])
    if not mixed:
        return results[task.name][0]
    from gpg_vl.train.eval.held_out import mixed_metrics

    metrics = mixed_metrics({name: found for name, (found, _) in results.items()})
    _write(output_dir, metrics)
    print(f"{task.name}: {len(tasks)} tasks  ({output_dir}/metrics.json: each task's figures as <task>/<metric>)")
    _print_metrics({"accuracy (the tasks' mean)": metrics["accuracy"]})
    return metrics


def _engines(task, rollout, policy) -> tuple[dict, dict, dict]:
    """(name -> rollout settings, name -> engine, name -> its completion length) of each task evaluated: a mixture's
    tasks each with the rollout and eval settings it owns (gpg_vl/train/mixed.py's `mixture_engines`)."""
    from gpg_vl.data.mixture import Mixture
    from gpg_vl.rollout.engine import build_engine

    if not isinstance(task, Mixture):
        return ({task.name: rollout}, {task.name: build_engine(rollout, policy, tools=task.tools)},
                {task.name: rollout.max_new_tokens})
    from gpg_vl.train.mixed import mixture_engines

    rollouts, engines = mixture_engines(task, rollout, policy, None)
    return rollouts, engines, {name: task.evals[name].get("max_new_tokens") or rollouts[name].max_new_tokens
                               for name in task.tasks}


def _write_results(output_dir: Path, task, records: list, rows, metrics: dict, split: str) -> None:
    """One task's predictions.jsonl, metrics.json and predictions.html in `output_dir`, and its lines printed."""
    from gpg_vl.observe.viewer import write_predictions_html

    def write() -> None:
        with (output_dir / "predictions.jsonl").open("w") as handle:
            for record in records:
                handle.write(json.dumps(record) + "\n")
        write_predictions_html(output_dir / "predictions.html", task, records, rows, metrics, split=split)

    _write(output_dir, metrics, write)
    segmenter = getattr(task, "segmenter", None)
    masks = f", masks by segmenter {segmenter.name}" if segmenter is not None else ""
    rows_seen = len({record["index"] for record in records})
    several = f", {len(records) // max(rows_seen, 1)} samples each" if len(records) > rows_seen else ""
    print(f"{task.name} / {split}: {rows_seen} rows{several}{masks}  ({output_dir}; open predictions.html to look)")
    _print_metrics(metrics)


def _write(output_dir: Path, metrics: dict, more=None) -> None:
    """metrics.json in `output_dir` (and what `more` writes there); a disk that refuses: one sentence."""
    from gpg_vl.train.checkpoint.folder import write_failure

    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        if more is not None:
            more()
        (output_dir / "metrics.json").write_text(json.dumps(metrics, indent=2))
    except OSError as error:
        accuracy = metrics.get("accuracy")
        raise UserError(f"could not write the evaluation's results in {str(output_dir)!r}: "
                        f"{write_failure(error, 'they')}; accuracy was "
                        f"{float('nan') if accuracy is None else accuracy:.4f}: free space or pick another output_dir, "
                        "then evaluate again.") from None


def _print_metrics(metrics: dict) -> None:
    width = max((len(name) for name in metrics), default=0)
    for name, value in metrics.items():
        if isinstance(value, int | float):
            print(f"  {name:<{width}}  {value:.4f}")


def _attach_segmenter(task, cfg: DictConfig) -> None:
    """Give a task that scores masks (it has a `segmenter` attribute: lisa) the segmenter `segmenter=` names."""
    if hasattr(task, "segmenter"):
        from gpg_vl.reward.segment import load_segmenter

        task.segmenter = load_segmenter(cfg.segmenter, cfg.segmenter_model, batch_size=cfg.segmenter_batch_size,
                                        device="cuda" if _cuda() else "cpu")
