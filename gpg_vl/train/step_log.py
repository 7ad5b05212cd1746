"""A step's record: its metrics (rewards, multi-turn, pipeline timing and staleness; global, over every process),
metrics.jsonl, the progress bar and trackers, and its rollouts for viewing."""

from __future__ import annotations

import json
import math

import torch
from accelerate import Accelerator

from gpg_vl.observe.rollout_log import log_rollouts
from gpg_vl.rollout.multiturn.trajectory import trajectory_metrics
from gpg_vl.train.checkpoint.folder import writing
from gpg_vl.train.run import Run
from gpg_vl.train.step.sample import Attempt

# The step metrics read off the wall clock (seconds, and tokens per second): two runs of one seed, a resumed one
# and the uninterrupted one, agree on every other metric exactly (scripts/check_resume.py, the resume tests).
WALL_CLOCK_METRICS = frozenset({"rollout_s", "update_s", "step_s", "sampler_idle_s", "learner_idle_s",
                                "generated_tokens_per_s"})


def pipeline_metrics(step: int, sampled) -> dict[str, float]:
    """The sampling stage's timing and staleness: the version lag of the step's rollouts (step - 1 - version), how
    long each side waited for the other, and the generated tokens per second of sampling."""
    lag = step - 1 - sampled.version
    return {"version_lag_mean": float(lag), "version_lag_max": lag, "sampler_idle_s": sampled.sampler_idle_s,
            "learner_idle_s": sampled.learner_idle_s, "generated_tokens_per_s": sampled.tokens_per_s}


# ---------------------------------------------------------------------------------------------
# log
# ---------------------------------------------------------------------------------------------
def trajectory_step_metrics(collected, accelerator: Accelerator) -> dict[str, float]:
    """The step's multi-turn metrics (`trajectory_metrics`: turns, tool calls and errors, images, limit hits,
    generated and observation tokens) over every trajectory sampled on every process. Collective: one all-reduce,
    on every process when rollout.max_turns > 1 (a process without prompts adds zeros)."""
    trajectories = [t for a in collected.attempts if a.rollout is not None for t in a.rollout.trajectories or []]
    local = trajectory_metrics(trajectories)
    names = sorted(local)
    count = float(len(trajectories))
    sums = [local[n] * count if n.endswith("_mean") else local[n] for n in names] + [count]  # means back to sums
    totals = accelerator.reduce(torch.tensor(sums, dtype=torch.float64, device=accelerator.device), "sum").tolist()
    return {n: (v / max(totals[-1], 1.0) if n.endswith("_mean") else v) for n, v in zip(names, totals, strict=False)}


def step_metrics(collected, accelerator: Accelerator, reward_names: list[str]) -> dict[str, float]:
    """Global reward statistics over every completion sampled in this step (collective: one all-reduce, called
    once per step by every process; a process without prompts adds zeros). Completions with a NaN or
    infinite reward are counted (`rewards_nonfinite`), not averaged; the reward function calls that raised
    (`reward_errors`) and the completions not scored within the reward budget (`reward_timeouts`), each as its
    attempt's scoring returned them, are summed over processes; so are the completions that asked the run's judge
    and those it gave no score (`judged`, `judge_missing`: logged on the steps that asked it)."""
    # one row per attempt: completions, finite rewards, their sum and sum of squares, completion tokens,
    # reward errors, reward timeouts, judged, judge missing, each component's sum over the finite rewards; plus a
    # row of zeros (a process without prompts adds nothing)
    rows = [torch.zeros(9 + len(reward_names), dtype=torch.float64)]
    for attempt in collected.attempts:
        lengths = attempt.rollout.completion_mask.sum(dim=1).float() if attempt.rollout else torch.zeros(0)
        r = attempt.rewards.flatten()
        finite = torch.isfinite(r)
        rows.append(torch.stack([
            torch.tensor(float(r.numel())), finite.sum().float(), r[finite].sum(), (r[finite] ** 2).sum(),
            lengths.sum(), torch.tensor(float(attempt.reward_errors)), torch.tensor(float(attempt.reward_timeouts)),
            torch.tensor(float(attempt.judged)), torch.tensor(float(attempt.judge_missing)),
            *[attempt.components[n].flatten()[finite].sum() for n in reward_names]]).double())
    totals = accelerator.reduce(torch.stack(rows).sum(0).to(accelerator.device), "sum").cpu().tolist()
    completions, scored, total, squares, tokens, errors, timeouts, judged, judge_missing = totals[:9]
    mean = total / max(scored, 1.0)
    metrics = {"reward_mean": mean, "reward_std": math.sqrt(max(squares / max(scored, 1.0) - mean * mean, 0.0))}
    metrics.update({f"reward/{n}": totals[9 + i] / max(scored, 1.0) for i, n in enumerate(reward_names)})
    metrics["completion_tokens_mean"] = tokens / max(completions, 1.0)
    metrics["rewards_nonfinite"] = int(completions - scored)
    metrics["reward_errors"] = int(errors)
    metrics["reward_timeouts"] = int(timeouts)
    if judged:
        metrics.update(judged=int(judged), judge_missing=int(judge_missing))
    return metrics


