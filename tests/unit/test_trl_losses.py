"""The 2026 losses equal TRL 1.16's own `GRPOTrainer._compute_loss` on identical inputs (loss value and the
gradient with respect to the log-probs), called on a stand-in trainer as tests/integration/test_grpo_kl.py does;
GMPO equals verl's documented `geo_mean` formula on hand-worked cases. Every batch holds an invalid group (zero
advantages), an empty completion and ratios far enough from 1 that the clip (or gate) fires."""

from __future__ import annotations

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from gpg_vl.objective import get_policy_loss, loss_aggregation

# gpg-vl loss -> (TRL loss_type, importance_sampling_level, the loss options given to both)
CASES = {
    "grpo": ("grpo", "token", {"clip_low": 0.2, "clip_high": 0.2}),
    "dapo": ("dapo", "token", {"clip_low": 0.2, "clip_high": 0.28}),
    "bnpo": ("bnpo", "token", {"clip_low": 0.2, "clip_high": 0.2}),
    "gspo": ("grpo", "sequence", {"clip_low": 0.05, "clip_high": 0.08}),
    "luspo": ("luspo", "sequence", {"clip_low": 0.05, "clip_high": 0.08}),
    "sapo": ("sapo", "token", {"temperature_pos": 1.0, "temperature_neg": 1.05}),
    "dr_grpo": ("dr_grpo", "token", {"clip_low": 0.2, "clip_high": 0.2}),
    "vespo": ("vespo", "token", {"k_pos": 2.0, "lambda_pos": 3.0, "k_neg": 3.0, "lambda_neg": 2.0}),
}


def batch(seed: int = 0):
    """8 sequences (4 groups of 2) of up to 6 tokens: group 1 invalid (zero advantages), row 3 an empty completion,
    old log-probs up to ~0.5 away so that many ratios leave [0.8, 1.28]."""
    generator = torch.Generator().manual_seed(seed)
    n, width = 8, 6
    logps = -torch.rand(n, width, generator=generator, dtype=torch.float64) * 3 - 0.05  # [8, 6]
    old = logps + (torch.rand(n, width, generator=generator, dtype=torch.float64) - 0.5)  # [8, 6]
    lengths = torch.tensor([6, 4, 5, 0, 6, 2, 3, 6])
    mask = (torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)).to(torch.float64)  # [8, 6]
    advantages = torch.tensor([0.9, -0.9, 0.0, 0.0, 1.3, -0.4, -0.7, -0.2], dtype=torch.float64)  # group 1 invalid
    return logps, old, mask, advantages


def trl_loss(logps, old, mask, advantages, loss_type, level, options, *, threshold=None, max_tokens=6):
    """TRL's `GRPOTrainer._compute_loss` (num_iterations as given by `old`, one accumulation step, one process)
    on a stand-in trainer whose per-token log-prob function returns `logps` [N, C] (with gradient)."""
    from accelerate import Accelerator
    from trl.trainer.grpo_trainer import GRPOTrainer

    n, width = logps.shape
    args = SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=1,
                           sapo_temperature_pos=options.get("temperature_pos", 1.0),
                           sapo_temperature_neg=options.get("temperature_neg", 1.05),
                           vespo_k_pos=options.get("k_pos", 2.0), vespo_lambda_pos=options.get("lambda_pos", 3.0),
                           vespo_k_neg=options.get("k_neg", 3.0), vespo_lambda_neg=options.get("lambda_neg", 2.0))
    stand_in = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logps, torch.zeros_like(logps), None),
        top_entropy_quantile=1.0, off_policy_mask_threshold=threshold, importance_sampling_level=level, beta=0.0,
        args=args, loss_type=loss_type, epsilon_low=options.get("clip_low", 0.2),
        epsilon_high=options.get("clip_high", 0.2), use_vllm=False, model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1, _entropy_bonus_enabled=False, aux_loss_enabled=False,
        max_completion_length=max_tokens, accelerator=Accelerator(cpu=True), _metrics={"train": defaultdict(list)},
        get_off_policy_mask=GRPOTrainer.get_off_policy_mask, get_gamma_weights=GRPOTrainer.get_gamma_weights)
    inputs = {"prompt_ids": torch.zeros(n, 1, dtype=torch.long), "prompt_mask": torch.ones(n, 1, dtype=torch.long),
              "completion_ids": torch.zeros(n, width, dtype=torch.long), "completion_mask": mask,
              "advantages": advantages, "old_per_token_logps": old, "num_items_in_batch": mask.sum()}
    return GRPOTrainer._compute_loss(stand_in, None, inputs), stand_in._metrics["train"]


# TRL builds SAPO's temperatures with torch.where on Python floats, a float32 tensor: 1.05 becomes 1.0499999523, so
# on these float64 batches SAPO agrees to float32's precision (in float32 training the two are the same numbers)
TOLERANCE = {"sapo": (1e-6, 1e-9)}


def close(name, ours, theirs, grad, trl_grad):
    rel, atol = TOLERANCE.get(name, (1e-10, 1e-12))
    assert float(ours.detach()) == pytest.approx(float(theirs.detach()), rel=rel, abs=atol)
    assert torch.allclose(grad, trl_grad, rtol=rel, atol=atol)


