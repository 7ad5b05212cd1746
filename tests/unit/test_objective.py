"""Tests for gpg_vl.objective: hand-worked cases, loop references, edge cases, gradients, AGE."""

from __future__ import annotations

import math
import random
import statistics
import warnings

import pytest
import torch

from gpg_vl.objective import age_alpha, group_advantages, policy_loss

# the aggregations without a length constant (seq_mean_token_sum, Dr. GRPO's, is tested in test_losses.py)
AGGREGATIONS = ("seq_mean_token_mean", "token_mean")

F64 = torch.float64


# ----------------------------------------------------------------------------- slow references
def ref_group_advantages(rewards: list[list[float]], std_normalize: bool, eps: float = 1e-5):
    advs, valids = [], []
    for group in rewards:
        g = len(group)
        if not all(math.isfinite(r) for r in group):
            advs.append([0.0] * g)
            valids.append(False)
            continue
        mean = sum(group) / g
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / g)  # population std: the validity test
        valid = std > eps
        valids.append(valid)
        if not valid:
            advs.append([0.0] * g)
        elif std_normalize:
            sample_std = math.sqrt(sum((r - mean) ** 2 for r in group) / (g - 1))  # Bessel-corrected
            advs.append([(r - mean) / (sample_std + 1e-4) for r in group])
        else:
            advs.append([r - mean for r in group])
    return advs, valids


def ref_policy_loss(logps, mask, advs, aggregation: str, normalizer=None) -> float:
    n = len(logps)
    if aggregation == "seq_mean_token_mean":
        total = 0.0
        for i in range(n):
            terms = [-logps[i][t] * advs[i] for t in range(len(logps[i])) if mask[i][t]]
            total += sum(terms) / max(len(terms), 1)
        denom = n if normalizer is None else normalizer
    else:
        total, count = 0.0, 0
        for i in range(n):
            for t in range(len(logps[i])):
                if mask[i][t]:
                    total += -logps[i][t] * advs[i]
                    count += 1
        denom = count if normalizer is None else normalizer
    return total / max(denom, 1)


def random_batch(n: int, length: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    logps = -torch.rand(n, length, generator=gen, dtype=F64) * 3  # [N, L]
    mask = torch.rand(n, length, generator=gen) < 0.7  # [N, L]
    if n > 1:
        mask[0] = False  # always include an empty row
    advs = torch.randn(n, generator=gen, dtype=F64)  # [N]
    return logps, mask, advs


# ----------------------------------------------------------------------------- 1. by hand
def test_hand_worked_advantages():
    # group 0: mean 0.5 -> [0.5, -0.5, -0.5, 0.5], population std 0.5 > eps -> valid
    # group 1: all equal -> std 0 -> invalid, zeros
    adv, valid = group_advantages(torch.tensor([[1.0, 0, 0, 1], [1, 1, 1, 1]], dtype=F64))
    assert adv.tolist() == [[0.5, -0.5, -0.5, 0.5], [0, 0, 0, 0]]
    assert valid.tolist() == [True, False]
    # GRPO variant, the sample std: squared deviations 4 * 0.25 = 1, / (G - 1) = 3 -> std sqrt(1/3)
    adv, valid = group_advantages(torch.tensor([[1.0, 0, 0, 1], [1, 1, 1, 1]], dtype=F64), std_normalize=True)
    a = 0.5 / (math.sqrt(1 / 3) + 1e-4)  # 0.86588...
    assert torch.allclose(adv, torch.tensor([[a, -a, -a, a], [0, 0, 0, 0]], dtype=F64), rtol=0, atol=1e-12)
    assert a == pytest.approx(0.8658754, abs=1e-7)
    assert valid.tolist() == [True, False]  # the validity test is the same with and without the scaling


def trl_group_scaled(rewards: list[list[float]]) -> list[list[float]]:
    """TRL's `scale_rewards="group"` advantages, written out: per group, (r - mean) / (stdev + 1e-4), where
    stdev is `statistics.stdev` (the sample std, torch's default `Tensor.std()`, which TRL calls)."""
    return [[(r - statistics.fmean(g)) / (statistics.stdev(g) + 1e-4) for r in g] for g in rewards]


@pytest.mark.parametrize("group_size", [2, 3, 4, 8, 16])
def test_std_normalized_equals_trl_group_scaling(group_size: int):
    gen = torch.Generator().manual_seed(group_size)
    rewards = torch.randint(0, 5, (6, group_size), generator=gen).to(F64) / 2  # accuracy + format style sums
    rewards[0] = torch.tensor([1.0, 0.0] * (group_size // 2) + [1.0] * (group_size % 2))  # differ
    rewards[1] = 2.0  # all equal
    rows = rewards.tolist()
    adv, valid = group_advantages(rewards, std_normalize=True)
    expected = trl_group_scaled(rows)
    for b, group in enumerate(rows):
        if len(set(group)) > 1:
            assert valid[b]
            assert adv[b].tolist() == pytest.approx(expected[b], abs=1e-12)
        else:  # TRL gives 0 / 1e-4 = 0 here too; the group is invalid and carries no gradient
            assert not valid[b] and adv[b].tolist() == [0.0] * group_size
    # G = 2 by hand: rewards (1, 0): mean 0.5, sample std sqrt(0.5) (population std 0.5)
    adv, _ = group_advantages(torch.tensor([[1.0, 0.0]], dtype=F64), std_normalize=True)
    assert adv[0, 0].item() == pytest.approx(0.5 / (math.sqrt(0.5) + 1e-4), abs=1e-12)


def test_std_normalized_single_completion_groups_are_invalid_without_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns on a sample std with G - 1 = 0 degrees of freedom
        adv, valid = group_advantages(torch.tensor([[3.0], [-1.0]], dtype=F64), std_normalize=True)
    assert adv.tolist() == [[0.0], [0.0]] and valid.tolist() == [False, False]


def _hand_batch():
    # seq 0: 3 tokens, logps [-1, -2, -3], A = 0.5  -> -logp*A = [0.5, 1.0, 1.5], mean 1.0, sum 3
    # seq 1: 2 tokens, logps [-0.5, -1.5] (+ padding 99), A = -0.5 -> [-0.25, -0.75], mean -0.5
    logps = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -1.5, 99.0]], dtype=F64, requires_grad=True)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    advs = torch.tensor([0.5, -0.5], dtype=F64)
    return logps, mask, advs


