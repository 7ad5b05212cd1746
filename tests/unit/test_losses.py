"""The GRPO family's losses and the registries: hand-worked cases, a slow loop reference, edges."""

import math
import random

import pytest
import torch

from gpg_vl.errors import UserError
from gpg_vl.objective import (
    POLICY_LOSSES,
    get_advantage,
    get_policy_loss,
    loss_aggregation,
    loss_needs,
    overlong_penalty,
    register_advantage,
    register_policy_loss,
)

F64 = torch.float64


def ref_loss(name, logps, old, ref, mask, advs, *, clip_low=0.2, clip_high=None, kl_coef=0.0, max_tokens=None):
    """A plain-Python loop over sequences and tokens (the definitions of REFERENCE.md section 6)."""
    high = {"dapo": 0.28}.get(name, clip_low) if clip_high is None else clip_high
    beta = kl_coef if name == "grpo" else 0.0
    per_seq, total, tokens = [], 0.0, 0
    for i, row in enumerate(mask):
        terms = []
        for t, keep in enumerate(row):
            if not keep:
                continue
            ratio = math.exp(logps[i][t] - (old[i][t] if old is not None else logps[i][t]))
            clipped = min(max(ratio, 1 - clip_low), 1 + high)
            term = -min(ratio * advs[i], clipped * advs[i])
            if beta:
                d = ref[i][t] - logps[i][t]
                term += beta * (math.exp(d) - d - 1)
            terms.append(term)
        total += sum(terms)
        tokens += len(terms)
        per_seq.append(sum(terms) / max_tokens if name == "dr_grpo" else sum(terms) / max(len(terms), 1))
    if name == "dapo":
        return total / max(tokens, 1)
    return sum(per_seq) / len(per_seq)


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_losses_match_the_loop_reference_on_random_inputs(name, seed):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    n, length = 5, 7
    logps = -torch.rand(n, length, dtype=F64) * 3
    old = logps + torch.randn(n, length, dtype=F64) * 0.3  # ratios on both sides of the clip range
    ref = logps + torch.randn(n, length, dtype=F64) * 0.5
    mask = torch.tensor([[t < rng.randint(1, length) for t in range(length)] for _ in range(n)])
    advs = torch.randn(n, dtype=F64)
    loss_fn = get_policy_loss(name)
    kwargs = {"old_logps": old, "ref_logps": ref, "kl_coef": 0.04, "max_tokens": 10,
              "aggregation": loss_aggregation(loss_fn, "seq_mean_token_mean")}
    loss, metrics = loss_fn(logps, mask, advs, **kwargs)
    expected = ref_loss(name, logps.tolist(), old.tolist(), ref.tolist(), mask.tolist(), advs.tolist(),
                        kl_coef=0.04, max_tokens=10)
    assert float(loss) == pytest.approx(expected, rel=1e-12, abs=1e-12)
    ratios = [math.exp(a - b) for ra, rb, rm in zip(logps.tolist(), old.tolist(), mask.tolist(), strict=True)
              for a, b, m in zip(ra, rb, rm, strict=True) if m]
    assert metrics["ratio_mean"] == pytest.approx(sum(ratios) / len(ratios))
    assert metrics["ratio_max"] == pytest.approx(max(ratios))
    # the gradient of a loss over chunks with the global normalizer equals the full-batch gradient
    x = logps.clone().requires_grad_(True)
    loss_fn(x, mask, advs, **kwargs)[0].backward()
    parts = torch.zeros_like(x)
    count = int(mask.sum()) if kwargs["aggregation"] == "token_mean" else n
    for chunk in (slice(0, 2), slice(2, n)):
        y = logps[chunk].clone().requires_grad_(True)
        loss_fn(y, mask[chunk], advs[chunk], **{**kwargs, "old_logps": old[chunk], "ref_logps": ref[chunk]},
                normalizer=count)[0].backward()
        parts[chunk] = y.grad
    assert torch.allclose(parts, x.grad, rtol=0, atol=1e-12)


