"""GPG objective (arXiv 2504.02546): group advantages and the policy-gradient loss.

For each prompt we sample G completions o_1..o_G with scalar rewards r_i.

* Advantage (F_norm = 1, the GPG default): ``A_i = r_i - mean(r)``.  With
  ``std_normalize=True`` (GRPO-style variant): ``A_i = (r_i - mean(r)) / (std(r) + 1e-4)``, where
  ``std`` is torch's default, the Bessel-corrected *sample* std (``sum((r - mean)^2) / (G - 1)``, square
  root), as TRL (``scale_rewards="group"``), verl, EasyR1 and the GPG authors' fork divide by.
* A group is *valid* when its *population* std (``unbiased=False``) is ``> eps``.  Invalid groups
  (all rewards equal, G == 1, or any non-finite reward) get zero advantages, never NaN.
* Loss (no ratio, no clipping, no KL), "seq_mean_token_mean" (the paper's formula)::

      L = -1/N * sum_i 1/|o_i| * sum_t logp(o_i,t) * A_i

  "token_mean" instead divides the sum over all unmasked tokens by their total count T.
* AGE (accurate gradient estimation): with B groups of which M are invalid, the paper scales
  the batch-mean gradient by ``alpha = B / (B - M)``.  Invalid groups contribute exactly zero,
  so the mean over the B*G sequences times alpha equals the mean over the (B-M)*G valid
  sequences.  The trainer therefore feeds only sequences of valid groups to ``policy_loss``;
  ``age_alpha`` is kept for logging and for checking that identity.
* Micro-batching / multi-process: pass ``normalizer`` = the *global* denominator (number of
  sequences, or of unmasked tokens for "token_mean"); summing the per-micro-batch losses then
  equals the full-batch loss, and so do the summed gradients.

Variants for ablations, each a swappable pure function picked from a registry by name:

* ``ADVANTAGE_ESTIMATORS``: "group_mean" (GPG), "std_normalized" (GRPO-style) and "none" (plain
  policy gradient: ``A_i = r_i``).  Each returns ``(advantages, valid)``, and *valid* always means
  "some advantage of the group is nonzero", i.e. the group carries gradient.  For the group-mean
  estimators that is "rewards differ"; without a baseline a group of equal NONZERO rewards does carry
  gradient (every completion is pushed up), and only an all-zero group is invalid.  The trainer
  forwards, counts in alpha and resamples on exactly these groups, so what resampling looks for is
  what the estimator treats as signal.
* ``LOSS_NORMALIZERS``: AGE on (the loss is the mean over the sequences of valid groups, i.e. alpha =
  B / (B - M)) or off (the mean over every sampled sequence, invalid groups counted in the
  denominator, i.e. alpha = 1).  Invalid groups add exactly zero to the sum either way, so they are
  never forwarded: only the denominator changes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from gpg_vl.errors import UserError

GRPO_STD_EPS = 1e-4

Aggregation = Callable[[Tensor, Tensor, float | None], Tensor]  # (per_token, mask, normalizer)


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


def _denominator(local_count: float, normalizer: float | None) -> float:
    """Local count unless a global ``normalizer`` is given; clamped at 1 so empty batches give 0."""
    return max(float(local_count if normalizer is None else normalizer), 1.0)


def _seq_mean_token_mean(per_token: Tensor, mask: Tensor, normalizer: float | None) -> Tensor:
    """Token mean per sequence, then mean over sequences (empty rows count, contribute 0)."""
    lengths = mask.sum(dim=1).clamp(min=1).to(per_token.dtype)  # [N]
    per_seq = per_token.sum(dim=1) / lengths  # [N]
    return per_seq.sum() / _denominator(per_token.shape[0], normalizer)


def _token_mean(per_token: Tensor, mask: Tensor, normalizer: float | None) -> Tensor:
    """Sum over all unmasked tokens divided by their total count."""
    return per_token.sum() / _denominator(int(mask.sum()), normalizer)


AGGREGATIONS: dict[str, Aggregation] = {
    "seq_mean_token_mean": _seq_mean_token_mean,
    "token_mean": _token_mean,
}


def policy_loss(
    token_logps: Tensor,
    completion_mask: Tensor,
    advantages: Tensor,
    *,
    aggregation: str = "seq_mean_token_mean",
    normalizer: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """GPG loss. token_logps [N, L], completion_mask [N, L] (bool or 0/1), advantages [N].

    Masked positions are selected out with ``torch.where`` (so even -inf/NaN padding log-probs
    give neither NaN loss nor NaN gradient).  Returns (scalar loss, float metrics).
    """
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {aggregation!r}; valid options: {sorted(AGGREGATIONS)}")
    mask = completion_mask.bool()  # [N, L]
    adv = advantages.detach().to(token_logps.dtype)  # [N]
    per_token = -token_logps * adv.unsqueeze(1)  # [N, L]
    per_token = torch.where(mask, per_token, torch.zeros_like(per_token))  # [N, L]
    loss = AGGREGATIONS[aggregation](per_token, mask, normalizer)  # []

    with torch.no_grad():
        num_tokens = int(mask.sum())
        logps = torch.where(mask, token_logps.detach(), torch.zeros_like(token_logps))  # [N, L]
        n = adv.shape[0]
        metrics = {
            "loss": float(loss.detach()),
            "advantage_mean": float(adv.mean()) if n else 0.0,
            "advantage_abs_mean": float(adv.abs().mean()) if n else 0.0,
            "num_sequences": float(n),
            "num_tokens": float(num_tokens),
            "logp_mean": float(logps.sum() / num_tokens) if num_tokens else 0.0,
        }
    return loss, metrics


def age_alpha(num_groups: int, num_valid: int) -> float:
    """AGE scale B / (B - M) = num_groups / num_valid (M = invalid groups).

    Returns 0.0 when ``num_valid == 0``: every advantage is zero and no update happens.
    """
    return loss_alpha(True, num_groups, num_valid)


# ----------------------------------------------------------------------------- variants (ablations)
AdvantageEstimator = Callable[[Tensor], tuple[Tensor, Tensor]]  # rewards [B, G] -> (advantages [B, G], valid [B])
Normalizer = Callable[[float, float], float]  # (count over valid groups, count over all sampled groups) -> denominator


def group_mean_advantages(rewards: Tensor) -> tuple[Tensor, Tensor]:
    """GPG: ``A_i = r_i - mean(r)``; valid when the rewards differ."""
    return group_advantages(rewards)


def std_normalized_advantages(rewards: Tensor) -> tuple[Tensor, Tensor]:
    """GRPO-style: ``A_i = (r_i - mean(r)) / (std(r) + 1e-4)``; valid when the rewards differ."""
    return group_advantages(rewards, std_normalize=True)


def raw_reward_advantages(rewards: Tensor, *, eps: float = 1e-5) -> tuple[Tensor, Tensor]:
    """No baseline: ``A_i = r_i``.  Valid when some |r_i| > eps and all rewards are finite.

    Equal nonzero rewards still carry gradient here, so such a group is valid; an all-zero group is not.
    """
    rewards = rewards if rewards.is_floating_point() else rewards.float()  # [B, G]
    valid = torch.isfinite(rewards).all(dim=1) & (rewards.abs() > eps).any(dim=1)  # [B]
    adv = torch.where(valid.unsqueeze(1), rewards, torch.zeros_like(rewards))  # [B, G]
    return adv, valid


ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {
    "group_mean": group_mean_advantages,
    "std_normalized": std_normalized_advantages,
    "none": raw_reward_advantages,
}
# (trainer.baseline, trainer.std_normalize) -> estimator name
_ESTIMATOR_NAMES = {("group_mean", False): "group_mean", ("group_mean", True): "std_normalized",
                    ("none", False): "none"}


def estimator_name(baseline: str, std_normalize: bool) -> str:
    """The advantage estimator chosen by ``trainer.baseline`` and ``trainer.std_normalize``."""
    baselines = sorted({b for b, _ in _ESTIMATOR_NAMES})
    if baseline not in baselines:
        raise UserError(f"unknown trainer.baseline {baseline!r}; valid options: {', '.join(baselines)}.")
    if (baseline, bool(std_normalize)) not in _ESTIMATOR_NAMES:
        raise UserError("trainer.std_normalize=true divides by the group's std around its mean, which needs the "
                        "group baseline; set trainer.baseline=group_mean or trainer.std_normalize=false.")
    return _ESTIMATOR_NAMES[(baseline, bool(std_normalize))]


def age_normalizer(valid_count: float, sampled_count: float) -> float:
    """AGE on: the mean over valid groups' sequences (or tokens), = alpha * the mean over all sampled."""
    return valid_count


def all_sampled_normalizer(valid_count: float, sampled_count: float) -> float:
    """AGE off: the mean over every sampled sequence (or token), invalid groups included (alpha = 1)."""
    return sampled_count


LOSS_NORMALIZERS: dict[bool, Normalizer] = {True: age_normalizer, False: all_sampled_normalizer}  # key: trainer.age


def loss_alpha(age: bool, num_groups: int, num_valid: int) -> float:
    """The scale applied to the mean over all `num_groups` sampled groups: B / normaliser(B - M, B).

    B / (B - M) with AGE, 1 without; 0.0 when no group is valid (no update happens).
    """
    if not 0 <= num_valid <= num_groups:
        raise ValueError(f"need 0 <= num_valid <= num_groups, got {num_valid}, {num_groups}")
    return num_groups / LOSS_NORMALIZERS[age](num_valid, num_groups) if num_valid else 0.0