def test_hand_worked_loss_seq_mean_token_mean():
    logps, mask, advs = _hand_batch()
    loss, m = policy_loss(logps, mask, advs)
    # (1.0 + -0.5) / 2 = 0.25
    assert loss.item() == pytest.approx(0.25, abs=1e-12)
    loss.backward()
    # grad = -A / (|o| * N): seq 0: -0.5/(3*2) = -1/12 ; seq 1: 0.5/(2*2) = 0.125 ; padding 0
    expected = [[-1 / 12] * 3, [0.125, 0.125, 0.0]]
    assert torch.allclose(logps.grad, torch.tensor(expected, dtype=F64), atol=1e-12)
    # metrics: 5 tokens, logp mean (-1-2-3-0.5-1.5)/5 = -1.6, A mean 0, |A| mean 0.5
    assert m == pytest.approx(
        {
            "loss": 0.25,
            "advantage_mean": 0.0,
            "advantage_abs_mean": 0.5,
            "num_sequences": 2.0,
            "num_tokens": 5.0,
            "logp_mean": -1.6,
        }
    )
    assert all(type(v) is float for v in m.values())


def test_hand_worked_loss_token_mean():
    logps, mask, advs = _hand_batch()
    loss, _ = policy_loss(logps, mask, advs, aggregation="token_mean")
    # (0.5 + 1.0 + 1.5 - 0.25 - 0.75) / 5 = 2.0 / 5 = 0.4
    assert loss.item() == pytest.approx(0.4, abs=1e-12)
    loss.backward()
    # grad = -A / T: seq 0: -0.5/5 = -0.1 ; seq 1: 0.5/5 = 0.1 ; padding 0
    expected = [[-0.1] * 3, [0.1, 0.1, 0.0]]
    assert torch.allclose(logps.grad, torch.tensor(expected, dtype=F64), atol=1e-12)


