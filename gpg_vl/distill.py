"""On-policy distillation and the policy's entropy: pure tensor functions (docs/distillation.md).

A teacher ν scores the tokens the student π sampled. Two forms:

* the policy-gradient form (`teacher.loss=reverse_kl`, Thinking Machines' on-policy distillation, verl's PG mode):
  a per-token advantage ::

      A_t = A_group + coef * sg(log ν(o_t) - log π(o_t))

  feeds the policy loss (GPG's ``-A_t log π(o_t)``; the GRPO family's surrogate alike). Its expectation under π is
  ``-coef * KL(π || ν)`` per token: the student is pushed towards the teacher on its own samples. With
  `teacher.only` the group advantage is 0 (no task reward: pure distillation).
* the supervised form (`teacher.loss=jsd`, GKD): the generalized Jensen-Shannon divergence between the two
  distributions over the full vocabulary at each sampled position, added to the policy loss times `coef`.

AGE with a teacher: a group is valid when its combined advantage is not all zero (`combined_valid`); a teacher
log-prob within `teacher.tolerance` of the student's adds nothing to it (a teacher served by vLLM differs from the
same weights in process by rounding: docs/distillation.md).

Entropy: ``H_t = logsumexp(z) - sum_v softmax(z)_v z_v`` of each scored position's logits z (computed where the
update computes them: gpg_vl/models/scoring.py); `high_entropy_mask` keeps the top-ρ entropy tokens (TRL's
``top_entropy_quantile``, the "80/20" result); `covariance_cut` picks the tokens verl's Clip-Cov takes the gradient
from (against entropy collapse, Cui et al. 2025).
"""

from __future__ import annotations

import torch
from torch import Tensor

TEACHER_LOSSES = ("reverse_kl", "jsd")  # teacher.loss: the policy-gradient form, the supervised (GKD) form


def teacher_advantages(group_advantages: Tensor, teacher_logps: Tensor, student_logps: Tensor, mask: Tensor, *,
                       coef: float, only: bool = False, tolerance: float = 0.0) -> Tensor:
    """Per-token advantages [N, C]: ``A_t = A_group + coef * (log ν - log π)`` on `mask`, 0 elsewhere; a gap of at
    most `tolerance` nats counts as agreement (0: teacher.tolerance, the precision of a teacher's log-probs).

    group_advantages [N] (each sequence's group advantage; ignored with `only`), teacher_logps / student_logps
    [N, C] (no gradient flows: the term is a stop-gradient), mask [N, C] bool (the tokens the loss counts)."""
    mask = mask.bool()
    gap = (teacher_logps.detach().double() - student_logps.detach().double())  # [N, C]
    gap = torch.where(gap.abs() <= tolerance, torch.zeros_like(gap), gap)  # within the precision: no signal
    base = torch.zeros_like(gap) if only else group_advantages.detach().double().unsqueeze(1).expand_as(gap)
    combined = base + coef * gap  # [N, C]
    return torch.where(mask, combined, torch.zeros_like(combined)).to(student_logps.dtype)


def combined_valid(token_advantages: Tensor, mask: Tensor, group_size: int) -> Tensor:
    """[b] bool: whether each group's combined advantage is not all zero (and finite) on its counted tokens.

    token_advantages [b * G, C], mask [b * G, C] (sequences of a group consecutive)."""
    counted = mask.bool()
    nonzero = (counted & (token_advantages != 0)).reshape(-1, group_size, token_advantages.shape[1])
    finite = (~counted | torch.isfinite(token_advantages)).reshape(nonzero.shape)
    return nonzero.flatten(1).any(dim=1) & finite.flatten(1).all(dim=1)


def teacher_kl(teacher_logps: Tensor, student_logps: Tensor, mask: Tensor) -> tuple[float, int]:
    """(sum over `mask` of log π - log ν, token count): the sampled estimate of KL(π || ν) per token, summed."""
    mask = mask.bool()
    gap = torch.where(mask, student_logps.double() - teacher_logps.double(), torch.zeros_like(student_logps.double()))
    return float(gap.sum()), int(mask.sum())