def log_step(run: Run, metrics: dict, attempts: list[Attempt]) -> None:
    """Count the step's reward problems, append its metrics to metrics.jsonl, the progress bar and trackers;
    record its rollouts (`attempts`) for viewing every trainer.log_rollouts_every steps."""
    state, trainer = run.state, run.trainer
    state.counters["reward_errors"] += metrics["reward_errors"]
    state.counters["rewards_nonfinite"] += metrics["rewards_nonfinite"]
    state.counters["reward_timeouts"] += metrics["reward_timeouts"]
    state.record["train_seconds"] += metrics["step_s"]
    if metrics["reward_timeouts"]:
        run.warn(f"some completions were not scored within trainer.reward_budget_s={trainer.reward_budget_s} s "
                 "of reward time per step; they scored 0 and are counted per step as reward_timeouts in "
                 "metrics.jsonl (raise the budget or trainer.reward_workers, or make the task's rewards faster).")
    if metrics["rewards_nonfinite"]:
        run.warn(f"some completions got a NaN or infinite reward ({_nonfinite_rewards(run, attempts)}); their groups "
                 "are left out of the update and counted per step as rewards_nonfinite in metrics.jsonl.")
    state.history.append(metrics)
    if run.main:  # a line cut short by a full disk is dropped by the resume (truncate_metrics)
        with writing(f"append step {state.step} to metrics.jsonl", run.output_dir), \
                run.metrics_file.open("a") as handle:
            handle.write(json.dumps(metrics) + "\n")
        run.bar.set_postfix(reward=f"{metrics['reward_mean']:.2f}", valid=f"{metrics['valid_fraction']:.2f}",
                            alpha=f"{metrics['alpha']:.2f}")
        run.bar.update(1)
    if trainer.report_to != "none":
        run.accelerator.log({k: v for k, v in metrics.items() if not isinstance(v, list)}, step=state.step)
    with writing(f"write step {state.step}'s rollouts", run.output_dir):
        log_rollouts(state.step, attempts, policy=run.learner.policy, task=run.data.task, output_dir=run.output_dir,
                     every=trainer.log_rollouts_every, groups=trainer.log_rollouts_groups,
                     accelerator=run.accelerator)


def _nonfinite_rewards(run: Run, attempts: list[Attempt]) -> str:
    """Which rewards were NaN or infinite: the names this process saw (its completions' reward components, and the
    task's count); "on another process" only when this process saw none and there are others."""
    names = set(getattr(run.data.task, "reward_nonfinite", {}))
    for attempt in attempts:
        names.update(name for name, values in (getattr(attempt, "components", None) or {}).items()
                     if torch.is_tensor(values) and not torch.isfinite(values).all())
    if names:
        return f"reward {', '.join(sorted(names))}"
    if run.accelerator.num_processes > 1:
        return "on another process"
    return "the weighted sum of the task's rewards"
