"""AGE (accurate gradient estimation): the loss normalizers, AGE on or off, and alpha."""

from __future__ import annotations

from collections.abc import Callable

Normalizer = Callable[[float, float], float]  # (count over valid groups, count over all sampled groups) -> denominator


def age_normalizer(valid_count: float, sampled_count: float) -> float:
    """AGE on: the mean over valid groups' sequences (or tokens), = alpha * the mean over all sampled."""
    return valid_count


def all_sampled_normalizer(valid_count: float, sampled_count: float) -> float:
    """AGE off: the mean over every sampled sequence (or token), invalid groups included (alpha = 1)."""
    return sampled_count


LOSS_NORMALIZERS: dict[bool, Normalizer] = {True: age_normalizer, False: all_sampled_normalizer}  # key: trainer.age


def loss_alpha(age: bool, num_groups: int, num_valid: int) -> float:
    """The scale applied to the mean over all `num_groups` sampled groups: B / normalizer(B - M, B).

    B / (B - M) with AGE, 1 without; 0.0 when no group is valid (no update happens).
    """
    if not 0 <= num_valid <= num_groups:
        raise ValueError(f"need 0 <= num_valid <= num_groups, got {num_valid}, {num_groups}")
    return num_groups / LOSS_NORMALIZERS[age](num_valid, num_groups) if num_valid else 0.0


def age_alpha(num_groups: int, num_valid: int) -> float:
    """AGE scale B / (B - M) = num_groups / num_valid (M = invalid groups).

    Returns 0.0 when ``num_valid == 0``: every advantage is zero and no update happens.
    """
    return loss_alpha(True, num_groups, num_valid)