def generalized_jsd(student_logits: Tensor, teacher_logits: Tensor, *, beta: float = 0.5,
                    temperature: float = 1.0) -> Tensor:
    """GKD's generalized JSD per position. student_logits, teacher_logits [T, V] -> [T].

    With M = (1 - beta) * π + beta * ν (π the student's softmax, ν the teacher's, both at `temperature`):
    ``beta * KL(ν || M) + (1 - beta) * KL(π || M)`` for 0 < beta < 1; the ends are TRL's: beta = 0 is KL(ν || π)
    (forward KL), beta = 1 is KL(π || ν) (reverse KL, the sampled form's objective), as TRL 1.16's
    `GKDTrainer.generalized_jsd_loss` computes them. The gradient reaches `student_logits`."""
    student = torch.log_softmax(student_logits.float() / temperature, dim=-1)  # [T, V]
    teacher = torch.log_softmax(teacher_logits.float().detach() / temperature, dim=-1)  # [T, V]
    if beta == 0:
        return _kl(teacher, student)
    if beta == 1:
        return _kl(student, teacher)
    weight = torch.tensor(beta, dtype=student.dtype, device=student.device)
    mixture = torch.logsumexp(torch.stack([student + torch.log1p(-weight), teacher + torch.log(weight)]), dim=0)
    return beta * _kl(teacher, mixture) + (1 - beta) * _kl(student, mixture)


def _kl(p_log: Tensor, q_log: Tensor) -> Tensor:
    """KL(p || q) per row from log-probs [T, V] -> [T] (terms where p = 0 count 0)."""
    p = p_log.exp()
    return torch.where(p > 0, p * (p_log - q_log), torch.zeros_like(p)).sum(dim=-1)


def logits_entropy(logits: Tensor) -> Tensor:
    """Entropy [...] of softmax(logits [..., V]) in nats; -inf logits (suppressed ids) count 0."""
    logits = logits.float()
    normalizer = torch.logsumexp(logits, dim=-1, keepdim=True)  # [..., 1]
    probs = torch.exp(logits - normalizer)  # [..., V]
    weighted = torch.where(probs > 0, probs * logits, torch.zeros_like(probs)).sum(dim=-1)
    return normalizer.squeeze(-1) - weighted


def high_entropy_mask(entropies: Tensor, mask: Tensor, top_quantile: float, pool: Tensor | None = None) -> Tensor:
    """[N, C] bool: the counted tokens whose entropy is at least the (1 - `top_quantile`) quantile of the counted
    tokens' entropies (`pool`, when given: every process's counted entropies of this micro-batch, as TRL gathers
    them). entropies, mask [N, C]. TRL's `GRPOTrainer.get_high_entropy_mask(entropies, mask, 1 - top_quantile)`;
    top_quantile 1 keeps every counted token."""
    mask = mask.bool()
    values = entropies[mask].float() if pool is None else pool.float()
    if values.numel() == 0:
        return torch.zeros_like(mask)
    threshold = torch.quantile(values, 1.0 - top_quantile)
    return ((entropies * mask.float()) >= threshold) & mask


def covariance_cut(logps: Tensor, advantages: Tensor, mask: Tensor, *, ratio: float, low: float, high: float,
                   generator: torch.Generator | None = None) -> Tensor:
    """[N, C] bool: the tokens verl's Clip-Cov detaches. Each counted token's covariance term
    ``(A_t - mean A) * (log π_t - mean log π)`` (means over the counted tokens); of the tokens whose term lies strictly
    between `low` and `high`, ``max(1, int(ratio * counted))`` drawn uniformly at random without replacement (all of
    them where fewer are eligible). logps [N, C] (no gradient flows: the choice only), advantages [N] or [N, C], mask
    [N, C]. The draw is one ``torch.randperm`` over the eligible tokens in row-major order (`generator`, else the
    global one). On-policy (the ratio is 1) nothing is clipped by a surrogate, so this is verl's whole selection."""
    mask = mask.bool()
    logps = logps.detach().double()  # [N, C]
    advantages = advantages.detach().double()
    advantages = advantages.unsqueeze(1).expand_as(logps) if advantages.dim() == 1 else advantages  # [N, C]
    count = int(mask.sum())
    cut = torch.zeros_like(mask)
    if count == 0:
        return cut
    centred_a = advantages - advantages[mask].mean()  # [N, C]
    centred_l = logps - logps[mask].mean()  # [N, C]
    covariance = centred_a * centred_l  # [N, C]
    eligible = mask & (covariance > low) & (covariance < high)
    candidates = eligible.flatten().nonzero().squeeze(1)  # [E], row-major
    take = max(1, int(ratio * count))
    order = torch.randperm(len(candidates), generator=generator, device=candidates.device)[:take]
    cut.view(-1)[candidates[order]] = True
    return cut
