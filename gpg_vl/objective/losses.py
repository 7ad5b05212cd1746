"""The policy losses of GPG and the GRPO family: gpg (no ratio), and the clipped surrogate behind grpo, dr_grpo
and dapo, with what every ratio loss starts from (`ratio_inputs`, the off-policy mask, the ratio metrics)."""

from __future__ import annotations

import torch
from torch import Tensor

from gpg_vl.errors import UserError
from gpg_vl.objective.aggregation import MaxTokens, _aggregate, _base_metrics, _masked_mean, weigh
from gpg_vl.objective.options import ClipHigh, ClipLow, KlCoef, MaskThreshold
from gpg_vl.objective.registry import register_policy_loss


@register_policy_loss("gpg")
def policy_loss(
    token_logps: Tensor,
    completion_mask: Tensor,
    advantages: Tensor,
    *,
    old_logps: Tensor | None = None,
    ref_logps: Tensor | None = None,
    aggregation: str = "seq_mean_token_mean",
    normalizer: float | None = None,
    max_tokens: MaxTokens = None,
    weights: Tensor | None = None,
    **options,
) -> tuple[Tensor, dict[str, float]]:
    """GPG loss. token_logps [N, L], completion_mask [N, L] (bool or 0/1), advantages [N] (or per token [N, L]:
    a teacher's, gpg_vl/objective/teacher_losses.py).

    No ratio, no clipping, no KL: `old_logps`, `ref_logps` and other options are not used. `weights` [N, L]: the
    off-policy correction's, per token -sg(w) * A * log pi (None: w = 1).
    Masked positions are selected out with ``torch.where`` (so even -inf/NaN padding log-probs
    give neither NaN loss nor NaN gradient).  Returns (scalar loss, float metrics).
    """
    mask = completion_mask.bool()  # [N, L]
    adv = advantages.detach().to(token_logps.dtype)  # [N] or [N, L]
    per_token = -weigh(token_logps, weights) * per_token_advantages(adv)  # [N, L] (w log pi first: as the trainer had)
    per_token = torch.where(mask, per_token, torch.zeros_like(per_token))  # [N, L]
    loss = _aggregate(per_token, mask, aggregation, normalizer, max_tokens)  # []
    with torch.no_grad():
        metrics = _base_metrics(loss, token_logps, mask, adv)
    return loss, metrics


_OPSM = "off_policy_mask_threshold"  # TRL's name of DeepSeek-V3.2's off-policy mask threshold (`off_policy_mask`)


