"""How a per-token loss [N, L] becomes a scalar: the aggregations (over a local or global normalizer), and
the metrics every loss reports."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated

import torch
from torch import Tensor

from gpg_vl.config.keys import option

Aggregation = Callable[..., Tensor]  # (per_token [N, L], mask [N, L], normalizer, max_tokens) -> loss []
AGGREGATION_INPUTS = ("per_token", "mask", "normalizer")  # what the loss passes; the rest are options
# the completion length limit of seq_mean_token_sum (and of the losses that pass it on): the trainer fills it from
# rollout.max_new_tokens; a value below 1 would flip the loss's sign or divide by zero, and null would leave
# Dr. GRPO's denominator undefined
MaxTokens = Annotated[int, option("the completion length limit; unset: rollout.max_new_tokens", low=1)]


def _denominator(local_count: float, normalizer: float | None) -> float:
    """Local count unless a global ``normalizer`` is given; clamped at 1 so empty batches give 0."""
    return max(float(local_count if normalizer is None else normalizer), 1.0)


def _seq_mean_token_mean(per_token: Tensor, mask: Tensor, normalizer: float | None,
        max_tokens: MaxTokens = None) -> Tensor:
    """Token mean per sequence, then mean over sequences (empty rows count, contribute 0)."""
    lengths = mask.sum(dim=1).clamp(min=1).to(per_token.dtype)  # [N]
    per_seq = per_token.sum(dim=1) / lengths  # [N]
    return per_seq.sum() / _denominator(per_token.shape[0], normalizer)


def _token_mean(per_token: Tensor, mask: Tensor, normalizer: float | None,
        max_tokens: MaxTokens = None) -> Tensor:
    """Sum over all unmasked tokens divided by their total count."""
    return per_token.sum() / _denominator(int(mask.sum()), normalizer)


def _seq_mean_token_sum(per_token: Tensor, mask: Tensor, normalizer: float | None,
        max_tokens: MaxTokens = None) -> Tensor:
    """Dr. GRPO: each sequence's token SUM over a constant (`max_tokens`, the completion length limit), then
    mean over sequences; i.e. the batch's token sum over (sequences x max_tokens)."""
    if not max_tokens or max_tokens < 1:
        raise ValueError("aggregation seq_mean_token_sum needs max_tokens (the completion length limit)")
    return per_token.sum() / (float(max_tokens) * _denominator(per_token.shape[0], normalizer))


def _seq_token_sum(per_token: Tensor, mask: Tensor, normalizer: float | None,
        max_tokens: MaxTokens = None) -> Tensor:
    """LUSPO: each sequence's token SUM (a sequence weighs by its length), then mean over sequences."""
    return per_token.sum() / _denominator(per_token.shape[0], normalizer)


AGGREGATIONS: dict[str, Aggregation] = {
    "seq_mean_token_mean": _seq_mean_token_mean,
    "token_mean": _token_mean,
    "seq_mean_token_sum": _seq_mean_token_sum,
    "seq_token_sum": _seq_token_sum,
}
TOKEN_NORMALIZED = ("token_mean",)  # aggregations whose normalizer counts tokens; the others count sequences


def _aggregate(per_token: Tensor, mask: Tensor, aggregation: str, normalizer: float | None,
               max_tokens: int | None) -> Tensor:
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {aggregation!r}; valid options: {sorted(AGGREGATIONS)}")
    return AGGREGATIONS[aggregation](per_token, mask, normalizer, max_tokens)


def _masked_mean(values: Tensor, mask: Tensor) -> float:
    count = int(mask.sum())
    return float(torch.where(mask, values, torch.zeros_like(values)).sum() / count) if count else 0.0


def _base_metrics(loss: Tensor, token_logps: Tensor, mask: Tensor, adv: Tensor) -> dict[str, float]:
    n = adv.shape[0]
    return {"loss": float(loss.detach()),
            "advantage_mean": float(adv.mean()) if n else 0.0,
            "advantage_abs_mean": float(adv.abs().mean()) if n else 0.0,
            "num_sequences": float(n),
            "num_tokens": float(int(mask.sum())),
            "logp_mean": _masked_mean(token_logps.detach(), mask)}


def weigh(per_token: Tensor, weights: Tensor | None) -> Tensor:
    """A loss's per-token term [N, L] times the off-policy correction's weights [N, L] (no gradient through them);
    `weights` None: the term as it is. Every built-in loss weighs its term here and nowhere else (docs/async.md)."""
    return per_token if weights is None else per_token * weights.detach().to(per_token.dtype)