def test_clipping_by_hand():
    # one sequence of 4 tokens, A = +1: ratios 1.5 (clipped above: no gradient), 1.1, 0.5 (below, A > 0: kept), 1
    old = torch.zeros(1, 4, dtype=F64)
    logps = torch.log(torch.tensor([[1.5, 1.1, 0.5, 1.0]], dtype=F64)).requires_grad_(True)
    mask = torch.ones(1, 4, dtype=torch.bool)
    loss, m = get_policy_loss("grpo")(logps, mask, torch.tensor([1.0], dtype=F64), old_logps=old)
    # -min(r A, clip(r) A) per token: -1.2, -1.1, -0.5, -1.0; token mean
    assert float(loss.detach()) == pytest.approx(-(1.2 + 1.1 + 0.5 + 1.0) / 4)
    loss.backward()  # d/dlogp of -r A = -r / 4 where unclipped; 0 where clipped above
    assert logps.grad.tolist()[0] == pytest.approx([0.0, -1.1 / 4, -0.5 / 4, -1.0 / 4])
    assert (m["clip_fraction_high"], m["clip_fraction_low"]) == (0.25, 0.0)
    assert m["ratio_max"] == pytest.approx(1.5) and m["logp_drift"] == pytest.approx(math.log(1.5 * 1.1 * 0.5) / 4)
    # A = -1: the ratio 0.5 is clipped below (no gradient), 1.5 is not
    _, m = get_policy_loss("grpo")(logps.detach(), mask, torch.tensor([-1.0], dtype=F64), old_logps=old)
    assert (m["clip_fraction_high"], m["clip_fraction_low"]) == (0.0, 0.25)
    # DAPO's clip-higher: 1.25 is inside [0.8, 1.28], so nothing is clipped above
    logps = torch.log(torch.tensor([[1.25, 1.0]], dtype=F64))
    _, m = get_policy_loss("dapo")(logps, torch.ones(1, 2, dtype=torch.bool), torch.tensor([1.0], dtype=F64),
                                   old_logps=torch.zeros(1, 2, dtype=F64), aggregation="token_mean")
    assert m["clip_fraction_high"] == 0.0


def test_kl_k3_and_on_policy_gradient_by_hand():
    # on-policy (old = None): ratio 1, so the surrogate's gradient is GPG's; the k3 KL adds beta * (1 - exp(d))
    logps = torch.tensor([[-1.0, -2.0]], dtype=F64, requires_grad=True)
    ref = torch.tensor([[-1.5, -2.0]], dtype=F64)
    mask = torch.ones(1, 2, dtype=torch.bool)
    loss, m = get_policy_loss("grpo")(logps, mask, torch.tensor([2.0], dtype=F64), ref_logps=ref, kl_coef=0.1)
    d = -0.5
    k3 = math.exp(d) - d - 1
    assert m["kl"] == pytest.approx(k3 / 2) and m["ratio_mean"] == 1.0 and m["logp_drift"] == 0.0
    assert float(loss) == pytest.approx(-2.0 + 0.1 * k3 / 2)
    loss.backward()
    assert logps.grad.tolist()[0] == pytest.approx([(-2.0 + 0.1 * (1 - math.exp(d))) / 2, -2.0 / 2])
    gpg = logps.detach().clone().requires_grad_(True)
    get_policy_loss("gpg")(gpg, mask, torch.tensor([2.0], dtype=F64))[0].backward()
    assert gpg.grad.tolist() == [[-1.0, -1.0]]
    with pytest.raises(ValueError, match="needs ref_logps"):
        get_policy_loss("grpo")(logps, mask, torch.tensor([2.0], dtype=F64), kl_coef=0.1)


def test_dr_grpo_divides_token_sums_by_the_constant():
    logps = torch.tensor([[-1.0, -1.0, 0.0], [-1.0, 0.0, 0.0]], dtype=F64)
    mask = torch.tensor([[True, True, False], [True, False, False]])
    loss, _ = get_policy_loss("dr_grpo")(logps, mask, torch.tensor([1.0, -1.0], dtype=F64), max_tokens=4,
                                         aggregation="seq_mean_token_sum")
    assert float(loss) == pytest.approx(((-2.0) / 4 + 1.0 / 4) / 2)  # (-1 per token x 2, +1 x 1) / 4, mean


def test_masked_padding_gives_no_nan():
    logps = torch.tensor([[-1.0, -math.inf]], dtype=F64, requires_grad=True)
    mask = torch.tensor([[True, False]])
    for name in ("grpo", "dr_grpo", "dapo"):
        loss, _ = get_policy_loss(name)(logps, mask, torch.tensor([1.0], dtype=F64),
                                        old_logps=torch.tensor([[-1.1, math.nan]], dtype=F64),
                                        ref_logps=torch.tensor([[-1.2, -math.inf]], dtype=F64), kl_coef=0.04,
                                        max_tokens=2,
                                        aggregation=loss_aggregation(get_policy_loss(name), "seq_mean_token_mean"))
        loss.backward()
        assert math.isfinite(float(loss)) and torch.isfinite(logps.grad).all()
        logps.grad = None


def test_losses_declare_what_they_need():
    assert loss_needs(get_policy_loss("gpg")) == ()
    assert loss_needs(get_policy_loss("grpo")) == ("old", "ref")
    assert loss_needs(get_policy_loss("dr_grpo")) == loss_needs(get_policy_loss("dapo")) == ("old",)
    assert loss_aggregation(get_policy_loss("dapo"), "seq_mean_token_mean") == "token_mean"


def test_sample_std_advantage_by_hand():
    adv, valid = get_advantage("std_normalized")(torch.tensor([[1.0, 0.0], [3.0, 3.0]], dtype=F64))
    std = math.sqrt(0.5)  # torch's default (Bessel-corrected) std of (1, 0)
    assert adv[0].tolist() == pytest.approx([0.5 / (std + 1e-4), -0.5 / (std + 1e-4)])
    assert valid.tolist() == [True, False] and adv[1].tolist() == [0.0, 0.0]


