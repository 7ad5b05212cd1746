"""Group advantages: the registered estimators (group_mean, std_normalized, none) and the deprecated
trainer.baseline / trainer.std_normalize keys."""

from __future__ import annotations

import sys
from typing import Annotated

import torch
from torch import Tensor

from gpg_vl.config.keys import option
from gpg_vl.errors import UserError
from gpg_vl.objective.registry import register_advantage

GRPO_STD_EPS = 1e-4


def group_advantages(
    rewards: Tensor, *, std_normalize: bool = False, eps: float = 1e-5
) -> tuple[Tensor, Tensor]:
    """rewards [B, G] -> (advantages [B, G], valid [B] bool).  Validity on the population std, the GRPO
    scaling on the sample std; see module doc."""
    rewards = rewards if rewards.is_floating_point() else rewards.float()  # [B, G]
    mean = rewards.mean(dim=1, keepdim=True)  # [B, 1]
    spread = rewards.std(dim=1, unbiased=False)  # [B] population std: the validity test
    valid = torch.isfinite(rewards).all(dim=1) & (spread > eps)  # [B]
    adv = rewards - mean  # [B, G] (NaN/inf rows are zeroed below)
    if std_normalize and rewards.shape[1] > 1:  # sample std (G - 1); with G == 1 every group is invalid
        adv = adv / (rewards.std(dim=1, keepdim=True) + GRPO_STD_EPS)  # [B, G]
    adv = torch.where(valid.unsqueeze(1), adv, torch.zeros_like(adv))  # [B, G]
    return adv, valid


@register_advantage("group_mean")
def group_mean_advantages(rewards: Tensor) -> tuple[Tensor, Tensor]:
    """GPG (and Dr. GRPO): ``A_i = r_i - mean(r)``; valid when the rewards differ."""
    return group_advantages(rewards)


@register_advantage("std_normalized")
def std_normalized_advantages(rewards: Tensor) -> tuple[Tensor, Tensor]:
    """GRPO: ``A_i = (r_i - mean(r)) / (std(r) + 1e-4)``, torch's default (sample) std; valid when the rewards
    differ (population std > 1e-5)."""
    adv, valid = group_advantages(rewards)  # [B, G], [B]
    if rewards.shape[1] < 2:  # the sample std of one reward is undefined; such a group is invalid anyway
        return adv, valid
    std = torch.where(valid.unsqueeze(1), rewards.to(adv.dtype), torch.zeros_like(adv)).std(dim=1, keepdim=True)
    return adv / (std + GRPO_STD_EPS), valid


@register_advantage("none")
def raw_reward_advantages(rewards: Tensor, *, eps: Annotated[float, option(
        "the smallest |reward| that counts as signal", low=0)] = 1e-5) -> tuple[Tensor, Tensor]:
    """No baseline: ``A_i = r_i``.  Valid when some |r_i| > eps and all rewards are finite.

    Equal nonzero rewards still carry gradient here, so such a group is valid; an all-zero group is not.
    """
    rewards = rewards if rewards.is_floating_point() else rewards.float()  # [B, G]
    valid = torch.isfinite(rewards).all(dim=1) & (rewards.abs() > eps).any(dim=1)  # [B]
    adv = torch.where(valid.unsqueeze(1), rewards, torch.zeros_like(rewards))  # [B, G]
    return adv, valid


# (trainer.baseline, trainer.std_normalize), the deprecated pair of keys -> trainer.advantage
_ESTIMATOR_NAMES = {("group_mean", False): "group_mean", ("group_mean", True): "std_normalized",
                    ("none", False): "none"}
BASELINES = sorted({baseline for baseline, _ in _ESTIMATOR_NAMES})  # what trainer.baseline may hold


def estimator_name(baseline: str, std_normalize: bool) -> str:
    """The advantage estimator the deprecated keys ``trainer.baseline`` and ``trainer.std_normalize`` chose."""
    if baseline not in BASELINES:
        raise UserError(f"unknown trainer.baseline {baseline!r}; valid options: {', '.join(BASELINES)} "
                        "(trainer.baseline is deprecated: use trainer.advantage).")
    if (baseline, bool(std_normalize)) not in _ESTIMATOR_NAMES:
        raise UserError("trainer.std_normalize=true divides by the group's std around its mean, which needs the "
                        "group baseline; set trainer.advantage=std_normalized (these two keys are deprecated).")
    return _ESTIMATOR_NAMES[(baseline, bool(std_normalize))]


def advantage_from_deprecated(advantage: str, baseline: str | None, std_normalize: bool | None) -> str:
    """`trainer.advantage`, or what the deprecated `trainer.baseline` / `trainer.std_normalize` ask for (one
    warning); a contradiction between them and `trainer.advantage` fails in one sentence."""
    if baseline is None and std_normalize is None:
        return advantage
    chosen = estimator_name("group_mean" if baseline is None else baseline, bool(std_normalize))
    if advantage not in ("group_mean", chosen):
        raise UserError(f"trainer.advantage={advantage} contradicts the deprecated trainer.baseline / "
                        f"trainer.std_normalize (which ask for {chosen}); drop the deprecated keys.")
    print(f"warning: trainer.baseline and trainer.std_normalize are deprecated; use trainer.advantage={chosen}.",
          file=sys.stderr)
    return chosen
