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

A task with a judge (gpg_vl/reward/judge.py) that says which question each completion puts to it
(`Task.judge_question`) has the batch's questions asked first, all at once, `judge.concurrency` of them in flight
(on the same daemon threads, within the same budget), so the rewards then read the judge's memo. Each completion's
scoring counts what it asked the judge (`judge_tally`): `Scores.judged` and `Scores.judge_missing` are the
completions that asked it and those that got no score from it. A judge that is down (`judge.lost`) is raised
after the batch: the trainer writes a checkpoint and stops.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

from gpg_vl.data.task import takes_trajectory
from gpg_vl.reward.judge import judge_tally


class RewardBudget:
    """The reward time one training step may still spend, in seconds (`seconds <= 0`: no limit)."""

    def __init__(self, seconds: float) -> None:
        self.left = float(seconds) if seconds > 0 else math.inf

    def spend(self, seconds: float) -> None:
        self.left -= seconds


class Scores(NamedTuple):
    """A batch's scores: `task.reward_components` of each completion, in order; `timeouts`, the completions not
    scored within the budget (0 for every reward); `errors`, the reward function calls that raised (each 0);
    `judged`, the completions whose scoring asked the judge; `judge_missing`, those the judge gave no score (NaN)."""

    scores: list[dict[str, float]]
    timeouts: int
    errors: int
    judged: int = 0
    judge_missing: int = 0


def score_completions(task, completions: Sequence[str], rows: Sequence[dict], *, workers: int = 1,
                      budget: RewardBudget | None = None, trajectories: Sequence | None = None) -> Scores:
    """Each completion's reward components, with the counts of timeouts, reward errors and the judge's answers
    (`Scores`). `trajectories`: each completion's multi-turn Trajectory (its rewards receive it), or None. Raises
    the judge's `lost` (an EngineUnreachable) when the judge is down."""
    scored = _score(task, completions, rows, workers=workers, budget=budget, trajectories=trajectories)
    zero = dict.fromkeys(task.reward_functions, 0.0)
    done = [s for s in scored if s is not None]
    return Scores([dict(zero) if s is None else s[0] for s in scored], len(scored) - len(done),
                  sum(s[1] for s in done), sum(s[2].asked > 0 for s in done), sum(s[2].missing > 0 for s in done))


def score_within(task, completions: Sequence[str], rows: Sequence[dict], *, workers: int = 1,
                 budget: RewardBudget | None = None,
                 trajectories: Sequence | None = None) -> list[dict[str, float] | None]:
    """Each completion's reward components, None for each one not scored within `budget`."""
    return [None if s is None else s[0] for s in _score(task, completions, rows, workers=workers, budget=budget,
                                                        trajectories=trajectories)]


def _score(task, completions: Sequence[str], rows: Sequence[dict], *, workers: int, budget: RewardBudget | None,
           trajectories: Sequence | None = None) -> list[tuple | None]:
    """(`task.scored_components`..., the judge's `Tally`) of each pair, None where the budget ran out first."""
    budget = budget or RewardBudget(0)
    trajectories = [None] * len(completions) if trajectories is None else list(trajectories)
    started = time.monotonic()
    judge = getattr(task, "judge", None)
    if judge is not None:
        _ask_judge(task, judge, completions, rows, started + budget.left)

    def scored(index: int) -> tuple:
        return _scored(task, completions[index], rows[index], trajectories[index])

    if workers <= 1:
        scores = _in_this_thread(scored, len(completions), started + budget.left)
    else:
        scores = in_threads(scored, len(completions), workers, budget.left - (time.monotonic() - started))
    budget.spend(time.monotonic() - started)
    lost = getattr(judge, "lost", None)
    if lost is not None:
        raise lost
    return scores


def _ask_judge(task, judge, completions: Sequence[str], rows: Sequence[dict], deadline: float) -> None:
    """The batch's questions to the judge (`task.judge_question` of each completion), asked at once, at most
    `judge.concurrency` in flight, until `deadline`: the rewards then read the judge's memo."""
    asking = getattr(task, "judge_question", None)
    if asking is None or not hasattr(judge, "score"):  # a plain function as a judge: its rewards ask it
        return
    questions = list(dict.fromkeys(q for q in (_question(task, asking, c, r)
                                               for c, r in zip(completions, rows, strict=True)) if q is not None))
    if questions:
        in_threads(lambda index: judge.score(questions[index]), len(questions), getattr(judge, "concurrency", 1),
                   deadline - time.monotonic())


def _question(task, asking, completion: str, row: dict):
    """`task.judge_question` of one completion; None where it raises (the reward then asks the judge itself, or
    raises and is counted as a reward error)."""
    try:
        return asking(completion, task.scoring_row(row))
    except Exception:  # noqa: BLE001 (odd output must not end the run: the reward's own call decides)
        return None


def _scored(task, completion: str, row: dict, trajectory) -> tuple[dict[str, float], int, object]:
    """The task's `scored_components` and what they asked the judge (`Tally`); the trajectory passed on where
    there is one and the task takes it (an older task's override may not)."""
    with judge_tally() as tally:
        if trajectory is not None and takes_trajectory(task.scored_components):
            scores, raised = task.scored_components(completion, row, trajectory=trajectory)
        else:
            scores, raised = task.scored_components(completion, row)
    return scores, raised, tally


def _in_this_thread(fn: Callable[[int], object], count: int, deadline: float) -> list:
    return [fn(index) if time.monotonic() < deadline else None for index in range(count)]


def in_threads(fn: Callable[[int], object], count: int, workers: int, seconds: float) -> list:
    """`fn(index)` for index in range(count) on up to `workers` daemon threads, waiting at most `seconds` (inf: no
    limit); None for each index not done by then (a call still running finishes, but no further one starts)."""
    results: list = [None] * count
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
                results[index] = fn(index)
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