# ----------------------------------------------------------------------------- 2. loop reference
@pytest.mark.parametrize("std_normalize", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_group_advantages_matches_loop(seed: int, std_normalize: bool):
    rng = random.Random(seed)
    for b, g in [(1, 1), (1, 4), (3, 2), (5, 8), (rng.randint(1, 9), rng.randint(1, 9))]:
        rows = []
        for _ in range(b):
            kind = rng.random()
            if kind < 0.3:  # small integers -> frequent ties / all-equal groups
                rows.append([float(rng.randint(0, 1)) for _ in range(g)])
            elif kind < 0.4:
                rows.append([rng.choice([1.0, float("nan"), float("inf")]) for _ in range(g)])
            else:
                rows.append([rng.gauss(0, 2) for _ in range(g)])
        adv, valid = group_advantages(torch.tensor(rows, dtype=F64), std_normalize=std_normalize)
        ref_adv, ref_valid = ref_group_advantages(rows, std_normalize)
        assert adv.shape == (b, g) and valid.shape == (b,) and valid.dtype == torch.bool
        assert valid.tolist() == ref_valid
        assert torch.isfinite(adv).all()
        assert torch.allclose(adv, torch.tensor(ref_adv, dtype=F64), rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("aggregation", sorted(AGGREGATIONS))
@pytest.mark.parametrize("seed", range(8))
def test_policy_loss_matches_loop(seed: int, aggregation: str):
    rng = random.Random(seed)
    for n, length in [(1, 1), (2, 5), (7, 3), (rng.randint(1, 12), rng.randint(1, 16))]:
        logps, mask, advs = random_batch(n, length, seed)
        loss, m = policy_loss(logps, mask, advs, aggregation=aggregation)
        ref = ref_policy_loss(logps.tolist(), mask.tolist(), advs.tolist(), aggregation)
        assert loss.item() == pytest.approx(ref, rel=1e-10, abs=1e-12)
        assert m["num_tokens"] == float(mask.sum())
        assert m["num_sequences"] == float(n)


# ----------------------------------------------------------------------------- 3. edge cases
def test_single_completion_group_is_invalid_without_nan():
    for std_normalize in (False, True):
        adv, valid = group_advantages(torch.tensor([[3.0], [-1.0]]), std_normalize=std_normalize)
        assert valid.tolist() == [False, False]
        assert adv.tolist() == [[0.0], [0.0]]


def test_non_finite_rewards_invalidate_only_their_group():
    rewards = torch.tensor([[1.0, float("nan"), 0.0], [1.0, 0.0, 2.0], [float("inf"), 1.0, 1.0]])
    for std_normalize in (False, True):
        adv, valid = group_advantages(rewards, std_normalize=std_normalize)
        assert valid.tolist() == [False, True, False]
        assert torch.isfinite(adv).all()
        assert adv[0].tolist() == [0.0, 0.0, 0.0] and adv[2].tolist() == [0.0, 0.0, 0.0]
    adv, _ = group_advantages(rewards)
    assert adv[1].tolist() == [0.0, -1.0, 1.0]  # mean 1 -> unaffected by the other groups


def test_fully_masked_row_contributes_zero_but_counts():
    logps = torch.tensor([[-1.0, -1.0], [-5.0, -5.0]], dtype=F64, requires_grad=True)
    mask = torch.tensor([[True, True], [False, False]])
    loss, m = policy_loss(logps, mask, torch.tensor([1.0, 3.0], dtype=F64))
    # seq 0: mean(1, 1) = 1 ; seq 1: empty -> 0 ; N = 2 -> 0.5
    assert loss.item() == pytest.approx(0.5)
    loss.backward()
    assert logps.grad[1].tolist() == [0.0, 0.0]
    assert m["num_tokens"] == 2.0


def test_non_finite_padding_logps_do_not_leak():
    logps = torch.tensor([[-1.0, float("-inf")], [float("nan"), float("nan")]], requires_grad=True)
    mask = torch.tensor([[1, 0], [0, 0]])
    for aggregation in AGGREGATIONS:
        loss, m = policy_loss(logps, mask, torch.tensor([2.0, 0.0]), aggregation=aggregation)
        (grad,) = torch.autograd.grad(loss, logps)
        assert torch.isfinite(loss) and torch.isfinite(grad).all()
        assert m["logp_mean"] == -1.0


def test_all_groups_invalid():
    adv, valid = group_advantages(torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]))
    assert not valid.any() and adv.abs().sum() == 0
    assert age_alpha(2, int(valid.sum())) == 0.0
    for aggregation in AGGREGATIONS:
        # trainer feeds only valid sequences -> N = 0
        empty = torch.zeros(0, 4, requires_grad=True)
        loss, m = policy_loss(
            empty, torch.zeros(0, 4, dtype=torch.bool), torch.zeros(0), aggregation=aggregation
        )
        assert loss.item() == 0.0 and loss.grad_fn is not None
        loss.backward()
        assert empty.grad.shape == (0, 4)
        assert all(not math.isnan(v) for v in m.values()) and m["logp_mean"] == 0.0
        # feeding the (all zero-advantage) sequences anyway also gives 0
        logps = torch.randn(6, 4, requires_grad=True)
        loss, _ = policy_loss(logps, torch.ones(6, 4), adv.flatten(), aggregation=aggregation)
        assert loss.item() == 0.0


