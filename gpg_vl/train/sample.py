"""Threshold resampling (AGE's companion): collect enough groups that carry a learning signal.

A step wants B groups (B = prompts per step, over all processes). Roll out B prompts and score them.
If the valid fraction (groups whose rewards are not all equal) is at least `beta_th`, update on the
valid groups. Otherwise keep the valid groups, roll out B fresh prompts from the same stream, and
accumulate until at least `beta_th * B` valid groups are collected or `max_attempts` rollouts were
made; then update on every accumulated valid group. All of them were sampled from the current
weights, so the update stays on-policy.

This deliberately differs from the paper's released code, which pads the update batch with invalid
groups and drops surplus valid groups that it had already counted in alpha. Here every collected
valid group is used, none is dropped, and the loss is the mean over the sequences of valid groups,
which is exactly alpha = B / (B - M) applied to the mean over all sampled groups.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

Attempt = TypeVar("Attempt")


@dataclass
class Collected(Generic[Attempt]):
    """The attempts of one step and their global counts."""

    attempts: list[Attempt] = field(default_factory=list)
    groups_sampled: int = 0  # global, over all attempts
    groups_valid: int = 0  # global, over all attempts
    valid_fractions: list[float] = field(default_factory=list)  # one per attempt, global


def collect_valid_groups(
    sample_attempt: Callable[[], Attempt],
    count_valid: Callable[[Attempt], tuple[int, int]],
    *,
    beta_th: float,
    batch_size: int,
    max_attempts: int,
) -> Collected[Attempt]:
    """Run attempts until `groups_valid >= beta_th * batch_size` or `max_attempts` is reached.

    `sample_attempt()` draws, rolls out and scores this process's share of B fresh prompts.
    `count_valid(attempt)` returns the GLOBAL (groups, valid groups) of that attempt (one all-reduce),
    so every process takes the same decision and the loop never desynchronises collectives.
    """
    if max_attempts < 1:
        raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
    collected: Collected[Attempt] = Collected()
    for _ in range(max_attempts):
        attempt = sample_attempt()
        groups, valid = count_valid(attempt)
        collected.attempts.append(attempt)
        collected.groups_sampled += groups
        collected.groups_valid += valid
        collected.valid_fractions.append(valid / groups if groups else 0.0)
        if collected.groups_valid >= beta_th * batch_size:
            break
    return collected