def both(name, seed=0, threshold=None):
    """(ours, TRL's): (loss, gradient with respect to the log-probs) on the same batch."""
    pytest.importorskip("trl")
    loss_type, level, options = CASES[name]
    logps, old, mask, advantages = batch(seed)
    ours_logps = logps.clone().requires_grad_(True)
    extra = {} if threshold is None else {"off_policy_mask_threshold": threshold}
    ours, metrics = get_policy_loss(name)(ours_logps, mask, advantages, old_logps=old, max_tokens=6, **options,
                                          **extra)
    ours.backward()
    trl_logps = logps.clone().requires_grad_(True)
    theirs, trl_metrics = trl_loss(trl_logps, old, mask, advantages, loss_type, level, options, threshold=threshold)
    theirs.backward()
    return (ours, ours_logps.grad, metrics), (theirs, trl_logps.grad, trl_metrics)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("name", sorted(CASES))
def test_each_loss_equals_trls_compute_loss(name, seed):
    (ours, grad, metrics), (theirs, trl_grad, trl_metrics) = both(name, seed)
    close(name, ours, theirs, grad, trl_grad)
    assert grad[3].abs().sum() == 0 and grad[2:4].abs().sum() == 0  # the empty completion, the invalid group
    if "clip_ratio/region_mean" in trl_metrics:  # the clip fired
        fired = metrics["clip_fraction_low"] + metrics["clip_fraction_high"]
        assert fired > 0 and trl_metrics["clip_ratio/region_mean"][0] > 0
        if CASES[name][1] == "token":  # on as many tokens as TRL counts (at sequence level TRL counts sequences)
            assert fired == pytest.approx(trl_metrics["clip_ratio/region_mean"][0])


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_loss_with_deepseeks_off_policy_mask_equals_trls(name):
    logps, old, mask, advantages = batch(0)
    kl = ((old - logps) * mask).sum(1) / mask.sum(1).clamp(min=1)
    threshold = float(kl[advantages < 0].median())  # some negative-advantage sequences dropped, some kept
    (ours, grad, metrics), (theirs, trl_grad, _) = both(name, 0, threshold)
    close(name, ours, theirs, grad, trl_grad)
    dropped = ((advantages < 0) & (kl > threshold))
    assert dropped.any() and metrics["off_policy_masked"] == pytest.approx(float(dropped.double().mean()))
    assert grad[dropped].abs().sum() == 0


def test_the_losses_fix_trls_aggregation():
    expected = {"grpo": "seq_mean_token_mean", "dapo": "token_mean", "bnpo": "token_mean",
                "gspo": "seq_mean_token_mean", "luspo": "seq_token_sum", "sapo": "seq_mean_token_mean",
                "vespo": "token_mean", "gmpo": "seq_mean_token_mean"}
    assert {name: loss_aggregation(get_policy_loss(name), "seq_mean_token_mean") for name in expected} == expected


# ---------------------------------------------------------------- GMPO: verl's geo_mean, by hand
def gmpo_by_hand(deltas, advantage, low=0.4, high=0.4):
    """verl's documented GMPO for one sequence: -A * exp(mean_t sgn(A) min(sgn(A) d_t, sgn(A) clip(d_t)))."""
    sign = (advantage > 0) - (advantage < 0)
    kept = [sign * min(sign * d, sign * min(max(d, -low), high)) for d in deltas]
    return -advantage * math.exp(sum(kept) / len(deltas)) if deltas else 0.0


def test_gmpo_equals_verls_formula_on_hand_worked_cases():
    gmpo = get_policy_loss("gmpo")
    # one sequence, A = +1, log ratios 0.1 and 0.9: the 0.9 is clipped to 0.4 (A > 0: min(d, clip(d)))
    # -> -exp((0.1 + 0.4) / 2) = -exp(0.25)
    loss, _ = gmpo(torch.tensor([[0.0, 0.0]]), torch.ones(1, 2), torch.tensor([1.0]),
                   old_logps=torch.tensor([[-0.1, -0.9]]))
    assert float(loss) == pytest.approx(-math.exp(0.25))
    # A = -2, log ratios -0.9 and 0.2: for A < 0 the kept value is max(d, clip(d)): -0.9 -> -0.4, 0.2 stays
    # -> 2 * exp((-0.4 + 0.2) / 2) = 2 exp(-0.1)
    loss, metrics = gmpo(torch.tensor([[0.0, 0.0]]), torch.ones(1, 2), torch.tensor([-2.0]),
                         old_logps=torch.tensor([[0.9, -0.2]]))
    assert float(loss) == pytest.approx(2 * math.exp(-0.1))
    assert metrics["clip_fraction_low"] == pytest.approx(0.5) and metrics["clip_fraction_high"] == 0.0


def test_gmpo_on_a_batch_with_an_empty_completion_and_an_invalid_group_is_the_mean_over_sequences():
    logps, old, mask, advantages = batch(3)
    logps = logps.clone().requires_grad_(True)
    loss, _ = get_policy_loss("gmpo")(logps, mask, advantages, old_logps=old)
    expected = []
    for row in range(8):
        length = int(mask[row].sum())
        deltas = [float(logps[row, t].detach() - old[row, t]) for t in range(length)]
        expected.append(gmpo_by_hand(deltas, float(advantages[row])))
    assert float(loss) == pytest.approx(sum(expected) / 8, rel=1e-10)  # the empty row counts in the mean, adds 0
    loss.backward()
    assert logps.grad[3].abs().sum() == 0 and logps.grad[2].abs().sum() == 0
    # the gradient vanishes on a token whose clip is active (A > 0 and d > 0.4: the kept value is the constant)
    deltas = (logps - old).detach()
    clipped = (advantages.unsqueeze(1) > 0) & (deltas > 0.4) & mask.bool()
    assert clipped.any() and logps.grad[clipped].abs().max() == 0
