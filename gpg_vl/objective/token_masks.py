"""The token masks of the update's loss (docs/distillation.md, "Entropy"): which counted tokens give gradient.

`high_entropy_mask` keeps the top-rho entropy tokens (TRL's ``top_entropy_quantile``, the "80/20" result: the entropy
of each scored position is models/logits.py's); `covariance_cut` picks the tokens verl's Clip-Cov takes the gradient
from (against entropy collapse, Cui et al. 2025).
"""

from __future__ import annotations

import torch
from torch import Tensor


def high_entropy_mask(entropies: Tensor, mask: Tensor, top_quantile: float, pool: Tensor | None = None) -> Tensor:
    """[N, C] bool: the counted tokens whose entropy is at least the (1 - `top_quantile`) quantile of the counted
    tokens' entropies (`pool`, when given: every process's counted entropies of this micro-batch, as TRL gathers
    them). entropies, mask [N, C]. TRL's `GRPOTrainer.get_high_entropy_mask(entropies, mask, 1 - top_quantile)`;
    top_quantile 1 keeps every counted token."""
    mask = mask.bool()
    values = entropies[mask].float() if pool is None else pool.float()
    if values.numel() == 0:
        return torch.zeros_like(mask)
    threshold = torch.quantile(values, 1.0 - top_quantile)
    return ((entropies * mask.float()) >= threshold) & mask


def covariance_cut(logps: Tensor, advantages: Tensor, mask: Tensor, *, ratio: float, low: float, high: float,
                   generator: torch.Generator | None = None) -> Tensor:
    """[N, C] bool: the tokens verl's Clip-Cov detaches. Each counted token's covariance term
    ``(A_t - mean A) * (log π_t - mean log π)`` (means over the counted tokens); of the tokens whose term lies strictly
    between `low` and `high`, ``max(1, int(ratio * counted))`` drawn uniformly at random without replacement (all of
    them where fewer are eligible). logps [N, C] (no gradient flows: the choice only), advantages [N] or [N, C], mask
    [N, C]. The draw is one ``torch.randperm`` over the eligible tokens in row-major order (`generator`, else the
    global one). On-policy (the ratio is 1) nothing is clipped by a surrogate, so this is verl's whole selection."""
    mask = mask.bool()
    logps = logps.detach().double()  # [N, C]
    advantages = advantages.detach().double()
    advantages = advantages.unsqueeze(1).expand_as(logps) if advantages.dim() == 1 else advantages  # [N, C]
    count = int(mask.sum())
    cut = torch.zeros_like(mask)
    if count == 0:
        return cut
    centred_a = advantages - advantages[mask].mean()  # [N, C]
    centred_l = logps - logps[mask].mean()  # [N, C]
    covariance = centred_a * centred_l  # [N, C]
    eligible = mask & (covariance > low) & (covariance < high)
    candidates = eligible.flatten().nonzero().squeeze(1)  # [E], row-major
    take = max(1, int(ratio * count))
    order = torch.randperm(len(candidates), generator=generator, device=candidates.device)[:take]
    cut.view(-1)[candidates[order]] = True
    return cut
