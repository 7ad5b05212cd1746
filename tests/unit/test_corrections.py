"""Off-policy corrections (gpg_vl/objective/corrections.py) against hand-worked cases, AGE's counts with staleness and
rejection, the schedule of trainer.max_staleness, and CISPO against TRL 1.16's own `_compute_loss`."""

from __future__ import annotations

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from gpg_vl.errors import UserError
from gpg_vl.objective import get_policy_loss
from gpg_vl.objective.corrections import (
    CorrectionSums,
    age_counts,
    apply_correction,
    correction_metrics,
    correction_options,
    get_correction,
)
from gpg_vl.train.step.pipeline import sampling_version, staleness_note

LN = math.log
# two sequences of three tokens; the second has two counted tokens
MASK = torch.tensor([[True, True, True], [True, True, False]])
# log rho per token: sequence 0: ratios 2, 1, 0.5 (product 1); sequence 1: ratios 4, 2 (product 8)
LOG_RATIO = torch.tensor([[LN(2), 0.0, LN(0.5)], [LN(4), LN(2), 0.0]])


def test_token_tis_caps_each_tokens_ratio():
    weights, rejected, capped = get_correction("token_tis")(LOG_RATIO, MASK, torch.tensor([1.0, -1.0]), cap=3.0)
    assert torch.allclose(weights[MASK], torch.tensor([2.0, 1.0, 0.5, 3.0, 2.0]))
    assert not rejected.any()
    assert capped.tolist() == [[False, False, False], [True, False, False]]  # only the ratio 4 is above 3


def test_sequence_tis_weighs_every_token_by_the_capped_product():
    weights, _, capped = get_correction("sequence_tis")(LOG_RATIO, MASK, torch.tensor([1.0, -1.0]), cap=5.0)
    assert torch.allclose(weights[0], torch.ones(3)) and torch.allclose(weights[1], torch.full((3,), 5.0))
    # sequence 0's product is 1 (not capped, though its first token's ratio is 2); sequence 1's is 8 > 5: its two
    # counted tokens are capped
    assert capped.tolist() == [[False, False, False], [True, True, False]]


def test_geometric_mean_rejection_rejects_sequences_outside_the_band():
    # geometric means: sequence 0 exp((ln2 + 0 + ln0.5) / 3) = 1; sequence 1 exp((ln4 + ln2) / 2) = sqrt(8) = 2.83
    weights, rejected, capped = get_correction("geo_reject")(LOG_RATIO, MASK, torch.tensor([1.0, 1.0]), delta=0.5)
    assert rejected.tolist() == [False, True] and torch.equal(weights, torch.ones(2, 3)) and not capped.any()


def test_topr_weighs_negative_advantages_only_clipped_to_one():
    log_ratio = torch.tensor([[LN(0.5), 0.0], [LN(0.25), 0.0], [LN(3.0), 0.0], [LN(3.0), 0.0]])
    mask = torch.ones(4, 2, dtype=torch.bool)
    weights, _, capped = get_correction("topr")(log_ratio, mask, torch.tensor([1.0, -1.0, -1.0, 1.0]))
    assert torch.allclose(weights[:, 0], torch.tensor([1.0, 0.25, 1.0, 1.0]))  # A >= 0: 1; A < 0: clip(rho, 0, 1)
    # capped: only the negative sequence whose ratio 3 was clipped to 1 (the positive one with ratio 3 weighs none)
    assert capped.tolist() == [[False, False], [False, False], [True, True], [False, False]]


def test_apply_correction_zeroes_rejected_sequences_and_keeps_one_off_the_mask():
    logps = torch.tensor([[-1.0, -1.0, -1.0], [-1.0, -1.0, -7.0]], requires_grad=True)
    behaviour = logps.detach() - LOG_RATIO
    weights, rejected, capped = apply_correction("geo_reject", {"delta": 0.5}, logps, behaviour, MASK, torch.ones(2))
    assert not capped.any()
    assert not weights.requires_grad and rejected.tolist() == [False, True]
    assert torch.equal(weights, torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 1.0]]))  # off the mask: 1


def test_correction_metrics_by_hand():
    sums = CorrectionSums()
    logps = torch.zeros(2, 3)
    behaviour = logps - LOG_RATIO
    weights, rejected, capped = apply_correction("token_tis", {"cap": 3.0}, logps, behaviour, MASK, torch.ones(2))
    sums.add(logps, behaviour, MASK, weights, rejected, capped)
    metrics = correction_metrics(torch.tensor([sums.as_list()], dtype=torch.float64))
    assert metrics["is_weight_mean"] == pytest.approx((2 + 1 + 0.5 + 3 + 2) / 5)
    assert metrics["is_weight_max"] == 3.0 and metrics["truncated_fraction"] == pytest.approx(1 / 5)
    assert metrics["rejected_fraction"] == 0.0
    # k3 of KL(pi_theta || pi_b) per token: rho - log rho - 1 with rho = pi_b / pi_theta = 1 / ratio
    k3 = [r - math.log(r) - 1 for r in (0.5, 1.0, 2.0, 0.25, 0.5)]
    assert metrics["behaviour_kl"] == pytest.approx(sum(k3) / 5)


