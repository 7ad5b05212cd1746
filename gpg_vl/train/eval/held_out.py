"""The run's held-out evaluation: the rows (read and checked once, only when something evaluates), and the
evaluations before training (`trainer.eval_before`), every N steps (`trainer.eval_every`) and after
(`trainer.eval_after`), each of the learner's current weights (docs/evaluation.md). `run` is
gpg_vl/train/run.py's Run."""

from __future__ import annotations

from accelerate.utils import gather_object
from tqdm.auto import tqdm

from gpg_vl.data.mixture import Mixture
from gpg_vl.data.stream import Subset, scan_rows
from gpg_vl.data.task import load_split
from gpg_vl.errors import UserError
from gpg_vl.train.eval.evaluate import Share, decoding, evaluate


def prepare_held_out(run) -> None:
    """The held-out rows (checked once, here, when they will be evaluated), how they are evaluated, and the
    summary's start. task=mix: each task's own held-out split, evaluated with its own engine and settings
    (`run.data.eval_sets`)."""
    task, evaluation = run.data.task, run.settings.evaluation
    if isinstance(task, Mixture):
        run.data.eval_sets = {}
        for name, one in task.tasks.items():
            rows, kwargs, data = _held_out_rows(run, one, evaluation.split or one.eval_split, run.data.engines[name],
                                                run.data.rollouts[name], task.evals[name].get("max_new_tokens"))
            run.data.eval_sets[name] = (one, rows, kwargs)
            if data is not None:
                run.state.summary.setdefault("eval_data", {})[name] = data.summary()
        _summary_start(run)
        return
    run.data.eval_rows, run.data.eval_kwargs, eval_data = _held_out_rows(
        run, task, evaluation.split or task.eval_split, run.engine, run.settings.rollout)
    _summary_start(run)
    if eval_data is not None:
        run.state.summary["eval_data"] = eval_data.summary()


def _summary_start(run) -> None:
    summary = run.state.summary
    summary.update({"task": run.data.task.name, "model": run.learner.policy.name_or_path,
                    "output_dir": str(run.output_dir), **run.state.record})


def _held_out_rows(run, task, split: str, engine, rollout, max_new_tokens: int | None = None):
    """(rows, evaluate's keywords, the rows' bad-row log or None) of `task`'s held-out `split`; `max_new_tokens`: a
    mixture's task's own evaluation length (eval.max_new_tokens, when set, wins)."""
    evaluation, trainer = run.settings.evaluation, run.trainer
    accelerator, family = run.accelerator, run.learner.policy.family
    evaluated = (trainer.eval_before and run.state.start_step == 0) or trainer.eval_after or trainer.eval_every > 0
    eval_rows = load_split(task, split) if evaluated else []  # evaluation off: never read
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
    kwargs = {
        "batch_size": evaluation.batch_size,
        "max_new_tokens": evaluation.max_new_tokens or max_new_tokens or rollout.max_new_tokens,
        "share": Share(accelerator.process_index, accelerator.num_processes, gather_object), "engine": engine,
        "reward_workers": evaluation.reward_workers, "reward_budget_s": evaluation.reward_budget_s,
        "decoding": decoding(evaluation, rollout, seed=run.settings.seed)}
    return eval_rows, kwargs, eval_data


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
    """The held-out rows' metrics with the learner's current weights (the run's engine and decoding). task=mix:
    each task's metrics on its own split under `<task>/`, and `accuracy` the mean of the tasks' accuracies."""
    if not isinstance(run.data.task, Mixture):
        metrics, _ = evaluate(run.learner.policy, run.data.task, run.data.eval_rows, **run.data.eval_kwargs)
        return metrics
    return mixed_metrics({name: evaluate(run.learner.policy, task, rows, **kwargs)[0]
                          for name, (task, rows, kwargs) in run.data.eval_sets.items()})


def mixed_metrics(per_task: dict[str, dict]) -> dict:
    """A mixture's evaluation from each task's metrics (name -> metrics, in the mixture's order): each under
    `<task>/`, and `accuracy` the mean of the tasks' accuracies (None when none has one); training's held-out
    evaluation and scripts/eval.py alike."""
    accuracies = [metrics["accuracy"] for metrics in per_task.values() if metrics.get("accuracy") is not None]
    found = {f"{name}/{key}": value for name, metrics in per_task.items() for key, value in metrics.items()}
    return {"accuracy": sum(accuracies) / len(accuracies) if accuracies else None, **found}


def format_metrics(metrics: dict[str, float]) -> str:
    return "  ".join(f"{k}={v:.3f}" for k, v in metrics.items() if isinstance(v, float))
