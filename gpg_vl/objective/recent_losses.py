"""TRL 1.16's loss types under TRL's names (bnpo, gspo, luspo, sapo, vespo; each equals TRL's `_compute_loss` on the
same inputs: tests/unit/test_trl_losses.py) and verl's GMPO (`geo_mean`). Each ratio loss also takes TRL's
`off_policy_mask_threshold` (DeepSeek-V3.2's off-policy sequence mask, `off_policy_mask`)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from gpg_vl.objective.aggregation import _aggregate, _base_metrics, _masked_mean, weigh
from gpg_vl.objective.losses import (
    _OPSM,
    _ratio_metrics,
    clipped_surrogate,
    off_policy_mask,
    per_token_advantages,
    ratio_inputs,
    sequence_mean,
)
from gpg_vl.objective.options import CapOption, ClipHigh, ClipLow, MaskThreshold, Temperature, VespoRate, VespoShape
from gpg_vl.objective.registry import register_policy_loss


@register_policy_loss("bnpo", needs=("old",), aggregation="token_mean")
def bnpo_loss(token_logps: Tensor, completion_mask: Tensor, advantages: Tensor, *, clip_low: ClipLow = 0.2,
              clip_high: ClipHigh = None, off_policy_mask_threshold: MaskThreshold = None, **inputs):
    """BNPO (TRL `loss_type="bnpo"`): the clipped surrogate per token, summed over the batch's tokens and divided
    by their count (TRL normalises by the local batch; here by the global token count), no KL."""
    return clipped_surrogate(token_logps, completion_mask, advantages, clip_low=clip_low, clip_high=clip_high,
                             **{**inputs, "kl_coef": 0.0, _OPSM: off_policy_mask_threshold})


@register_policy_loss("gspo", needs=("old",), aggregation="seq_mean_token_mean")
def gspo_loss(token_logps: Tensor, completion_mask: Tensor, advantages: Tensor, *, clip_low: ClipLow = 3e-4,
              clip_high: ClipHigh = 4e-4, off_policy_mask_threshold: MaskThreshold = None, **inputs):
    """GSPO (TRL `loss_type="grpo"` with `importance_sampling_level="sequence"`): one ratio per sequence,
    ``s_i = exp(mean_t (logp - old))``, clipped to [1 - clip_low, 1 + clip_high] (GSPO's 3e-4 / 4e-4), loss
    ``-min(s_i A_i, clip(s_i) A_i)`` per sequence, mean over sequences; no KL."""
    return clipped_surrogate(token_logps, completion_mask, advantages, clip_low=clip_low, clip_high=clip_high,
                             level="sequence", **{**inputs, "kl_coef": 0.0, _OPSM: off_policy_mask_threshold})


@register_policy_loss("luspo", needs=("old",), aggregation="seq_token_sum")
def luspo_loss(token_logps: Tensor, completion_mask: Tensor, advantages: Tensor, *, clip_low: ClipLow = 3e-4,
               clip_high: ClipHigh = 4e-4, off_policy_mask_threshold: MaskThreshold = None, **inputs):
    """LUSPO (TRL `loss_type="luspo"`, sequence-level ratio): GSPO's per-sequence loss times the sequence's length
    (its token sum), mean over sequences; no KL."""
    return clipped_surrogate(token_logps, completion_mask, advantages, clip_low=clip_low, clip_high=clip_high,
                             level="sequence", **{**inputs, "kl_coef": 0.0, _OPSM: off_policy_mask_threshold})


@register_policy_loss("sapo", needs=("old",), aggregation="seq_mean_token_mean")
def sapo_loss(token_logps: Tensor, completion_mask: Tensor, advantages: Tensor, *, temperature_pos: Temperature = 1.0,
              temperature_neg: Temperature = 1.05, off_policy_mask_threshold: MaskThreshold = None,
              **inputs) -> tuple[Tensor, dict[str, float]]:
    """SAPO (TRL `loss_type="sapo"`): a soft gate instead of the clip. Per token, with r = exp(logp - old) and
    tau = `temperature_pos` where A > 0 else `temperature_neg`: ``-sigmoid(tau (r - 1)) * 4 / tau * A``
    (gradient A r at r = 1, fading as r leaves 1); per-sequence token mean, then mean; no KL."""
    mask, logps, old, adv = ratio_inputs(token_logps, completion_mask, advantages, inputs.get("old_logps"))
    ratio = torch.exp(logps - old)  # [N, L]
    tau = torch.where(adv > 0, torch.full_like(adv, temperature_pos), torch.full_like(adv, temperature_neg))  # [N, 1]
    keep = off_policy_mask(adv, logps, old, mask, off_policy_mask_threshold)  # [N, 1]
    per_token = weigh(-torch.sigmoid(tau * (ratio - 1.0)) * 4.0 / tau * adv * keep, inputs.get("weights"))  # [N, L]
    per_token = torch.where(mask, per_token, torch.zeros_like(per_token))
    loss = _aggregate(per_token, mask, inputs.get("aggregation", "seq_mean_token_mean"), inputs.get("normalizer"),
                      None)
    with torch.no_grad():
        metrics = _ratio_metrics(loss, token_logps, mask, adv, ratio, None if off_policy_mask_threshold is None
                                 else keep, logps - old)
    return loss, metrics


def gamma_weights(adv: Tensor, log_ratio: Tensor, mask: Tensor, *, k_pos: float, lambda_pos: float, k_neg: float,
                  lambda_neg: float) -> Tensor:
    """VESPO's weight per sequence, without gradient. adv [N, 1], log_ratio [N, L] -> phi [N, 1].

    w = exp(sum_t clamp(log ratio_t, -20, 20)) (the sequence's ratio, its log clamped to [log 1e-8, 20]);
    phi(w) = exp(lambda + k log w - lambda w) = e^lambda w^k e^(-lambda w) (1 at w = 1), with (k, lambda) =
    (k_pos, lambda_pos) where A >= 0, else (k_neg, lambda_neg); a non-finite phi is 0."""
    with torch.no_grad():
        low = math.log(1e-8)
        log_w = torch.where(mask, log_ratio.clamp(-20.0, 20.0), torch.zeros_like(log_ratio)).sum(1, keepdim=True)
        log_w = log_w.clamp(low, 20.0)  # [N, 1]
        k = torch.where(adv >= 0, torch.full_like(adv, k_pos), torch.full_like(adv, k_neg))
        lam = torch.where(adv >= 0, torch.full_like(adv, lambda_pos), torch.full_like(adv, lambda_neg)).clamp(min=1e-4)
        phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
        return phi.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)  # [N, 1]


@register_policy_loss("vespo", needs=("old",), aggregation="token_mean")
def vespo_loss(token_logps: Tensor, completion_mask: Tensor, advantages: Tensor, *, k_pos: VespoShape = 2.0,
               lambda_pos: VespoRate = 3.0, k_neg: VespoShape = 3.0, lambda_neg: VespoRate = 2.0,
               off_policy_mask_threshold: MaskThreshold = None, **inputs) -> tuple[Tensor, dict[str, float]]:
    """VESPO (TRL `loss_type="vespo"`): a policy gradient weighted per sequence by the gamma function of its
    ratio (`gamma_weights`, no gradient through it): per token ``-phi_i A_i logp``, token mean over the batch."""
    mask, logps, old, adv = ratio_inputs(token_logps, completion_mask, advantages, inputs.get("old_logps"))
    phi = gamma_weights(adv, logps - old, mask, k_pos=k_pos, lambda_pos=lambda_pos, k_neg=k_neg,
                        lambda_neg=lambda_neg)  # [N, 1]
    keep = off_policy_mask(adv, logps, old, mask, off_policy_mask_threshold)  # [N, 1]
    per_token = torch.where(mask, weigh(-phi * adv * logps * keep, inputs.get("weights")), torch.zeros_like(logps))
    loss = _aggregate(per_token, mask, inputs.get("aggregation", "token_mean"), inputs.get("normalizer"), None)
    with torch.no_grad():
        metrics = _ratio_metrics(loss, token_logps, mask, adv, torch.exp(sequence_mean(logps - old, mask)),
                                 None if off_policy_mask_threshold is None else keep, logps - old)
        metrics["phi_mean"] = float(phi.mean()) if phi.numel() else 0.0
    return loss, metrics


@register_policy_loss("gmpo", needs=("old",), aggregation="seq_mean_token_mean")
def gmpo_loss(token_logps: Tensor, completion_mask: Tensor, advantages: Tensor, *, clip_low: ClipLow = 0.4,
              clip_high: ClipHigh = 0.4, off_policy_mask_threshold: MaskThreshold = None,
              **inputs) -> tuple[Tensor, dict[str, float]]:
    """GMPO (verl `loss_mode=geo_mean`): the geometric mean of the token ratios, clipped per token in log space.

    With d_t = logp_t - old_t and s = sign(A_i): ``d'_t = s * min(s * d_t, s * clamp(d_t, -clip_low, clip_high))``;
    loss_i = ``-A_i * exp(mean_t d'_t)``; mean over sequences (an empty sequence counts and adds 0). GMPO's clip is
    (-0.4, 0.4) in log space: ratios within [e^-0.4, e^0.4]."""
    mask, logps, old, adv = ratio_inputs(token_logps, completion_mask, advantages, inputs.get("old_logps"))
    high = clip_low if clip_high is None else clip_high
    delta = logps - old  # [N, L]
    sign = torch.sign(adv)  # [N, 1]
    clipped = sign * torch.minimum(sign * delta, sign * delta.clamp(-clip_low, high))  # [N, L]
    ratio = torch.exp(sequence_mean(clipped, mask))  # [N, 1]
    keep = off_policy_mask(adv, logps, old, mask, off_policy_mask_threshold)  # [N, 1]
    per_token = torch.where(mask, weigh((-adv * ratio * keep).expand_as(logps), inputs.get("weights")),
                            torch.zeros_like(logps))  # [N, L]
    loss = _aggregate(per_token, mask, inputs.get("aggregation", "seq_mean_token_mean"), inputs.get("normalizer"),
                      None)
    with torch.no_grad():
        metrics = _ratio_metrics(loss, token_logps, mask, adv, ratio, None if off_policy_mask_threshold is None
                                 else keep, delta)
        outside = (delta != delta.clamp(-clip_low, high))
        metrics["clip_fraction_high"] = _masked_mean((outside & (adv > 0)).to(logps.dtype), mask)
        metrics["clip_fraction_low"] = _masked_mean((outside & (adv < 0)).to(logps.dtype), mask)
    return loss, metrics


@register_policy_loss("cispo", needs=("old",), aggregation="token_mean")
def cispo_loss(token_logps: Tensor, completion_mask: Tensor, advantages: Tensor, *, old_logps: Tensor | None = None,
               cap: CapOption = 5.0, **inputs) -> tuple[Tensor, dict[str, float]]:
    """CISPO (MiniMax-M1): per token -sg(min(rho_t, cap)) * A * log pi_t, rho_t = exp(logp - old), the token mean
    over the batch; the weight is detached, so every token keeps a gradient (no clipping takes it away). TRL 1.16's
    loss_type="cispo" caps at its `epsilon_high` itself: cap here is that number. token_logps, old_logps,
    completion_mask [N, L]; advantages [N]. Metrics: the gpg loss's, with ratio_mean / ratio_max, kl 0 and
    clip_fraction_high (tokens whose weight was capped)."""
    mask = completion_mask.bool()  # [N, L]
    zeros = torch.zeros_like(token_logps)
    logps = torch.where(mask, token_logps, zeros)  # [N, L]
    old = logps.detach() if old_logps is None else torch.where(mask, old_logps.to(logps.dtype), zeros).detach()
    ratio = torch.exp(logps.detach() - old)  # [N, L]
    weight = ratio.clamp(max=cap)  # [N, L] detached
    per_token = torch.where(mask, weigh(-weight * per_token_advantages(advantages.detach().to(logps.dtype)) * logps,
                                        inputs.get("weights")), zeros)  # [N, L]
    loss = _aggregate(per_token, mask, inputs.get("aggregation", "token_mean"), inputs.get("normalizer"), None)
    with torch.no_grad():
        metrics = _base_metrics(loss, token_logps, mask, advantages.detach())
        metrics.update({"kl": 0.0, "clip_fraction_low": 0.0,
                        "clip_fraction_high": _masked_mean((ratio > cap).to(logps.dtype), mask),
                        "ratio_mean": _masked_mean(ratio, mask),
                        "ratio_max": float(torch.where(mask, ratio, zeros).max()) if mask.any() else 1.0,
                        "logp_drift": _masked_mean(logps.detach() - old, mask)})
    return loss, metrics
