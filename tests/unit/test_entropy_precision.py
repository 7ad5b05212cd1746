"""The update's entropy (models/logits.py) to the precision of its float32 logits, whatever their size.

A tiny model's logits reach 15-20 while its entropy is 0.08 nats: lse(z) - sum p z, each term of the logits' size,
erred by ~eps |z| (1e-6 nats, 1e-5 of the entropy), and a batch split another way moved `entropy_mean` by as much
(issue 59: 1 process against 2 on AMD EPYC). Summed from terms >= 0 the error is ~eps H."""

from __future__ import annotations

import pytest
import torch

from gpg_vl.models.logits import completion_logps


def peaked(tokens: int, vocab: int, top: float, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden [1, T, d], weight [V, d] whose logits are N(0, 1) but for one id per token at about `top`."""
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(1, tokens, 16, generator=generator)
    weight = torch.randn(vocab, 16, generator=generator) / 4
    weight[:tokens] = hidden[0] * top / hidden[0].pow(2).sum(-1, keepdim=True)  # token t's id t at about `top`
    return hidden, weight


def test_the_entropy_of_large_peaked_logits_errs_by_float32_rounding_of_the_entropy_not_of_the_logits():
    hidden, weight = peaked(tokens=48, vocab=512, top=18.0)
    ids, mask = torch.zeros(1, 48, dtype=torch.long), torch.ones(1, 48, dtype=torch.bool)
    _, entropy = completion_logps(hidden, weight, ids, mask, suppressed_ids=[], temperature=1.0, chunk_tokens=64,
                                  entropy=True)
    logits = (hidden[0] @ weight.T).float().double()  # the very float32 logits the scorer computes, in float64
    probs = torch.softmax(logits, dim=-1)
    expected = -(probs * torch.log_softmax(logits, dim=-1)).sum(-1)  # [T]
    assert 1e-3 < float(expected.mean()) < 0.5  # peaked: a small entropy beside logits of about 18
    error = (entropy[0].double() - expected).abs() / expected
    assert float(error.max()) < 1e-6, float(error.max())  # was 3e-4 (lse(z) - sum p z in float32)


def test_entropy_by_hand_with_tied_top_ids_and_a_suppressed_id():
    import math

    rows = [[0.0, 0.0, 5.0, -30.0], [math.log(0.25), math.log(0.25), math.log(0.5), 9.0]]  # id 3 suppressed
    weight = torch.tensor(rows).T  # [V=4, d=2]: token t's logits are row t
    hidden = torch.eye(2).unsqueeze(0)  # [1, 2, 2]
    ids, mask = torch.zeros(1, 2, dtype=torch.long), torch.ones(1, 2, dtype=torch.bool)
    _, entropy = completion_logps(hidden, weight, ids, mask, suppressed_ids=[3], temperature=1.0, chunk_tokens=1,
                                  entropy=True)
    two = torch.tensor([0.0, 0.0, 5.0]).log_softmax(0)  # two tied ids below the top one
    assert float(entropy[0, 0]) == pytest.approx(float(-(two.exp() * two).sum()), rel=1e-6)
    assert float(entropy[0, 1]) == pytest.approx(1.5 * math.log(2), rel=1e-6)
    hidden = torch.tensor([[[1.0, 0.0]]])
    weight = torch.tensor([[2.0, 0.0], [2.0, 0.0], [-1.0, 0.0]])  # the top id tied: ln 2 between them, and a third
    _, tied = completion_logps(hidden, weight, torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1, dtype=torch.bool),
                               suppressed_ids=[2], temperature=1.0, chunk_tokens=4, entropy=True)
    assert float(tied) == pytest.approx(math.log(2), rel=1e-6)
