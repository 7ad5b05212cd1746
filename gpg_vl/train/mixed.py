"""The training side of a task mixture (task=mix, gpg_vl/data/mixture.py): each task's engine and rollout settings,
and each task's figures of a step. `run` is gpg_vl/train/loop.py's Run."""

from __future__ import annotations

from dataclasses import replace

import torch

from gpg_vl.data.mixture import Mixture
from gpg_vl.rollout.engine import build_engine
from gpg_vl.train.step.sample import reward_names
from gpg_vl.train.step_log import step_metrics, trajectory_step_metrics


def mixture_engines(mixture: Mixture, rollout, policy, accelerator) -> tuple[dict, dict]:
    """(name -> rollout settings, name -> engine): each task with the rollout settings it owns over the run's, and an
    engine offering its tools (multi-turn only where it has them); an engine with weights of its own (vLLM) is built
    once and shared (`require_shared_run` made sure the tasks' settings agree)."""
    rollouts = {name: replace(rollout, **mixture.rollouts[name]) for name in mixture.tasks}
    shared = None if rollout.engine == "hf" else build_engine(rollout, policy, accelerator=accelerator,
                                                              tools=mixture.tools)
    engines = {name: shared or build_engine(rollouts[name], policy, accelerator=accelerator, tools=task.tools)
               for name, task in mixture.tasks.items()}
    return rollouts, engines


def task_step_metrics(run, collected) -> dict[str, float]:
    """task=mix: each task's step figures under `<task>/`: its reward components and total, accuracy, valid-group
    fraction, completion length, groups (`step_metrics`, the totals' own), its multi-turn figures (tool calls,
    turns) when it rolls out trajectories, and with a teacher its teacher_kl (`task_teacher_kl`). Collective (every
    process, each task in the mixture's order); {} for a single task."""
    task, accelerator = run.data.task, run.accelerator
    if not isinstance(task, Mixture):
        return {}
    found = {}
    for name, one in task.tasks.items():
        mine = replace(collected, attempts=[a for a in collected.attempts if a.task == name])
        figures = step_metrics(mine, accelerator, reward_names(one, run.trainer))
        groups, valid = accelerator.reduce(torch.tensor(
            [float(sum(a.valid.numel() for a in mine.attempts)), float(sum(int(a.valid.sum()) for a in mine.attempts))],
            dtype=torch.float64, device=accelerator.device), "sum").tolist()
        figures.update({"valid_fraction": valid / groups if groups else 0.0, "groups_sampled": int(groups),
                        "groups_used": int(valid)})
        if "reward/accuracy" in figures:
            figures["accuracy"] = figures["reward/accuracy"]
        if run.data.engines[name].multiturn.multi_turn:
            figures.update(trajectory_step_metrics(mine, accelerator))
        if run.learner.teacher is not None and run.learner.teacher.needs(name) == "logps":
            figures["teacher_kl"] = task_teacher_kl(mine.attempts, accelerator)
        found.update({f"{name}/{key}": value for key, value in figures.items()})
    return found


def task_teacher_kl(attempts: list, accelerator) -> float:
    """One task's teacher_kl: the token mean of log student - log teacher over its attempts' counted completion
    tokens, over all processes (the log-probs the update kept on each rollout, `Rollout.token_logps`: the same
    numbers as the step's teacher_kl, grouped by task; a sequence the off-policy correction rejected counts here,
    not there). Collective."""
    total, count = 0.0, 0
    for attempt in attempts:
        rollout = attempt.rollout
        if rollout is None or rollout.token_logps is None:
            continue
        counted = (rollout.completion_mask if rollout.loss_mask is None else rollout.loss_mask).bool().cpu()  # [n, C]
        gap = rollout.token_logps["student"].double() - rollout.token_logps["teacher"].double()  # [n, C]
        total, count = total + float(gap[counted].sum()), count + int(counted.sum())
    total, count = accelerator.reduce(torch.tensor([total, float(count)], dtype=torch.float64,
                                                   device=accelerator.device), "sum").tolist()
    return total / max(count, 1.0)
