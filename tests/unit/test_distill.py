"""On-policy distillation and entropy (gpg_vl/objective/teacher_losses.py, token_masks.py, models/logits.py):
hand-worked per-token advantages, validity on the combined advantage, GPG's and GRPO's losses fed per-token advantages
against slow loops, GKD's generalized JSD equal to TRL 1.16's `GKDTrainer.generalized_jsd_loss`, the top-entropy mask
equal to TRL's `GRPOTrainer.get_high_entropy_mask`, and the chunked scorer's entropy equal to the entropy of the full
logits."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from gpg_vl.models.logits import completion_logps, logits_entropy
from gpg_vl.objective import get_policy_loss
from gpg_vl.objective.teacher_losses import combined_valid, generalized_jsd, teacher_advantages, teacher_kl
from gpg_vl.objective.token_masks import covariance_cut, high_entropy_mask


def test_teacher_advantages_by_hand():
    # two sequences of 3 tokens, the second has 2; A_group = (0.5, -0.5), coef 0.5
    nu = torch.tensor([[-1.0, -2.0, -0.5], [-0.1, -3.0, -9.0]])
    pi = torch.tensor([[-1.5, -1.0, -0.5], [-0.4, -1.0, -1.0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    adv = teacher_advantages(torch.tensor([0.5, -0.5]), nu, pi, mask, coef=0.5)
    # 0.5 + 0.5 * (-1 + 1.5), 0.5 + 0.5 * (-2 + 1), 0.5 + 0; -0.5 + 0.5 * 0.3, -0.5 + 0.5 * (-2), masked 0
    expected = torch.tensor([[0.75, 0.0, 0.5], [-0.35, -1.5, 0.0]])
    assert torch.allclose(adv, expected, atol=1e-6)
    only = teacher_advantages(torch.tensor([0.5, -0.5]), nu, pi, mask, coef=0.5, only=True)
    assert torch.allclose(only, torch.tensor([[0.25, -0.5, 0.0], [0.15, -1.0, 0.0]]), atol=1e-6)
    total, count = teacher_kl(nu, pi, mask)  # sum of pi - nu over the 5 counted tokens
    assert count == 5 and total == pytest.approx(-0.5 + 1.0 + 0.0 - 0.3 + 2.0)


def test_teacher_advantages_take_no_gradient():
    pi = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    adv = teacher_advantages(torch.tensor([0.0]), torch.tensor([[-0.5, -0.5]]), pi, torch.ones(1, 2, dtype=torch.bool),
                             coef=1.0)
    assert not adv.requires_grad


def test_combined_validity():
    # 3 groups of 2 sequences, 2 tokens: group 0 all zero; group 1 one nonzero token; group 2 nonzero only where
    # the mask is off (a padded or observation token): invalid
    adv = torch.tensor([[0.0, 0.0], [0.0, 0.0], [0.0, 0.3], [0.0, 0.0], [0.0, 0.0], [0.0, 2.0]])
    mask = torch.tensor([[1, 1], [1, 1], [1, 1], [1, 0], [1, 1], [1, 0]], dtype=torch.bool)
    assert combined_valid(adv, mask, 2).tolist() == [False, True, False]
    adv[0, 0] = float("nan")
    assert combined_valid(adv, mask, 2).tolist() == [False, True, False]


def slow_gpg(logps, mask, adv):
    """-1/N sum_i 1/|o_i| sum_t A_it logp_it, a loop."""
    total = 0.0
    for i in range(logps.shape[0]):
        tokens = [t for t in range(logps.shape[1]) if mask[i, t]]
        total += sum(-float(adv[i, t]) * float(logps[i, t]) for t in tokens) / max(len(tokens), 1)
    return total / logps.shape[0]


def test_gpg_loss_takes_per_token_advantages():
    generator = torch.Generator().manual_seed(0)
    logps = (-torch.rand(4, 5, generator=generator, dtype=torch.float64) * 2).requires_grad_()
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [0, 0, 0, 0, 0], [1, 1, 1, 0, 0]], dtype=torch.bool)
    adv = torch.randn(4, 5, generator=generator, dtype=torch.float64)
    loss, _ = get_policy_loss("gpg")(logps, mask, adv)
    assert float(loss.detach()) == pytest.approx(slow_gpg(logps.detach(), mask, adv), rel=1e-12)
    # per-token advantages equal along each row are the per-sequence loss
    row = adv[:, 0]
    same, _ = get_policy_loss("gpg")(logps, mask, row.unsqueeze(1).expand(4, 5))
    plain, _ = get_policy_loss("gpg")(logps, mask, row)
    assert float(same) == float(plain)


@pytest.mark.parametrize("name", ["grpo", "dapo", "cispo"])
def test_grpo_family_takes_per_token_advantages(name):
    """On-policy (ratio 1) a ratio loss's gradient is the policy gradient -A_t / norm per token; with advantages
    equal along each row it is the per-sequence loss, bit for bit."""
    generator = torch.Generator().manual_seed(1)
    logps = (-torch.rand(3, 4, generator=generator, dtype=torch.float64) * 2).requires_grad_()
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0]], dtype=torch.bool)
    row = torch.tensor([0.7, -0.2, 0.4], dtype=torch.float64)
    loss = get_policy_loss(name)
    same, _ = loss(logps, mask, row.unsqueeze(1).expand(3, 4))
    plain, _ = loss(logps, mask, row)
    assert float(same) == float(plain)
    adv = torch.randn(3, 4, generator=generator, dtype=torch.float64)
    value, _ = loss(logps, mask, adv)
    (grad,) = torch.autograd.grad(value, logps)
    tokens = mask.sum()
    expected = torch.where(mask, -adv / tokens if name in ("dapo", "cispo") else
                           -adv / (3 * mask.sum(1, keepdim=True)), torch.zeros_like(adv))
    assert torch.allclose(grad, expected, atol=1e-12)


def trl_jsd(student, teacher, beta, temperature=1.0):
    from trl.experimental.gkd import GKDTrainer

    return GKDTrainer.generalized_jsd_loss(student, teacher, beta=beta, temperature=temperature, reduction="none")


@pytest.mark.parametrize("beta", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_generalized_jsd_equals_trl(beta):
    generator = torch.Generator().manual_seed(2)
    student = (torch.randn(7, 11, generator=generator) * 3).requires_grad_()
    teacher = torch.randn(7, 11, generator=generator) * 3
    ours = generalized_jsd(student, teacher, beta=beta, temperature=0.7)  # [7]
    theirs = trl_jsd(student, teacher, beta, temperature=0.7).sum(-1)  # [7, 11] -> [7]
    assert torch.allclose(ours, theirs, rtol=1e-5, atol=1e-6)
    (grad,) = torch.autograd.grad(ours.sum(), student)
    (trl_grad,) = torch.autograd.grad(theirs.sum(), student)
    assert torch.allclose(grad, trl_grad, rtol=1e-4, atol=1e-6)


def test_jsd_ends_are_the_two_kls_by_hand():
    student, teacher = torch.log(torch.tensor([[0.5, 0.5]])), torch.log(torch.tensor([[0.9, 0.1]]))
    reverse = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)  # KL(student || teacher)
    forward = 0.9 * math.log(0.9 / 0.5) + 0.1 * math.log(0.1 / 0.5)  # KL(teacher || student)
    assert float(generalized_jsd(student, teacher, beta=0.0)) == pytest.approx(forward, rel=1e-6)  # TRL's ends
    assert float(generalized_jsd(student, teacher, beta=1.0)) == pytest.approx(reverse, rel=1e-6)
    assert float(generalized_jsd(teacher, teacher, beta=0.5)) == pytest.approx(0.0, abs=1e-7)


def trl_entropy_mask(entropies, mask, threshold):
    from accelerate import Accelerator
    from trl.trainer.grpo_trainer import GRPOTrainer

    stand_in = SimpleNamespace(accelerator=Accelerator(cpu=True))
    return GRPOTrainer.get_high_entropy_mask(stand_in, entropies, mask, threshold)


@pytest.mark.parametrize("rho", [0.2, 0.5, 0.8, 1.0])
def test_high_entropy_mask_equals_trl(rho):
    generator = torch.Generator().manual_seed(3)
    entropies = torch.rand(5, 6, generator=generator) * 2
    entropies[1, 2] = entropies[0, 0]  # a tie at the threshold is kept by both
    mask = torch.rand(5, 6, generator=generator) > 0.3
    ours = high_entropy_mask(entropies, mask, rho)
    assert torch.equal(ours, trl_entropy_mask(entropies, mask, 1 - rho))
    assert not (ours & ~mask).any()
    if rho == 1.0:
        assert torch.equal(ours, mask)


def test_high_entropy_mask_by_hand():
    entropies = torch.tensor([[0.1, 0.9, 0.5, 7.0], [0.3, 0.7, 0.2, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool)  # 7.0 is padding: never kept
    kept = high_entropy_mask(entropies, mask, 0.25)  # the 75% quantile of the 7 counted values: 0.6
    assert kept.tolist() == [[False, True, False, False], [False, True, False, False]]
    assert not high_entropy_mask(entropies, torch.zeros_like(mask), 0.5).any()


def test_entropy_by_hand_and_suppressed_ids():
    logits = torch.log(torch.tensor([[0.25, 0.25, 0.5, 1e-30]]))
    assert float(logits_entropy(logits)) == pytest.approx(1.5 * math.log(2), rel=1e-5)
    logits[0, 3] = float("-inf")  # a suppressed id counts 0, no NaN
    assert float(logits_entropy(logits)) == pytest.approx(1.5 * math.log(2), rel=1e-5)


@pytest.mark.parametrize("chunk", [1, 3, 64])
def test_chunked_entropy_equals_full_logits(chunk):
    """The scorer's entropies come from the chunk logits it already computes; they equal the entropy of the full
    logits' sampling distribution (suppressed ids at -inf, temperature), and the log-probs are unchanged."""
    generator = torch.Generator().manual_seed(4)
    hidden = torch.randn(2, 5, 8, generator=generator, requires_grad=True)
    weight = torch.randn(13, 8, generator=generator)
    ids = torch.randint(0, 11, (2, 5), generator=generator)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], dtype=torch.bool)
    kwargs = {"suppressed_ids": [11, 12], "temperature": 0.8, "chunk_tokens": chunk}
    logps, entropy = completion_logps(hidden, weight, ids, mask, entropy=True, **kwargs)
    plain = completion_logps(hidden, weight, ids, mask, **kwargs)
    assert torch.equal(logps, plain)
    full = (hidden @ weight.T).detach()
    full[..., 11:] = float("-inf")
    expected = torch.where(mask, logits_entropy(full / 0.8), torch.zeros(2, 5))
    assert torch.allclose(entropy, expected, atol=1e-5)
    assert not entropy.requires_grad
    (grad,) = torch.autograd.grad(logps.sum(), hidden)  # the backward ignores the entropy output
    (plain_grad,) = torch.autograd.grad(plain.sum(), hidden)
    assert torch.equal(grad, plain_grad)


