"""Drawing the next token from last-position logits, exactly as transformers' `generate` processes them: shared
by the HF engine's single-turn decode loop (rollout/hf.py) and its multi-turn decoding (rollout/multiturn/decoding.py).

Draws come from torch's global generator, unless the calling thread set its own (rollout/engine.py's
`thread_generator`)."""

from __future__ import annotations

import torch
from torch import Tensor

from gpg_vl.rollout.engine import Sampling, sampling_generator


def process_logits(logits: Tensor, sampling: Sampling, suppressed: Tensor | None) -> Tensor:
    """The scores tokens are drawn from, as `generate` computes them: suppressed ids at -inf, then (when
    sampling) divided by the temperature and cut to the top-p nucleus. logits [N, V] float -> [N, V]."""
    if suppressed is not None:
        logits = logits.index_fill(-1, suppressed, float("-inf"))
    if sampling.greedy:
        return logits
    if sampling.temperature != 1.0:
        logits = logits / sampling.temperature
    if sampling.top_p < 1.0:
        ordered, order = torch.sort(logits, descending=False)  # [N, V] ascending
        cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)  # [N, V]
        drop = cumulative <= (1 - sampling.top_p)
        drop[..., -1:] = False  # the most likely token always stays
        logits = logits.masked_fill(drop.scatter(1, order, drop), float("-inf"))
    return logits


def next_tokens(logits: Tensor, sampling: Sampling, suppressed: Tensor | None) -> Tensor:
    """Token ids [N] from last-position logits [N, V]: argmax when greedy, else one multinomial draw each."""
    scores = process_logits(logits, sampling, suppressed)
    if sampling.greedy:
        return scores.argmax(dim=-1)
    return torch.multinomial(scores.softmax(dim=-1), num_samples=1, generator=sampling_generator()).squeeze(1)