def test_truncated_fraction_counts_what_each_correction_capped():
    """Sequence-level weights are not held to each token's ratio: at ratios of 2 and 0.5 in one sequence (product
    1), sequence_tis and topr cap nothing (a reading by token counted the ratio-2 token as truncated), and a
    correction registered without `capped` is read by token."""
    logps = torch.zeros(2, 3)
    behaviour = logps - LOG_RATIO
    fractions = {}
    for name, options, advantages in (("sequence_tis", {"cap": 5.0}, [1.0, -1.0]), ("topr", {}, [-1.0, 1.0]),
                                      ("token_tis", {"cap": 3.0}, [1.0, 1.0])):
        sums = CorrectionSums()
        weights, rejected, capped = apply_correction(name, options, logps, behaviour, MASK, torch.tensor(advantages))
        sums.add(logps, behaviour, MASK, weights, rejected, capped)
        fractions[name] = correction_metrics(torch.tensor([sums.as_list()], dtype=torch.float64))["truncated_fraction"]
    # sequence_tis: sequence 1 (product 8 > 5), 2 of 5 tokens; topr: sequence 0 is the negative one, product 1: none;
    # token_tis: the ratio 4 > 3, 1 of 5
    assert fractions == {"sequence_tis": pytest.approx(2 / 5), "topr": 0.0, "token_tis": pytest.approx(1 / 5)}

    def two_outputs(log_ratio, mask, advantages):  # a correction from before `capped`: w_t = min(rho_t, 1)
        return torch.exp(log_ratio).clamp(max=1.0), torch.zeros(mask.shape[0], dtype=torch.bool)

    from gpg_vl.objective import corrections

    corrections.CORRECTIONS.add("two_outputs_probe", two_outputs)
    try:
        _, _, capped = apply_correction("two_outputs_probe", {}, logps, behaviour, MASK, torch.ones(2))
    finally:
        corrections.CORRECTIONS.unregister("two_outputs_probe")
    assert capped.tolist() == [[True, False, False], [True, True, False]]  # the ratios 2, 4 and 2 above 1


def test_age_counts_by_hand():
    """B = 5 groups of G = 2: group 0 valid; group 1 without signal; group 2 valid with one sequence rejected;
    group 3 valid with both rejected (it counts in M); group 4 dropped as too stale (it leaves B)."""
    valid = torch.tensor([True, False, True, True, True])
    rejected = torch.tensor([[False, False], [False, False], [True, False], [True, True], [False, False]])
    stale = torch.tensor([False, False, False, False, True])
    counts = age_counts(valid, rejected, stale)
    assert (counts.groups, counts.without_signal) == (4, 2)  # B = 5 - 1 stale; M = group 1 + group 3
    assert counts.normalizer == 2 + 1  # group 0's two sequences and group 2's kept one
    assert counts.alpha == pytest.approx(4 / 2)


def test_correction_options_are_declared_by_the_correction():
    assert correction_options("token_tis", {}) == {"cap": 2.0}
    assert correction_options("geo_reject", {"delta": 0.1}) == {"delta": 0.1}
    with pytest.raises(UserError, match="correction token_tis has no option 'delta'; its options: cap"):
        correction_options("token_tis", {"delta": 0.1})
    with pytest.raises(UserError, match="trainer.correction"):
        get_correction("nope")


@pytest.mark.parametrize(("name", "options", "allowed"), [
    ("token_tis", {"cap": -1}, "a number > 0"), ("token_tis", {"cap": 0}, "a number > 0"),
    ("sequence_tis", {"cap": "abc"}, "a number > 0"), ("token_tis", {"cap": math.nan}, "a number > 0"),
    ("geo_reject", {"delta": 0}, "a number > 0 and < 1"), ("geo_reject", {"delta": 1.5}, "a number > 0 and < 1")])
def test_a_correction_option_outside_its_declared_range_fails_in_one_sentence_naming_it(name, options, allowed):
    with pytest.raises(UserError) as error:
        correction_options(name, options)
    (key, value), = options.items()
    message = str(error.value)
    assert message.startswith(f"trainer.correction_options.{key}={value!r} is not allowed for correction {name}: "
                              f"give {allowed} (") and "\n" not in message, message
    assert correction_options(name, {key: 0.5})[key] == 0.5  # inside the range: taken


