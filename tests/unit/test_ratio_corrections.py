"""A correction weights each token's loss and never changes a ratio (docs/async.md): for every ratio loss and every
built-in correction, the ratio metrics are those of the unweighted loss, the loss is affine in the weights (each
token's term times its weight, the KL term untouched), and so is its gradient; hand-worked cases for the clipped
surrogate and CISPO."""

from __future__ import annotations

import math

import pytest
import torch

from gpg_vl.objective import get_policy_loss, loss_needs
from gpg_vl.objective.corrections import apply_correction
from gpg_vl.objective.options import takes_weights

RATIO_LOSSES = ("grpo", "dr_grpo", "dapo", "bnpo", "gspo", "luspo", "sapo", "vespo", "gmpo", "cispo")
CORRECTIONS = {"none": {}, "token_tis": {"cap": 1.5}, "sequence_tis": {"cap": 2.0}, "geo_reject": {"delta": 0.3},
               "topr": {}}
MASK = torch.tensor([[True, True, True], [True, True, False], [True, True, True]])
ADVANTAGES = torch.tensor([1.0, -0.5, -1.0])


def _inputs():
    generator = torch.Generator().manual_seed(0)
    logps = -torch.rand(3, 3, generator=generator, dtype=torch.float64) - 0.1  # pi_theta, with gradient
    old = logps + 0.3 * (torch.rand(3, 3, generator=generator, dtype=torch.float64) - 0.5)  # pi_prox: ratios != 1
    ref = logps - 0.2 * torch.rand(3, 3, generator=generator, dtype=torch.float64)
    behaviour = old + torch.tensor([[0.4, -0.3, 0.2], [-0.6, 0.1, 0.0], [0.05, 0.02, -0.03]], dtype=torch.float64)
    return logps, old, ref, behaviour


def _call(name: str, logps, old, ref, weights):
    logps = logps.clone().requires_grad_(True)
    options = {"kl_coef": 0.1} if name == "grpo" else {"max_tokens": 4} if name == "dr_grpo" else {}
    loss, metrics = get_policy_loss(name)(logps, MASK, ADVANTAGES, old_logps=old, ref_logps=ref, weights=weights,
                                          **options)
    (gradient,) = torch.autograd.grad(loss, logps)
    return float(loss), gradient, metrics


def test_every_built_in_ratio_loss_takes_weights():
    assert all("old" in loss_needs(get_policy_loss(name)) and takes_weights(get_policy_loss(name))
               for name in RATIO_LOSSES)
    assert takes_weights(get_policy_loss("gpg"))


@pytest.mark.parametrize("correction", sorted(CORRECTIONS))
@pytest.mark.parametrize("name", RATIO_LOSSES)
def test_a_correction_weighs_each_tokens_term_and_leaves_the_ratio(name, correction):
    logps, old, ref, behaviour = _inputs()
    weights, rejected, _ = apply_correction(correction, CORRECTIONS[correction], old, behaviour, MASK, ADVANTAGES)
    weights = weights.double()
    assert not weights.requires_grad
    plain_loss, plain_gradient, plain = _call(name, logps, old, ref, None)
    loss, gradient, metrics = _call(name, logps, old, ref, weights)
    # the ratio is pi_theta / pi_prox whatever the correction
    for key in ("ratio_mean", "ratio_max", "logp_drift", "kl"):
        assert metrics[key] == pytest.approx(plain[key], rel=1e-12), key
    # affine in the weights: L(w) = L(0) + sum_t w_t (L(e_t) - L(0)) over the counted tokens (the KL term, outside
    # the weights, is L(0)); the gradient likewise
    zero_loss, zero_gradient, _ = _call(name, logps, old, ref, torch.zeros_like(weights))
    expected_loss, expected_gradient = zero_loss, zero_gradient.clone()
    for n, t in MASK.nonzero().tolist():
        one = torch.zeros_like(weights)
        one[n, t] = 1.0
        token_loss, token_gradient, _ = _call(name, logps, old, ref, one)
        expected_loss += float(weights[n, t]) * (token_loss - zero_loss)
        expected_gradient += weights[n, t] * (token_gradient - zero_gradient)
    assert loss == pytest.approx(expected_loss, rel=1e-9, abs=1e-12)
    assert torch.allclose(gradient, expected_gradient, rtol=1e-9, atol=1e-12)
    # all-ones weights are the unweighted loss; a rejected sequence adds nothing but its KL
    ones_loss, ones_gradient, _ = _call(name, logps, old, ref, torch.ones_like(weights))
    assert ones_loss == pytest.approx(plain_loss, rel=1e-12) and torch.allclose(ones_gradient, plain_gradient)
    if rejected.any() and name != "grpo":  # grpo's KL term acts on every sequence
        assert torch.all(gradient[rejected] == 0)


def test_the_clipped_surrogate_weighted_by_hand():
    """One sequence of two tokens, A = 1, pi_prox = pi_theta (ratios 1), behaviour ratios pi_prox / pi_b = 2 and
    4, token_tis cap 3: w = (2, 3). Per token -w_t * min(r A, clip(r) A) = -2, -3; the per-sequence token mean is
    -2.5, and d loss / d log pi_t = -w_t * r_t * A / 2 = -1, -1.5. Without the correction: -1 and -0.5 each."""
    logps = torch.tensor([[math.log(0.5), math.log(0.25)]], dtype=torch.float64)
    behaviour = logps - torch.tensor([[math.log(2.0), math.log(4.0)]], dtype=torch.float64)
    mask, advantages = torch.ones(1, 2, dtype=torch.bool), torch.ones(1)
    weights, _, _ = apply_correction("token_tis", {"cap": 3.0}, logps, behaviour, mask, advantages)
    assert weights.tolist() == [[2.0, 3.0]]
    for name in ("grpo", "dapo", "bnpo"):
        current = logps.clone().requires_grad_(True)
        loss, metrics = get_policy_loss(name)(current, mask, advantages, old_logps=logps, weights=weights.double())
        loss.backward()
        expected = -2.5 if name == "grpo" else -5.0 / 2  # token mean over the batch: (-2 - 3) / 2 as well
        assert float(loss) == pytest.approx(expected) and metrics["ratio_mean"] == 1.0 and metrics["ratio_max"] == 1.0
        assert current.grad[0].tolist() == pytest.approx([-1.0, -1.5])


def test_cispo_weighted_by_hand():
    """CISPO's own weight min(rho, cap) to pi_prox and the correction's multiply: pi_theta / pi_prox = 2 on token 0
    (cap 5: 2) and 1 on token 1; w = (0.5, 3): per token -2 * 0.5 * A log pi_0 and -1 * 3 * A log pi_1, A = 2, token
    mean: loss = -(1 * 2 * log 0.5 + 3 * 2 * log 0.25) / 2; the gradient -(2, 6) / 2 = (-1, -3)."""
    logps = torch.tensor([[math.log(0.5), math.log(0.25)]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[math.log(0.25), math.log(0.25)]], dtype=torch.float64)
    weights = torch.tensor([[0.5, 3.0]], dtype=torch.float64)
    loss, metrics = get_policy_loss("cispo")(logps, torch.ones(1, 2, dtype=torch.bool), torch.tensor([2.0]),
                                             old_logps=old, weights=weights)
    loss.backward()
    assert float(loss) == pytest.approx(-(1 * 2 * math.log(0.5) + 3 * 2 * math.log(0.25)) / 2)
    assert logps.grad[0].tolist() == pytest.approx([-1.0, -3.0]) and metrics["ratio_max"] == pytest.approx(2.0)
