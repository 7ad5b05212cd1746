"""The on-policy check of an engine with its own weights (vLLM): how far its sampling distribution is from the
trainer's, and the optional truncated importance weight that corrects for it.

GPG's gradient is the policy gradient only when the completions were sampled from the trained policy. An
engine like vLLM samples with its own kernels (bf16 rounding differs), so each sampled token's log-prob
under the sampler, log q, differs slightly from the trainer's, log p:

- `logp_mismatch`: sum, max and count of |log q - log p| over the completion tokens (the trainer logs the
  mean and the max each step);
- `truncated_is_weights`: w = min(exp(log p - log q), cap), per token, without gradient; the loss of each
  token is multiplied by w (rollout.vllm.tis_cap > 0). AGE's normalizer is untouched: no token or sequence
  is masked out, every weight is positive.
"""

from __future__ import annotations

import torch
from torch import Tensor


def logp_mismatch(trainer_logps: Tensor, sampler_logps: Tensor, mask: Tensor) -> tuple[float, float, int]:
    """(sum, max, count) of |sampler - trainer| log-probs over the tokens where `mask` is True.
    trainer_logps, sampler_logps [N, C] (any float dtype), mask [N, C] bool."""
    mask = mask.bool()
    gap = (sampler_logps.double() - trainer_logps.detach().double()).abs()[mask]  # [T]
    if gap.numel() == 0:
        return 0.0, 0.0, 0
    return float(gap.sum()), float(gap.max()), int(gap.numel())


def truncated_is_weights(trainer_logps: Tensor, sampler_logps: Tensor, mask: Tensor, cap: float) -> Tensor:
    """[N, C] weights min(p / q, cap) = min(exp(log p - log q), cap) on masked-in tokens, 1 elsewhere;
    no gradient flows through them."""
    ratio = torch.exp(trainer_logps.detach().float() - sampler_logps.float()).clamp(max=cap)  # [N, C]
    return torch.where(mask.bool(), ratio, torch.ones_like(ratio)).to(trainer_logps.dtype)
