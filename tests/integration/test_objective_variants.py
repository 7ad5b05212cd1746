"""The ablation variants of gpg_vl.objective: advantage estimators, AGE on/off normalizers, alpha.

Hand-worked cases, loop references over random shapes and seeds, and edge cases.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from gpg_vl.errors import UserError
from gpg_vl.objective import (
    ADVANTAGE_ESTIMATORS,
    LOSS_NORMALIZERS,
    age_alpha,
    age_normalizer,
    all_sampled_normalizer,
    estimator_name,
    group_advantages,
    loss_alpha,
    policy_loss,
    raw_reward_advantages,
)

F64 = torch.float64


# ----------------------------------------------------------------------------- slow references
def ref_raw_advantages(rewards: list[list[float]], eps: float = 1e-5):
    advs, valids = [], []
    for group in rewards:
        valid = all(math.isfinite(r) for r in group) and any(abs(r) > eps for r in group)
        valids.append(valid)
        advs.append(list(group) if valid else [0.0] * len(group))
    return advs, valids


def ref_loss_over_all_sampled(logps, mask, advs) -> float:
    """Plain GPG (alpha = 1): per-sequence token mean, then the mean over EVERY sampled sequence."""
    total = 0.0
    for row, keep, adv in zip(logps, mask, advs, strict=True):
        terms = [-lp * adv for lp, m in zip(row, keep, strict=True) if m]
        total += sum(terms) / max(len(terms), 1)
    return total / len(logps)


def random_rewards(rng: random.Random, b: int, g: int) -> list[list[float]]:
    rows = []
    for _ in range(b):
        kind = rng.random()
        if kind < 0.2:
            rows.append([0.0] * g)  # all zero: invalid for every estimator
        elif kind < 0.4:
            rows.append([float(rng.randint(1, 2))] * g)  # equal and nonzero: valid only without a baseline
        elif kind < 0.5:
            rows.append([rng.choice([1.0, float("nan"), float("-inf")]) for _ in range(g)])
        elif kind < 0.7:
            rows.append([float(rng.randint(0, 2)) for _ in range(g)])
        else:
            rows.append([rng.gauss(0, 2) for _ in range(g)])
    return rows


# ----------------------------------------------------------------------------- 1. by hand
def test_hand_worked_raw_reward_advantages():
    # group 0: differing rewards -> A = r ; group 1: equal but nonzero -> still A = r (every completion pushed up)
    # group 2: all zero -> no gradient, invalid ; group 3: equal negative -> A = r (pushed down), valid
    rewards = torch.tensor([[1.0, 0, 2, 1], [1, 1, 1, 1], [0, 0, 0, 0], [-0.5, -0.5, -0.5, -0.5]], dtype=F64)
    adv, valid = ADVANTAGE_ESTIMATORS["none"](rewards)
    assert adv.tolist() == [[1, 0, 2, 1], [1, 1, 1, 1], [0, 0, 0, 0], [-0.5, -0.5, -0.5, -0.5]]
    assert valid.tolist() == [True, True, False, True]
    # the group-mean estimators see no signal in groups 1-3
    adv, valid = ADVANTAGE_ESTIMATORS["group_mean"](rewards)
    assert adv.tolist() == [[0, -1, 1, 0], [0] * 4, [0] * 4, [0] * 4]
    assert valid.tolist() == [True, False, False, False]
    # std-normalized (GRPO): the sample std of (1, 0, 2, 1) is sqrt(2 / 3)
    adv, valid = ADVANTAGE_ESTIMATORS["std_normalized"](rewards)
    a = 1 / (math.sqrt(2 / 3) + 1e-4)
    assert torch.allclose(adv[0], torch.tensor([0, -a, a, 0], dtype=F64), rtol=0, atol=1e-12)
    assert valid.tolist() == [True, False, False, False]


def test_hand_worked_normalizers_and_alpha():
    # B = 8 groups of G = 4 sampled (32 sequences), 2 valid (8 sequences)
    assert age_normalizer(8, 32) == 8 and all_sampled_normalizer(8, 32) == 32
    assert LOSS_NORMALIZERS[True] is age_normalizer and LOSS_NORMALIZERS[False] is all_sampled_normalizer
    assert loss_alpha(True, 8, 2) == 4.0 == age_alpha(8, 2)
    assert loss_alpha(False, 8, 2) == 1.0
    assert loss_alpha(True, 8, 8) == loss_alpha(False, 8, 8) == 1.0
    # resampling: 3 attempts of B = 8 (24 groups sampled), 6 valid -> alpha 4 with AGE, 1 without
    assert loss_alpha(True, 24, 6) == 4.0 and loss_alpha(False, 24, 6) == 1.0
    for age in (True, False):
        assert loss_alpha(age, 8, 0) == 0.0  # nothing to update
        with pytest.raises(ValueError):
            loss_alpha(age, 4, 5)


def test_hand_worked_loss_without_age():
    # B = 2 groups of G = 2: group 0 rewards (1, 0) -> A = (0.5, -0.5); group 1 (1, 1) -> invalid, not forwarded.
    # seq 0: logps (-1, -3): token mean of -logp * A = 2 * 0.5 = 1.0 ; seq 1: logp (-4) + padding: 4 * -0.5 = -2.0.
    # Sum over the valid sequences = -1.0: AGE divides by the 2 valid sequences, no AGE by all 4 sampled.
    adv, valid = group_advantages(torch.tensor([[1.0, 0.0], [1.0, 1.0]], dtype=F64))
    logps = torch.tensor([[-1.0, -3.0], [-4.0, 0.0]], dtype=F64)  # the two valid sequences
    mask = torch.tensor([[1, 1], [1, 0]])
    valid_sequences, sampled_sequences = int(valid.sum()) * 2, 4
    with_age, _ = policy_loss(logps, mask, adv[0], normalizer=LOSS_NORMALIZERS[True](valid_sequences,
                                                                                      sampled_sequences))
    without, _ = policy_loss(logps, mask, adv[0], normalizer=LOSS_NORMALIZERS[False](valid_sequences,
                                                                                     sampled_sequences))
    assert with_age.item() == pytest.approx(-1.0 / 2)  # mean over the 2 valid sequences
    assert without.item() == pytest.approx(-1.0 / 4)  # mean over all 4 sampled, the invalid ones adding 0
    assert with_age.item() == pytest.approx(loss_alpha(True, 2, 1) * without.item())


def test_estimator_names_from_the_config_keys():
    assert estimator_name("group_mean", False) == "group_mean"
    assert estimator_name("group_mean", True) == "std_normalized"
    assert estimator_name("none", False) == "none"
    assert set(ADVANTAGE_ESTIMATORS) == {"group_mean", "std_normalized", "none"}
    with pytest.raises(UserError, match="trainer.baseline 'mean'; valid options: group_mean, none"):
        estimator_name("mean", False)
    with pytest.raises(UserError, match="set trainer.advantage=std_normalized"):
        estimator_name("none", True)


# ----------------------------------------------------------------------------- 2. loop references
@pytest.mark.parametrize("seed", range(8))
def test_raw_reward_advantages_match_loop(seed: int):
    rng = random.Random(seed)
    for b, g in [(1, 1), (2, 2), (6, 4), (rng.randint(1, 9), rng.randint(1, 9))]:
        rows = random_rewards(rng, b, g)
        adv, valid = raw_reward_advantages(torch.tensor(rows, dtype=F64))
        ref_adv, ref_valid = ref_raw_advantages(rows)
        assert adv.shape == (b, g) and valid.dtype == torch.bool
        assert valid.tolist() == ref_valid
        assert torch.isfinite(adv).all()
        assert torch.equal(adv, torch.tensor(ref_adv, dtype=F64))


@pytest.mark.parametrize("name", sorted(ADVANTAGE_ESTIMATORS))
@pytest.mark.parametrize("seed", range(6))
def test_valid_means_some_nonzero_advantage(seed: int, name: str):
    """What the trainer forwards, counts in alpha and resamples on is exactly what carries gradient."""
    rng = random.Random(seed)
    rows = random_rewards(rng, 12, rng.randint(1, 8))
    adv, valid = ADVANTAGE_ESTIMATORS[name](torch.tensor(rows, dtype=F64))
    assert valid.tolist() == (adv != 0).any(dim=1).tolist()


@pytest.mark.parametrize("name", sorted(ADVANTAGE_ESTIMATORS))
@pytest.mark.parametrize("seed", range(4))
def test_valid_only_sum_over_all_sampled_equals_the_plain_mean_over_everything(seed: int, name: str):
    """age=false without forwarding invalid groups = the mean over every sampled sequence (loop reference);
    age=true = alpha times it."""
    rng = random.Random(seed)
    b, g, length = 7, rng.randint(2, 6), 5
    rewards = torch.tensor(random_rewards(rng, b, g), dtype=F64)  # [B, G]
    adv, valid = ADVANTAGE_ESTIMATORS[name](rewards)
    gen = torch.Generator().manual_seed(seed)
    logps = -torch.rand(b * g, length, generator=gen, dtype=F64) * 3  # [B*G, L]
    mask = torch.rand(b * g, length, generator=gen) < 0.8  # [B*G, L]
    keep = valid.repeat_interleave(g)  # [B*G] sequences of valid groups
    counts = (int(keep.sum()), b * g)
    without, _ = policy_loss(logps[keep], mask[keep], adv.flatten()[keep], normalizer=LOSS_NORMALIZERS[False](*counts))
    reference = ref_loss_over_all_sampled(logps.tolist(), mask.tolist(), adv.flatten().tolist())
    assert without.item() == pytest.approx(reference, rel=1e-10, abs=1e-12)
    with_age, _ = policy_loss(logps[keep], mask[keep], adv.flatten()[keep], normalizer=LOSS_NORMALIZERS[True](*counts))
    alpha = loss_alpha(True, b, int(valid.sum()))
    assert with_age.item() == pytest.approx(alpha * reference, rel=1e-10, abs=1e-12)


# ----------------------------------------------------------------------------- 3. edge cases
def test_single_completion_groups():
    rewards = torch.tensor([[2.0], [0.0]])
    adv, valid = ADVANTAGE_ESTIMATORS["none"](rewards)
    assert valid.tolist() == [True, False] and adv.tolist() == [[2.0], [0.0]]  # G = 1 still has a gradient
    for name in ("group_mean", "std_normalized"):
        adv, valid = ADVANTAGE_ESTIMATORS[name](rewards)
        assert not valid.any() and adv.abs().sum() == 0  # r - mean(r) = 0


def test_raw_rewards_non_finite_tiny_and_integer():
    adv, valid = raw_reward_advantages(torch.tensor([[1.0, float("nan")], [float("inf"), 0.0], [1e-7, 0.0]]))
    assert valid.tolist() == [False, False, False]  # non-finite anywhere, or below eps: no signal
    assert adv.abs().sum() == 0 and torch.isfinite(adv).all()
    adv, valid = raw_reward_advantages(torch.tensor([[0, 1], [0, 0]]))  # integer rewards
    assert adv.dtype.is_floating_point and adv.tolist() == [[0.0, 1.0], [0.0, 0.0]] and valid.tolist() == [True, False]


def test_every_group_invalid_gives_zero_loss_with_either_normalizer():
    for name, estimator in ADVANTAGE_ESTIMATORS.items():
        adv, valid = estimator(torch.zeros(3, 4))
        assert not valid.any(), name
        for age in (True, False):
            assert loss_alpha(age, 3, 0) == 0.0
            empty = torch.zeros(0, 5, requires_grad=True)  # nothing forwarded
            loss, _ = policy_loss(empty, torch.zeros(0, 5, dtype=torch.bool), torch.zeros(0),
                                  normalizer=LOSS_NORMALIZERS[age](0, 12))
            assert loss.item() == 0.0