def test_a_tasks_teacher_kl_by_hand():
    """task=mix's per-task teacher_kl (gpg_vl/train/mixed.py): the mean of log student - log teacher over the counted
    tokens of the task's rollouts: the completion mask, or a trajectory's loss mask (its generated tokens)."""
    from gpg_vl.train.mixed import task_teacher_kl

    class Alone:  # one process: reduce is the identity
        device = "cpu"

        def reduce(self, tensor, op):
            return tensor

    def attempt(student, teacher, mask, loss_mask=None):
        rollout = SimpleNamespace(completion_mask=torch.tensor(mask), loss_mask=None if loss_mask is None else
                                  torch.tensor(loss_mask), token_logps={"student": torch.tensor(student),
                                                                        "teacher": torch.tensor(teacher)})
        return SimpleNamespace(rollout=rollout)

    single = attempt([[-1.0, -2.0, 0.0]], [[-1.5, -1.0, -9.0]], [[1, 1, 0]])  # gaps 0.5, -1.0 (the pad ignored)
    turns = attempt([[-0.5, -3.0, -1.0]], [[-1.0, -0.0, -2.0]], [[1, 1, 1]], loss_mask=[[1, 0, 1]])  # 0.5, 1.0
    assert task_teacher_kl([single], Alone()) == pytest.approx(-0.25)
    assert task_teacher_kl([turns], Alone()) == pytest.approx(0.75)
    assert task_teacher_kl([single, turns, SimpleNamespace(rollout=None)], Alone()) == pytest.approx(1.0 / 4)


