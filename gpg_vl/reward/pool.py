"""Scoring a step's completions: several at once, within the step's reward-time budget.

A math check may take its whole time limit (`rewards.math_reward`, 5 s, in a child process that is killed at
the limit), so B * G pathological answers scored one after another would stall a step for minutes.
`score_completions` runs `task.scored_components` on up to `workers` threads (each math check waits on its own
child process, so they overlap), and stops waiting when the step's `RewardBudget` is spent: a completion not
scored by then scores 0 for every reward and is counted as a reward timeout. It returns the scores with both
counts: the timeouts and the reward errors (reward function calls that raised, each scored 0). Rewards are pure
functions of a completion and its row, so the scores do not depend on the order or the thread they are computed in.

The threads are daemons, never joined: a reward that never returns cannot keep the step, or the process at
exit, waiting. With `workers=1` everything runs in the calling thread (for a reward function that needs the
main thread, e.g. one relying on signal.alarm); the budget is then checked before each completion.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections.abc import Sequence
from typing import NamedTuple

from gpg_vl.data.task import takes_trajectory


class RewardBudget:
    """The reward time one training step may still spend, in seconds (`seconds <= 0`: no limit)."""

    def __init__(self, seconds: float) -> None:
        self.left = float(seconds) if seconds > 0 else math.inf

    def spend(self, seconds: float) -> None:
        self.left -= seconds


class Scores(NamedTuple):
    """A batch's scores: `task.reward_components` of each completion, in order; `timeouts`, the completions not
    scored within the budget (0 for every reward); `errors`, the reward function calls that raised (each 0)."""

    scores: list[dict[str, float]]
    timeouts: int
    errors: int


def score_completions(task, completions: Sequence[str], rows: Sequence[dict], *, workers: int = 1,
                      budget: RewardBudget | None = None, trajectories: Sequence | None = None) -> Scores:
    """Each completion's reward components, with the counts of timeouts and reward errors (`Scores`).
    `trajectories`: each completion's multi-turn Trajectory (its rewards receive it), or None."""
    scored = _score(task, completions, rows, workers=workers, budget=budget, trajectories=trajectories)
    zero = dict.fromkeys(task.reward_functions, 0.0)
    return Scores([dict(zero) if s is None else s[0] for s in scored], sum(s is None for s in scored),
                  sum(s[1] for s in scored if s is not None))


def score_within(task, completions: Sequence[str], rows: Sequence[dict], *, workers: int = 1,
                 budget: RewardBudget | None = None,
                 trajectories: Sequence | None = None) -> list[dict[str, float] | None]:
    """Each completion's reward components, None for each one not scored within `budget`."""
    return [None if s is None else s[0] for s in _score(task, completions, rows, workers=workers, budget=budget,
                                                        trajectories=trajectories)]


def _score(task, completions: Sequence[str], rows: Sequence[dict], *, workers: int, budget: RewardBudget | None,
           trajectories: Sequence | None = None) -> list[tuple[dict[str, float], int] | None]:
    """`task.scored_components` of each pair, None where the budget ran out first."""
    budget = budget or RewardBudget(0)
    trajectories = [None] * len(completions) if trajectories is None else list(trajectories)
    started = time.monotonic()
    if workers <= 1:
        scores = _in_this_thread(task, completions, rows, trajectories, started + budget.left)
    else:
        scores = _in_threads(task, completions, rows, trajectories, workers, budget.left)
    budget.spend(time.monotonic() - started)
    return scores


def _scored(task, completion: str, row: dict, trajectory) -> tuple[dict[str, float], int]:
    """The task's `scored_components`; the trajectory passed on where there is one and the task takes it (an
    older task's override may not)."""
    if trajectory is not None and takes_trajectory(task.scored_components):
        return task.scored_components(completion, row, trajectory=trajectory)
    return task.scored_components(completion, row)


def _in_this_thread(task, completions, rows, trajectories, deadline: float) -> list[tuple | None]:
    return [_scored(task, c, r, t) if time.monotonic() < deadline else None
            for c, r, t in zip(completions, rows, trajectories, strict=True)]


def _in_threads(task, completions, rows, trajectories, workers: int, seconds: float) -> list[tuple | None]:
    count = len(completions)
    results: list[tuple | None] = [None] * count
    jobs: queue.SimpleQueue[int] = queue.SimpleQueue()
    for index in range(count):
        jobs.put(index)
    lock, done, stop, left = threading.Lock(), threading.Event(), threading.Event(), [count]

    def work() -> None:
        while not stop.is_set():
            try:
                index = jobs.get_nowait()
            except queue.Empty:
                return
            try:
                results[index] = _scored(task, completions[index], rows[index], trajectories[index])
            finally:
                with lock:
                    left[0] -= 1
                    if left[0] == 0:
                        done.set()

    if count:
        for _ in range(min(workers, count)):
            threading.Thread(target=work, name="gpg_vl reward", daemon=True).start()
        done.wait(None if math.isinf(seconds) else max(seconds, 0.0))
    stop.set()  # a worker still inside a reward finishes it, but takes no further completion
    with lock:
        return list(results)  # a score that arrives after this is not used
