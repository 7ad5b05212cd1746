"""On-policy distillation's maths (docs/distillation.md): the teacher losses, registered by name with what they need
(`register_teacher_loss(name, needs=...)`, as policy losses declare theirs), and what every form shares.

A teacher ν scores the tokens the student π sampled. A teacher loss declares what it reads of the teacher:

* ``needs="logps"``, the policy-gradient form: the teacher's log-probs of the sampled tokens (a teacher loaded beside
  the student, or vLLM servers: `teacher.urls`). The loss maps them to per-token advantages before the update's
  optimizer steps, ``fn(group_advantages [N], teacher_logps [N, C], student_logps [N, C], mask [N, C], *, coef, only,
  tolerance) -> advantages [N, C]`` (`tolerance`: teacher.tolerance, the nats within which a teacher log-prob agrees
  with the student's: a teacher served by vLLM differs from the same weights in process by rounding); the policy loss
  then takes them as it takes the group's (GPG's ``-A_t log π(o_t)``, the GRPO family's surrogate alike). `reverse_kl`
  (Thinking Machines' on-policy distillation, verl's PG mode)::

      A_t = A_group + coef * sg(log ν(o_t) - log π(o_t))

  whose expectation under π is ``-coef * KL(π || ν)`` per token. With `only` the group advantage is 0 (no task
  reward: pure distillation). AGE with such a teacher: a group is valid when its combined advantage is not all zero
  (`combined_valid`).
* ``needs="logits"``, the supervised form: the teacher's whole distribution at each sampled position (a teacher
  loaded beside the student), read inside each micro-batch's loss, ``fn(student_logits [T, V], teacher_logits [T, V],
  *, beta) -> [T]`` with gradient to the student's logits; the trainer aggregates it as the policy loss and adds
  coef times it. `jsd`: GKD's generalized Jensen-Shannon divergence. Every group carries this signal.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from gpg_vl.config.names import TEACHER_LOSS_BUILTINS
from gpg_vl.errors import UserError
from gpg_vl.registry import Registry

TEACHER_NEEDS = ("logps", "logits")  # what a teacher loss may read of the teacher (the module doc)
TEACHER_LOSSES = Registry("teacher loss", "teacher.loss", builtins=TEACHER_LOSS_BUILTINS)
TeacherLoss = Callable[..., Tensor]


def register_teacher_loss(name: str, *, needs: str):
    """Register a teacher loss as ``teacher.loss=<name>``; `needs` ("logps" or "logits") says what it reads of the
    teacher and so which form it is (the module doc)."""
    if needs not in TEACHER_NEEDS:
        raise UserError(f"teacher loss {name!r} needs {needs!r}; a teacher loss needs one of: "
                        f"{', '.join(TEACHER_NEEDS)}.")
    return TEACHER_LOSSES.register(name, needs=needs)


def get_teacher_loss(name: str) -> TeacherLoss:
    """The teacher loss registered as `name`, or loaded from `module:fn` / `file.py:fn` (which declares its
    `needs` with `register_teacher_loss`)."""
    loss = TEACHER_LOSSES.get(name)
    if getattr(loss, "needs", None) not in TEACHER_NEEDS:
        raise UserError(f"teacher.loss={name} declares no needs; register it with @register_teacher_loss(name, "
                        f"needs=...) (one of {', '.join(TEACHER_NEEDS)}).")
    return loss


def teacher_loss_needs(name: str) -> str:
    """What teacher.loss=`name` reads of the teacher: "logps" or "logits"."""
    return get_teacher_loss(name).needs


@register_teacher_loss("reverse_kl", needs="logps")
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


@register_teacher_loss("jsd", needs="logits")
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
