"""The policy's log-probs before an update (pi_prox), each micro-batch's computed once, however many read them: the
"old" log-probs of a loss with several optimizer steps (the GRPO family's ppo_epochs, ppo_mini_batch), the student's
log-probs that a teacher's advantages read (a teacher loss that needs "logps"), and the off-policy correction's.

- Where the correction needs them for every micro-batch before the first optimizer step (one that rejects, or
  weighs several steps), one forward without gradient scores them all, and the ratio and the teacher read those.
- Otherwise the first optimizer step's own forward computes them anyway: the micro-batches of the first mini-batch
  take them there (`FirstForward`: the same forward of the same weights, whose log-probs a forward without gradient
  gives bit for bit), and only the later mini-batches' are scored before it, one forward without gradient each
  (`score_wanted`). A micro-batch whose forward is another computation (a teacher loss that reads the whole
  distribution: its log-probs come from full logits) is scored before it too.

The off-policy correction's weights come from pi_prox against the behaviour log-probs (`correct_up_front`: before the
first step where they must be known before it, else from its forward: `chunk_weights`).

A teacher's advantages decide which groups its update keeps (a group whose combined advantage is all zero is left
out of AGE's normalizer). With the first mini-batch's taken from its own forward, its loss is normalized as if every
group were kept; should one be left out, the step's gradient is dropped and the step runs again with the right
normalizer (`FirstForward.redo`): one more forward and backward, only then (a teacher equal to the student; an
all-empty group).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from gpg_vl.distributed import forward_is_collective
from gpg_vl.errors import UserError
from gpg_vl.objective.corrections import ActiveCorrection, CorrectionSums, apply_correction
from gpg_vl.objective.options import takes_weights
from gpg_vl.train.step.micro_batch import MicroBatch
from gpg_vl.train.step.placeholder import placeholder_chunk


@torch.no_grad()
def score_plan(learner, model, plan: list[list[MicroBatch]], attempts: list, calls: list[int]) -> list[list]:
    """Log-probs [n, C] of every micro-batch of every mini-batch, without gradient (pi_prox or the reference's), with
    `model` (the learner's, or the reference's). Where `model`'s forward is collective (FSDP / ZeRO-3), mini-batch
    p runs `calls[p]` forwards on every process (the most micro-batches any process has), the missing ones on
    placeholders, dropped here."""
    policy, settings = learner.policy, learner.settings
    device = next(model.parameters()).device

    def score(c: MicroBatch) -> torch.Tensor:
        return c.logps(policy, model, device, temperature=learner.temperature, path=learner.path,
                       logits_chunk_tokens=settings.logits_chunk_tokens)

    collective = forward_is_collective(model)
    scored = []
    for chunks, needed in zip(plan, calls, strict=True):
        scored.append([score(c) for c in chunks])
        for _ in range(needed - len(chunks) if collective else 0):
            score(MicroBatch(*placeholder_chunk(policy, attempts, device)))
    return scored


def score_wanted(learner, plan: list[list[MicroBatch]], attempts: list,
                 wanted: list[list[bool]]) -> list[list[torch.Tensor | None]]:
    """pi_prox's log-probs [n, C] of the `wanted` micro-batches (None for the others), one forward without gradient
    each, before the update's first step. Collective: per mini-batch every process scores the most wanted
    micro-batches any process has (placeholders dropped)."""
    accelerator = learner.accelerator
    picked = [[c for c, want in zip(chunks, flags, strict=True) if want] for chunks, flags in zip(plan, wanted,
                                                                                                  strict=True)]
    calls = accelerator.gather(torch.tensor([[len(chunks) for chunks in picked]], device=accelerator.device))
    scored = iter([iter(part) for part in score_plan(learner, learner.model, picked, attempts,
                                                     calls.max(dim=0).values.tolist())])
    found = []
    for flags in wanted:
        part = next(scored)
        found.append([next(part) if want else None for want in flags])
    return found


@dataclass
class FirstForward:
    """The first optimizer step's micro-batches whose pi_prox log-probs its own forward gives (`deferred`: indices in
    its micro-batches): recorded as the forward computes them (`take`), they are the loss's old log-probs there and in
    the later steps (`old`, with `wants_old`), and a teacher's advantages read them (`shaping`: the micro-batch with
    its advantages, from train/teacher/signal.py)."""

    deferred: set[int]
    wants_old: bool
    shaping: object = None  # the teacher's Shaping, or None
    logps: dict[int, torch.Tensor] = field(default_factory=dict)  # index -> pi_prox's log-probs [n, C], detached
    taken: dict[int, MicroBatch] = field(default_factory=dict)  # index -> the micro-batch as its step trained on it
    marked: list[MicroBatch] | None = None  # its micro-batches, the groups a teacher leaves out marked (`redo`)

    def take(self, index: int, chunk: MicroBatch, logps: torch.Tensor) -> MicroBatch:
        """Micro-batch `index` as the step trains on it, its forward's log-probs [n, C] recorded (detached): with a
        teacher that reads them, with its per-token advantages."""
        if index not in self.deferred:
            return chunk
        self.logps[index] = logps.detach()
        if self.shaping is not None and self.shaping.reads(chunk):
            chunk = self.shaping.shape(chunk, self.logps[index])
        self.taken[index] = chunk
        return chunk

    def old(self, index: int) -> torch.Tensor | None:
        """Micro-batch `index`'s old log-probs [n, C] (pi_prox's), where this forward gives them."""
        return self.logps.get(index) if self.wants_old else None

    def resolved(self, chunks: list[MicroBatch]) -> list[MicroBatch]:
        """The step's micro-batches as they were trained on (a teacher's advantages in them)."""
        return [self.taken.get(index, chunk) for index, chunk in enumerate(chunks)]

    def redo(self, accelerator, chunks: list[MicroBatch]) -> bool:
        """After the step's backward, before its optimizer step: with a teacher, the groups of the step whose combined
        advantage is all zero marked rejected (`marked`: the step's micro-batches so marked); whether any process
        rejected one (the step then runs again, its normalizer leaving them out). Collective with a teacher."""
        if self.shaping is None:
            return False
        self.marked, rejected = self.shaping.reject(self.resolved(chunks))
        return bool(int(accelerator.reduce(torch.tensor(rejected, device=accelerator.device), "sum")))


def wanted_before(plan: list[list[MicroBatch]], *, old: bool, reads: Callable[[MicroBatch], bool]) -> list[list[bool]]:
    """Which micro-batches need pi_prox's log-probs: every one for the ratio's old log-probs (`old`), and those a
    teacher reads them for (`reads`)."""
    return [[old or reads(chunk) for chunk in chunks] for chunks in plan]


def before_update(learner, plan: list[list[MicroBatch]], attempts: list, loss, shaping, *, steps: int,
                  prox: list[list[torch.Tensor]] | None):
    """(the plan, the old log-probs per mini-batch and micro-batch or None, the first step's FirstForward or None):
    pi_prox's log-probs of the micro-batches that need them (the ratio's old log-probs with several steps, a
    teacher's that reads them: `shaping`), each computed once: `prox` where the correction scored them all; else the
    first step's forward for its micro-batches whose forward is the plain one (`Learner.share_first_forward`; a
    teacher's only where the step can still be dropped after its backward: not under DeepSpeed, which steps inside
    it), one forward without gradient before it for the others. The micro-batches of a teacher that reads log-probs
    get its advantages here where pi_prox's are known, the first step's in it. Collective where any micro-batch of
    any process may need them (the settings decide: the same on every process)."""
    wants_old = "old" in loss.needs and steps > 1
    if not (wants_old or shaping is not None):
        return plan, None, None
    reads = shaping.reads if shaping is not None else (lambda _: False)
    wanted = wanted_before(plan, old=wants_old, reads=reads)
    deferring = prox is None and learner.share_first_forward
    shapes_first = deferring and shaping is not None and not _steps_in_backward(learner.accelerator)
    deferred = {index for index, chunk in enumerate(plan[0]) if wanted[0][index] and not reads_logits(learner, chunk)
                and (shapes_first or not reads(chunk))} if deferring else set()
    needed = [[want and not (part == 0 and index in deferred) for index, want in enumerate(flags)]
              for part, flags in enumerate(wanted)]
    before = prox if prox is not None else score_wanted(learner, plan, attempts, needed)
    if shaping is not None:  # the advantages of the micro-batches whose pi_prox is known, and their groups' validity
        plan = [[shaping.shape(c, before[p][i]) if reads(c) and before[p][i] is not None else c
                 for i, c in enumerate(chunks)] for p, chunks in enumerate(plan)]
        plan = [chunks if p == 0 and shapes_first else shaping.reject(chunks)[0] for p, chunks in enumerate(plan)]
    first = FirstForward(deferred, wants_old, shaping if shapes_first else None) if deferring else None
    return plan, before if wants_old else None, first


def _steps_in_backward(accelerator) -> bool:
    """Whether the optimizer steps inside the last backward (DeepSpeed's engine), so a step cannot be dropped after
    it."""
    from accelerate.utils import DistributedType

    return accelerator.distributed_type == DistributedType.DEEPSPEED


def reads_logits(learner, chunk: MicroBatch) -> bool:
    """Whether `chunk`'s forward in the update is a teacher loss's over full logits (another computation than the
    plain forward's log-probs)."""
    return learner.teacher is not None and learner.teacher.needs(chunk.task) == "logits"


def correct_up_front(learner, correction: ActiveCorrection, loss_fn, plan: list[list[MicroBatch]],
                      attempts: list, sums: CorrectionSums, *, steps: int):
    """(the plan, the valid groups all rejected or None, pi_prox's log-probs or None): pi_prox is scored once before
    the first step where the correction's weights must be known before it (a correction that rejects: the
    normalizer leaves its sequences out) or serve several steps (`resolve_corrections`); otherwise the one step's
    forward has it. A loss that takes no weights is refused in one sentence."""
    if correction.weighs and not takes_weights(loss_fn):
        raise UserError(f"trainer.correction={correction.name} weighs each token's loss, and trainer.loss="
                        f"{learner.settings.loss} takes no `weights`; give it a `weights=None` argument (its "
                        "per-token loss times them) or set trainer.correction=none.")
    if not (correction.weighs and (correction.rejects or steps > 1)):
        return plan, None, None
    prox = score_wanted(learner, plan, attempts, [[True] * len(chunks) for chunks in plan])
    plan, groups_rejected = resolve_corrections(correction, plan, prox, sums, learner.accelerator)
    return plan, groups_rejected, prox


def resolve_corrections(correction: ActiveCorrection, plan: list[list[MicroBatch]], prox: list[list[torch.Tensor]],
                         sums: CorrectionSums, accelerator) -> tuple[list[list[MicroBatch]], int | None]:
    """The plan with each micro-batch's correction resolved from pi_prox (`prox`) against its behaviour log-probs:
    its `weights` and `rejected` sequences (so the normalizer leaves them out), the metrics added to `sums`; and,
    for a correction that rejects, the valid groups over all processes whose sequences were all rejected (they
    count in AGE's M; collective), else None."""
    marked, groups = [], {}  # (prompts, prompt index) -> [rejected, sequences]
    for chunks, logps in zip(plan, prox, strict=True):
        marked.append([])
        for chunk, current in zip(chunks, logps, strict=True):
            if chunk.sampler_logps is None:
                marked[-1].append(chunk)
                continue
            weights, rejected = chunk_weights(correction, chunk, current, chunk.sampler_logps.to(current.device),
                                               sums)
            for row, prompt in enumerate(chunk.prompt_index):
                count = groups.setdefault((id(chunk.prompts), prompt), [0, 0])
                count[0], count[1] = count[0] + int(rejected[row]), count[1] + 1
            marked[-1].append(chunk._replace(weights=weights, rejected=rejected.cpu()))
    if not correction.rejects:
        return marked, None
    all_rejected = sum(1 for rejected, total in groups.values() if rejected == total)
    return marked, int(accelerator.reduce(torch.tensor(all_rejected, device=accelerator.device), "sum"))


def chunk_weights(correction: ActiveCorrection, chunk: MicroBatch, prox: torch.Tensor, sampler: torch.Tensor,
                   sums: CorrectionSums) -> tuple[torch.Tensor, torch.Tensor]:
    """One micro-batch's correction weights [n, C] (detached, in `prox`'s dtype; 0 on rejected sequences, 1 off the
    counted tokens) and rejected sequences [n], from pi_prox's log-probs against the behaviour ones; its metrics
    added to `sums`."""
    mask = (chunk.completion_mask if chunk.loss_mask is None else chunk.loss_mask).to(prox.device)
    weights, rejected, capped = apply_correction(correction.name, correction.options, prox, sampler, mask,
                                                 chunk.advantages)
    sums.add(prox, sampler, mask, weights, rejected, capped)
    return weights.to(prox.dtype), rejected