def test_a_plugin_corrections_option_without_a_declared_range_is_taken_as_given(tmp_path):
    plugin = tmp_path / "my_correction.py"
    plugin.write_text(
        "import torch\n"
        "def scaled(log_ratio, mask, advantages, *, scale=1.0, floor: float = 0.0):\n"
        "    return torch.full_like(log_ratio, scale), torch.zeros(mask.shape[0], dtype=torch.bool)\n")
    name = f"{plugin}:scaled"
    assert correction_options(name, {"scale": -3}) == {"scale": -3, "floor": 0.0}  # no range declared: as given
    with pytest.raises(UserError, match=r"trainer.correction_options.floor='x' is not allowed for correction .*: "
                                        r"give a number\.$"):
        correction_options(name, {"floor": "x"})  # a plain float annotation still says its type


def test_a_bad_correction_option_fails_before_the_model_loads(tmp_path, monkeypatch):
    from gpg_vl.cli import train_main
    from gpg_vl.config.compose import load_config

    monkeypatch.setattr("gpg_vl.train.build.build_policy", lambda *a, **k: pytest.fail("the model loaded"))
    with pytest.raises(UserError, match=r"trainer.correction_options.cap=-1 is not allowed for correction token_tis"):
        train_main(load_config("train", [f"output_dir={tmp_path}", "trainer.max_staleness=1",
                                         "trainer.correction=token_tis", "++trainer.correction_options.cap=-1"]))


def test_the_schedule_is_fixed_by_step_number():
    assert [sampling_version(n, 0) for n in range(1, 6)] == [0, 1, 2, 3, 4]  # synchronous
    assert [sampling_version(n, 1) for n in range(1, 6)] == [0, 0, 1, 2, 3]  # one step behind
    assert [sampling_version(n, 2) for n in range(1, 6)] == [0, 0, 0, 1, 2]


def test_a_staleness_as_long_as_the_run_is_said_in_one_line():
    note = staleness_note(1000, 3)
    assert note == ("note: trainer.max_staleness=1000 reaches this 3-step run: every step samples with the initial "
                    "weights, so the sampler never updates (set trainer.max_staleness to at most 1 for it to).")
    assert staleness_note(2, 3) is not None and staleness_note(1, 2) is not None  # the last step samples version 0
    assert staleness_note(1, 3) is None and staleness_note(0, 3) is None and staleness_note(5, 1) is None
    assert all((staleness_note(k, n) is None) == (sampling_version(n, k) > 0 or k == 0 or n == 1)
               for k in range(0, 6) for n in range(1, 8))


def trl_cispo(per_token_logps, old_logps, completion_mask, advantages, *, cap):
    """TRL 1.16's `GRPOTrainer._compute_loss` with loss_type="cispo" (epsilon_high = the cap), on a stand-in
    trainer whose per-token log-prob function returns `per_token_logps` [N, C]."""
    from accelerate import Accelerator
    from trl.trainer.grpo_trainer import GRPOTrainer

    n, width = per_token_logps.shape
    stand_in = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *args, **kwargs: (per_token_logps,
                                                                     torch.zeros_like(per_token_logps), None),
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, importance_sampling_level="token", beta=0.0,
        args=SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=1), loss_type="cispo",
        epsilon_low=0.2, epsilon_high=cap, use_vllm=False, model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1, _entropy_bonus_enabled=False, aux_loss_enabled=False,
        accelerator=Accelerator(cpu=True), _metrics={"train": defaultdict(list)})
    inputs = {"prompt_ids": torch.zeros(n, 1, dtype=torch.long), "prompt_mask": torch.ones(n, 1, dtype=torch.long),
              "completion_ids": torch.zeros(n, width, dtype=torch.long),
              "completion_mask": completion_mask.to(per_token_logps.dtype), "advantages": advantages,
              "old_per_token_logps": old_logps, "num_items_in_batch": completion_mask.sum().float()}
    return GRPOTrainer._compute_loss(stand_in, None, inputs)


@pytest.mark.parametrize("cap", [0.8, 1.5, 5.0])
def test_cispo_equals_trls_compute_loss(cap):
    pytest.importorskip("trl")
    generator = torch.Generator().manual_seed(3)
    logps = (-torch.rand(6, 5, generator=generator) * 2).requires_grad_(True)
    old = logps.detach() + 0.5 * torch.randn(6, 5, generator=generator)
    mask = torch.rand(6, 5, generator=generator) > 0.3
    mask[:, 0] = True
    advantages = torch.randn(6, generator=generator)
    ours, _ = get_policy_loss("cispo")(logps, mask, advantages, old_logps=old, cap=cap)
    (ours_grad,) = torch.autograd.grad(ours, logps)
    theirs = trl_cispo(logps, old, mask, advantages, cap=cap)
    (theirs_grad,) = torch.autograd.grad(theirs, logps)
    assert torch.allclose(ours, theirs, atol=1e-6) and torch.allclose(ours_grad, theirs_grad, atol=1e-7)