def clip_cov_loop(logps, advantages, mask, ratio, low, high, seed):
    """verl's Clip-Cov selection written out token by token (the slow reference): the means over counted tokens, the
    covariance band, then one randperm over the eligible tokens in row-major order."""
    rows, cols = len(logps), len(logps[0])
    counted = [(i, j) for i in range(rows) for j in range(cols) if mask[i][j]]
    adv = [[advantages[i] if not isinstance(advantages[i], list) else advantages[i][j] for j in range(cols)]
           for i in range(rows)]
    mean_a = math.fsum(adv[i][j] for i, j in counted) / len(counted)
    mean_l = math.fsum(logps[i][j] for i, j in counted) / len(counted)
    eligible = [(i, j) for i, j in counted if low < (adv[i][j] - mean_a) * (logps[i][j] - mean_l) < high]
    take = max(1, int(ratio * len(counted)))
    order = torch.randperm(len(eligible), generator=torch.Generator().manual_seed(seed))[:take].tolist()
    return {eligible[k] for k in order}


def test_clip_cov_by_hand():
    # A = [1, -1] per sequence; log-probs [[-1, -3], [-2, -2]], all counted: mean A 0, mean log pi -2;
    # terms (1)(1) = 1, (1)(-1) = -1, (-1)(0) = 0, (-1)(0) = 0: only token (0, 0) lies in (0.5, 5)
    logps, adv, mask = torch.tensor([[-1.0, -3.0], [-2.0, -2.0]]), torch.tensor([1.0, -1.0]), torch.ones(2, 2)
    cut = covariance_cut(logps, adv, mask, ratio=0.0, low=0.5, high=5.0, generator=torch.Generator().manual_seed(0))
    assert cut.tolist() == [[True, False], [False, False]]  # max(1, int(0 x 4)) = 1 token
    assert not covariance_cut(logps, adv, mask, ratio=1.0, low=1.5, high=5.0).any()  # none eligible
    padded = covariance_cut(logps, adv, torch.tensor([[1, 0], [1, 1]]), ratio=1.0, low=-10, high=10)
    assert padded.tolist() == [[True, False], [True, True]]  # every counted token eligible, the pad never
    assert not covariance_cut(logps, adv, torch.zeros(2, 2), ratio=1.0, low=-10, high=10).any()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_clip_cov_equals_the_token_loop(seed):
    generator = torch.Generator().manual_seed(100 + seed)
    logps = -torch.rand(5, 7, generator=generator, dtype=torch.float64) * 4  # [N, C]
    mask = torch.rand(5, 7, generator=generator) < 0.8
    for advantages in (torch.randn(5, generator=generator, dtype=torch.float64),  # per sequence, per token
                       torch.randn(5, 7, generator=generator, dtype=torch.float64)):
        for ratio, low, high in ((0.2, 0.0, 2.0), (0.05, -0.5, 0.5), (1.0, -9.0, 9.0)):
            cut = covariance_cut(logps, advantages, mask, ratio=ratio, low=low, high=high,
                                 generator=torch.Generator().manual_seed(seed))
            expected = clip_cov_loop(logps.tolist(), advantages.tolist(), mask.tolist(), ratio, low, high, seed)
            assert {tuple(t) for t in cut.nonzero().tolist()} == expected