def test_overlong_penalty_by_hand():
    lengths = torch.tensor([10, 12, 14, 16])
    assert overlong_penalty(lengths, 16, 4).tolist() == [0.0, 0.0, -0.5, -1.0]


def test_registries_reject_duplicates_list_valid_names_and_load_outside_functions(tmp_path, monkeypatch):
    with pytest.raises(UserError, match="policy loss 'gpg' is already registered"):
        register_policy_loss("gpg")(lambda *a, **k: None)
    with pytest.raises(UserError, match="advantage estimator 'none' is already registered"):
        register_advantage("none")(lambda r: r)
    with pytest.raises(UserError, match="unknown trainer.loss 'ppo'; valid options: bnpo, cispo, dapo, dr_grpo, gmpo, "
                                        "gpg, grpo, gspo, luspo, sapo, vespo"):
        get_policy_loss("ppo")
    with pytest.raises(UserError, match="unknown trainer.advantage 'z'; valid options: group_mean, none, std_"):
        get_advantage("z")
    plugin = tmp_path / "my_loss.py"
    plugin.write_text("from gpg_vl.objective import register_policy_loss, clipped_surrogate\n"
                      "@register_policy_loss('plugin_test_loss', needs=('old',))\n"
                      "def half(*args, **kwargs):\n"
                      "    loss, m = clipped_surrogate(*args, **kwargs)\n"
                      "    return loss / 2, m\n"
                      "def scaled(rewards):\n"
                      "    return rewards * 2, rewards.new_ones(rewards.shape[0], dtype=bool)\n")
    try:
        loaded = get_policy_loss(f"{plugin}:half")
        assert loss_needs(loaded) == ("old",) and "plugin_test_loss" in POLICY_LOSSES
        assert get_advantage(f"{plugin}:scaled")(torch.ones(1, 2))[0].tolist() == [[2.0, 2.0]]
        with pytest.raises(UserError, match="defines no 'nothing'"):
            get_policy_loss(f"{plugin}:nothing")
        with pytest.raises(UserError, match="cannot import module 'no_such_module_x'"):
            get_policy_loss("no_such_module_x:f")
    finally:
        POLICY_LOSSES.unregister("plugin_test_loss")


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_a_registered_loss_called_directly_equals_the_trainers_use_of_it(name):
    """Through the public names: called with its options only, a loss computes what the trainer computes with
    it (the registered aggregation, the batch's own count as normalizer): the same loss and gradient."""
    from gpg_vl.config.schema import TrainerSettings
    from gpg_vl.train.step.loss_call import trainer_loss_options

    torch.manual_seed(3)
    logps = -torch.rand(4, 6, dtype=F64) * 2
    old, ref = logps + 0.2 * torch.randn(4, 6, dtype=F64), logps + 0.3 * torch.randn(4, 6, dtype=F64)
    mask = torch.tensor([[t < n for t in range(6)] for n in (6, 2, 4, 1)])
    advs = torch.randn(4, dtype=F64)
    settings = TrainerSettings(loss=name, aggregation=loss_aggregation(POLICY_LOSSES[name], "seq_mean_token_mean"),
                               kl_coef=0.04 if "ref" in loss_needs(POLICY_LOSSES[name]) else 0.0)
    options = trainer_loss_options(settings, max_new_tokens=8)
    inputs = {"old_logps": old, "ref_logps": ref}
    trained = logps.clone().requires_grad_(True)
    loss_fn = get_policy_loss(name)
    aggregation = loss_aggregation(loss_fn, settings.aggregation)
    count = int(mask.sum()) if aggregation == "token_mean" else mask.shape[0]
    expected, _ = loss_fn(trained, mask, advs, **inputs, aggregation=aggregation, normalizer=count, **options)
    expected.backward()
    direct = logps.clone().requires_grad_(True)
    loss, _ = POLICY_LOSSES[name](direct, mask, advs, **inputs, **options)
    loss.backward()
    assert float(loss) == float(expected) and torch.equal(direct.grad, trained.grad)


def test_dr_grpo_without_max_tokens_and_a_fixed_loss_with_another_aggregation_fail_in_one_sentence():
    logps, mask, advs = torch.zeros(1, 2, dtype=F64), torch.ones(1, 2, dtype=torch.bool), torch.ones(1, dtype=F64)
    with pytest.raises(UserError, match=r"^policy loss dr_grpo needs the option max_tokens \(the completion"):
        get_policy_loss("dr_grpo")(logps, mask, advs)
    with pytest.raises(UserError, match="^policy loss dapo aggregates as token_mean only; it was called with "
                                        "aggregation='seq_mean_token_mean'.$"):
        get_policy_loss("dapo")(logps, mask, advs, aggregation="seq_mean_token_mean")
    assert float(get_policy_loss("dapo")(logps, mask, advs)[0]) == float(
        get_policy_loss("dapo")(logps, mask, advs, aggregation="token_mean")[0])