def ratio_inputs(token_logps: Tensor, completion_mask: Tensor, advantages: Tensor,
                 old_logps: Tensor | None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(mask [N, L] bool, logps [N, L] with padding zeroed, old [N, L] detached (logps detached when `old_logps`
    is None: ratio 1), advantages [N, 1] detached): what every ratio loss starts from. Padding (maybe -inf) is
    selected out before any arithmetic."""
    mask = completion_mask.bool()  # [N, L]
    zeros = torch.zeros_like(token_logps)
    logps = torch.where(mask, token_logps, zeros)  # [N, L]
    old = logps.detach() if old_logps is None else torch.where(mask, old_logps.to(logps.dtype), zeros).detach()
    return mask, logps, old, per_token_advantages(advantages.detach().to(logps.dtype))


def per_token_advantages(advantages: Tensor) -> Tensor:
    """advantages [N] -> [N, 1] (one per sequence, broadcast over its tokens); per-token ones [N, L] as they are
    (a teacher's: A_t = A_group + coef * sg(log teacher - log student), gpg_vl/objective/teacher_losses.py)."""
    return advantages.unsqueeze(1) if advantages.dim() == 1 else advantages


def sequence_mean(values: Tensor, mask: Tensor) -> Tensor:
    """values [N, L] -> [N, 1]: the mean over each sequence's unmasked tokens (0 for an empty sequence)."""
    return torch.where(mask, values, torch.zeros_like(values)).sum(dim=1, keepdim=True) / \
        mask.sum(dim=1, keepdim=True).clamp(min=1).to(values.dtype)


def off_policy_mask(adv: Tensor, logps: Tensor, old: Tensor, mask: Tensor, threshold: float | None) -> Tensor:
    """DeepSeek-V3.2's off-policy sequence mask (TRL's `off_policy_mask_threshold`, delta of its equation 9).

    adv [N, 1], logps / old [N, L] -> keep [N, 1] (1.0 keep, 0.0 drop): a sequence is dropped when its advantage
    is negative AND its mean per-token KL(old || current), mean(old - logp), exceeds `threshold`. None keeps all.
    """
    if threshold is None:
        return torch.ones_like(adv)
    kl = sequence_mean(torch.nan_to_num(old - logps.detach(), nan=0.0), mask)  # [N, 1]
    return ((adv >= 0) | (kl <= threshold)).to(logps.dtype)


def _ratio_metrics(loss: Tensor, token_logps: Tensor, mask: Tensor, adv: Tensor, ratio: Tensor,
                   keep: Tensor | None, drift: Tensor) -> dict[str, float]:
    """The base metrics, ratio_mean / ratio_max over unmasked tokens, logp_drift (token mean of `drift` = logp -
    old), kl and the clip fractions at 0 (a loss with a KL or a clip sets its own), and (with the off-policy mask
    on) the fraction of sequences it dropped, `off_policy_masked`."""
    metrics = _base_metrics(loss, token_logps, mask, adv.squeeze(1))
    ratio = ratio.detach().expand(mask.shape)
    metrics.update({"ratio_mean": _masked_mean(ratio, mask),
                    "ratio_max": float(torch.where(mask, ratio, torch.zeros_like(ratio)).max()) if mask.any() else 1.0,
                    "logp_drift": _masked_mean(drift.detach(), mask), "kl": 0.0, "clip_fraction_low": 0.0,
                    "clip_fraction_high": 0.0})
    if keep is not None:
        metrics["off_policy_masked"] = float((keep == 0).to(torch.float64).mean()) if keep.numel() else 0.0
    return metrics


def clipped_surrogate(
    token_logps: Tensor, completion_mask: Tensor, advantages: Tensor, *, old_logps: Tensor | None = None,
    ref_logps: Tensor | None = None, clip_low: float = 0.2, clip_high: float | None = None, kl_coef: float = 0.0,
    weights: Tensor | None = None, **aggregate,
) -> tuple[Tensor, dict[str, float]]:
    """PPO's clipped surrogate, per token, plus ``kl_coef`` x the k3 KL estimate to the reference.

    token_logps, old_logps, ref_logps, completion_mask [N, L]; advantages [N].  ratio = exp(logp - old)
    (old = logp detached when `old_logps` is None: ratio 1, the gradient of a plain policy gradient);
    per token ``-min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A) + kl_coef * k3`` with
    ``k3 = exp(ref - logp) - (ref - logp) - 1``.  `aggregate` may also hold `level`: "sequence" (GSPO, TRL's
    importance_sampling_level) takes one ratio per sequence, exp of the mean of its tokens' log ratios, on every
    token ("token", the default: one per token); and `off_policy_mask_threshold`: DeepSeek-V3.2's sequence mask
    (`off_policy_mask`) on the surrogate (None, the default: off). `weights` [N, L]: the off-policy correction's,
    sg(w) times the clipped surrogate of each token (the ratio and the KL term are untouched). Metrics: kl (token
    mean of k3), clip_fraction_low / clip_fraction_high (tokens whose ratio is clipped below / above, where the clip
    takes the gradient away), ratio_mean, ratio_max, logp_drift (token mean of logp - old), off_policy_masked.
    `aggregate`: how the per-token loss is reduced (`aggregation`, default seq_mean_token_mean; the global
    `normalizer`; `max_tokens`).
    """
    mask, logps, old, adv = ratio_inputs(token_logps, completion_mask, advantages, old_logps)
    zeros = torch.zeros_like(logps)
    high = clip_low if clip_high is None else clip_high
    level, off_policy_mask_threshold = aggregate.get("level", "token"), aggregate.get(_OPSM)
    log_ratio = logps - old  # [N, L]
    if level == "sequence":
        log_ratio = sequence_mean(log_ratio, mask).expand_as(logps)  # [N, L] one value per sequence
    elif level != "token":
        raise ValueError(f"unknown importance sampling level {level!r}; valid: token, sequence")
    ratio = torch.exp(log_ratio)  # [N, L]
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + high)  # [N, L]
    keep = off_policy_mask(adv, logps, old, mask, off_policy_mask_threshold)  # [N, 1]
    per_token = weigh(-torch.minimum(ratio * adv, clipped * adv) * keep, weights)  # [N, L]
    kl = zeros
    if kl_coef:
        if ref_logps is None:
            raise ValueError("kl_coef > 0 needs ref_logps (the reference model's log-probs)")
        delta = torch.where(mask, ref_logps.to(logps.dtype), zeros).detach() - logps  # [N, L]
        kl = torch.exp(delta) - delta - 1.0  # [N, L] k3, >= 0
        per_token = per_token + kl_coef * kl
    per_token = torch.where(mask, per_token, zeros)  # [N, L]
    loss = _aggregate(per_token, mask, aggregate.get("aggregation", "seq_mean_token_mean"),
                      aggregate.get("normalizer"), aggregate.get("max_tokens"))  # []
    with torch.no_grad():
        metrics = _ratio_metrics(loss, token_logps, mask, adv, ratio, None if off_policy_mask_threshold is None
                                 else keep, logps - old)
        ratio = ratio.detach()
        metrics.update({
            "kl": _masked_mean(kl.detach(), mask),
            "clip_fraction_low": _masked_mean(((ratio < 1.0 - clip_low) & (adv < 0)).to(logps.dtype), mask),
            "clip_fraction_high": _masked_mean(((ratio > 1.0 + high) & (adv > 0)).to(logps.dtype), mask),
        })
    return loss, metrics


@register_policy_loss("grpo", needs=("old", "ref"))
def grpo_loss(token_logps: Tensor, completion_mask: Tensor, advantages: Tensor, *, clip_low: ClipLow = 0.2,
              clip_high: ClipHigh = None, kl_coef: KlCoef = 0.0, off_policy_mask_threshold: MaskThreshold = None,
              **inputs):
    """GRPO (DeepSeekMath, R1-V's trainer): clipped ratio (default eps 0.2), k3 KL to the reference with
    `kl_coef`, and the aggregation given (per-sequence token mean, then mean, by default)."""
    return clipped_surrogate(token_logps, completion_mask, advantages, clip_low=clip_low, clip_high=clip_high,
                             kl_coef=kl_coef, off_policy_mask_threshold=off_policy_mask_threshold, **inputs)


@register_policy_loss("dr_grpo", needs=("old",), aggregation="seq_mean_token_sum")
def dr_grpo_loss(token_logps: Tensor, completion_mask: Tensor, advantages: Tensor, *, clip_low: ClipLow = 0.2,
                 clip_high: ClipHigh = None, max_tokens: MaxTokens = None,
                 off_policy_mask_threshold: MaskThreshold = None, **inputs):
    """Dr. GRPO: the clipped ratio, each sequence's token sum over the constant `max_tokens` (the trainer
    passes rollout.max_new_tokens), no KL."""
    if not max_tokens:
        raise UserError("policy loss dr_grpo needs the option max_tokens (the completion length limit each "
                        "sequence's token sum is divided by; the trainer passes rollout.max_new_tokens).")
    return clipped_surrogate(token_logps, completion_mask, advantages, clip_low=clip_low, clip_high=clip_high,
                             max_tokens=max_tokens, off_policy_mask_threshold=off_policy_mask_threshold,
                             **{**inputs, "kl_coef": 0.0})


@register_policy_loss("dapo", needs=("old",), aggregation="token_mean")
def dapo_loss(token_logps: Tensor, completion_mask: Tensor, advantages: Tensor, *, clip_low: ClipLow = 0.2,
              clip_high: ClipHigh = 0.28, off_policy_mask_threshold: MaskThreshold = None, **inputs):
    """DAPO: clip-higher (eps_low 0.2, eps_high 0.28 by default), the token mean over the batch, no KL."""
    return clipped_surrogate(token_logps, completion_mask, advantages, clip_low=clip_low, clip_high=clip_high,
                             off_policy_mask_threshold=off_policy_mask_threshold, **{**inputs, "kl_coef": 0.0})
