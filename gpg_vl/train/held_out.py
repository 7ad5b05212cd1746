"""The run's held-out evaluation: the rows (read and checked once, only when something evaluates), and the
evaluations before training (`trainer.eval_before`), every N steps (`trainer.eval_every`) and after
(`trainer.eval_after`), each of the learner's current weights (docs/evaluation.md). `run` is
gpg_vl/train/run.py's Run."""

from __future__ import annotations

from accelerate.utils import gather_object
from tqdm.auto import tqdm

from gpg_vl.data.stream import Subset, scan_rows
from gpg_vl.errors import UserError
from gpg_vl.train.evaluate import Share, decoding, evaluate


def prepare_held_out(run) -> None:
    """The held-out rows (checked once, here, when they will be evaluated), how they are evaluated, and the
    summary's start."""
    task, evaluation, trainer = run.data.task, run.settings.evaluation, run.trainer
    accelerator, family = run.accelerator, run.learner.policy.family
    evaluated = (trainer.eval_before and run.state.start_step == 0) or trainer.eval_after or trainer.eval_every > 0
    eval_rows = task.load(evaluation.split or task.eval_split) if evaluated else []  # evaluation off: never read
    eval_rows = eval_rows[:evaluation.limit] if evaluation.limit else eval_rows
    eval_data = None
    if evaluated:
        good, eval_data = scan_rows(task, eval_rows, max_bad_fraction=run.settings.max_bad_fraction,
                                    max_aspect_ratio=family.max_aspect_ratio)
        if eval_data.bad:
            run.warn(f"{eval_data.bad} held-out rows are bad and left out of evaluation:\n{eval_data.report()}")
        if eval_data.over_limit():
            raise UserError(f"held-out split: {eval_data.stop_message()}")
        eval_rows = Subset(eval_rows, good)
    run.data.eval_rows = eval_rows
    run.data.eval_kwargs = {
        "batch_size": evaluation.batch_size,
        "max_new_tokens": evaluation.max_new_tokens or run.settings.rollout.max_new_tokens,
        "share": Share(accelerator.process_index, accelerator.num_processes, gather_object), "engine": run.engine,
        "reward_workers": evaluation.reward_workers, "reward_budget_s": evaluation.reward_budget_s,
        "decoding": decoding(evaluation, run.settings.rollout, seed=run.settings.seed)}
    summary = run.state.summary
    summary.update({"task": task.name, "model": run.learner.policy.name_or_path, "output_dir": str(run.output_dir),
                    **run.state.record})
    if eval_data is not None:
        summary["eval_data"] = eval_data.summary()


def evaluate_held_out(run, when: str) -> None:
    """Evaluation of the held-out rows (greedy, or eval.samples each), into the summary as accuracy_<when> and
    eval_<when>."""
    metrics = _evaluate(run)
    run.state.summary[f"accuracy_{when}"] = metrics.get("accuracy")
    run.state.summary[f"eval_{when}"] = metrics
    if when == "before":  # kept in the record: a resumed run's summary still holds the first evaluation
        run.state.record.update({"accuracy_before": metrics.get("accuracy"), "eval_before": metrics})
    run.accelerator.print(f"held-out {when} training:{' ' if when == 'after' else ''} {format_metrics(metrics)}")


def evaluate_during(run) -> dict[str, float]:
    """trainer.eval_every = N: at every N-th step (but the last, when eval_after evaluates the same weights), the
    held-out split with the learner's weights after that step's update (also with a sampler thread: it samples on
    its own copy), as eval_<metric> in the step's metrics; else nothing."""
    trainer, step = run.trainer, run.state.step
    if not trainer.eval_every or step % trainer.eval_every or (trainer.eval_after and step == trainer.max_steps):
        return {}
    metrics = _evaluate(run)
    if run.main:  # above the progress bar, which stays whole
        tqdm.write(f"held-out at step {step}: {format_metrics(metrics)}")
    return {f"eval_{name}": value for name, value in metrics.items() if isinstance(value, (int, float))}


def _evaluate(run) -> dict:
    """The held-out rows' metrics with the learner's current weights (the run's engine and decoding)."""
    metrics, _ = evaluate(run.learner.policy, run.data.task, run.data.eval_rows, **run.data.eval_kwargs)
    return metrics


def format_metrics(metrics: dict[str, float]) -> str:
    return "  ".join(f"{k}={v:.3f}" for k, v in metrics.items() if isinstance(v, float))