# ----------------------------------------------------------------------------- 4. gradients
@pytest.mark.parametrize("seed", range(4))
def test_gradient_formula(seed: int):
    logps, mask, advs = random_batch(9, 7, seed)
    n = logps.shape[0]
    lengths = mask.sum(dim=1).clamp(min=1).to(F64)  # [N]
    total = mask.sum().to(F64)
    expected = {
        "seq_mean_token_mean": (-advs / (lengths * n)).unsqueeze(1) * mask,  # [N, L]
        "token_mean": (-advs / total).unsqueeze(1) * mask,  # [N, L]
    }
    for aggregation, exp in expected.items():
        x = logps.clone().requires_grad_(True)
        loss, _ = policy_loss(x, mask, advs, aggregation=aggregation)
        (grad,) = torch.autograd.grad(loss, x)
        assert torch.allclose(grad, exp, rtol=1e-12, atol=1e-15)
        assert (grad[~mask] == 0).all()


# ----------------------------------------------------------------------------- 5. micro-batches
@pytest.mark.parametrize("aggregation", sorted(AGGREGATIONS))
@pytest.mark.parametrize("seed", range(4))
def test_micro_batches_with_global_normalizer(seed: int, aggregation: str):
    logps, mask, advs = random_batch(11, 6, seed)
    full_x = logps.clone().requires_grad_(True)
    full, _ = policy_loss(full_x, mask, advs, aggregation=aggregation)
    full.backward()

    norm = logps.shape[0] if aggregation == "seq_mean_token_mean" else int(mask.sum())
    x = logps.clone().requires_grad_(True)
    total = torch.zeros((), dtype=F64)
    for chunk in torch.arange(11).split([1, 4, 2, 4]):
        part, _ = policy_loss(x[chunk], mask[chunk], advs[chunk], aggregation=aggregation, normalizer=norm)
        part.backward()  # gradients accumulate as in the trainer
        total = total + part.detach()
    assert total.item() == pytest.approx(full.item(), rel=1e-12, abs=1e-14)
    assert torch.allclose(x.grad, full_x.grad, rtol=1e-12, atol=1e-15)

    # without the global normalizer the sum is (in general) not the full loss
    local = sum(
        policy_loss(logps[c], mask[c], advs[c], aggregation=aggregation)[0]
        for c in torch.arange(11).split([1, 4, 2, 4])
    )
    assert local.item() != pytest.approx(full.item())


# ----------------------------------------------------------------------------- 6. AGE
def test_age_alpha_values():
    assert age_alpha(8, 8 - 6) == 4.0  # B=8, M=6 invalid
    assert age_alpha(8, 8) == 1.0
    assert age_alpha(8, 0) == 0.0
    with pytest.raises(ValueError):
        age_alpha(4, 5)


@pytest.mark.parametrize("std_normalize", [False, True])
def test_valid_only_mean_equals_alpha_times_full_mean(std_normalize: bool):
    gen = torch.Generator().manual_seed(0)
    b, g, length = 8, 4, 5
    rewards = torch.randn(b, g, generator=gen, dtype=F64)  # [B, G]
    rewards[2:] = rewards[2:, :1]  # 6 all-equal (invalid) groups
    adv, valid = group_advantages(rewards, std_normalize=std_normalize)
    assert int(valid.sum()) == 2
    alpha = age_alpha(b, int(valid.sum()))
    assert alpha == 4.0

    logps = -torch.rand(b * g, length, generator=gen, dtype=F64)  # [B*G, L]
    mask = torch.rand(b * g, length, generator=gen) < 0.8  # [B*G, L]
    seq_valid = valid.repeat_interleave(g)  # [B*G]
    all_loss, _ = policy_loss(logps, mask, adv.flatten())
    valid_loss, _ = policy_loss(logps[seq_valid], mask[seq_valid], adv.flatten()[seq_valid])
    assert all_loss.item() != 0.0
    assert valid_loss.item() == pytest.approx(alpha * all_loss.item(), rel=1e-12)


# ----------------------------------------------------------------------------- 7. unknown name
def test_unknown_aggregation_lists_valid_names():
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="seq_mean_token_mean") as info:
        policy_loss(x, torch.ones(1, 2), torch.zeros(1), aggregation="sum")
    assert "token_mean" in str(info.value) and "'sum'" in str(info.value)
