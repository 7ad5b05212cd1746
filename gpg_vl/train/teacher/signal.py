"""What the teacher gives the update, by what its loss reads of it (gpg_vl/objective/teacher_losses.py: `needs`):

- "logps", the policy-gradient form: each micro-batch's per-token advantages from the teacher's log-probs of the
  sampled tokens against the student's before the update (`Shaping.shape`; the student's are pi_prox's, computed
  once: gpg_vl/train/step/before.py), the groups whose combined advantage is all zero marked rejected
  (`Shaping.reject`: AGE leaves them out);
- "logits", the supervised form: inside each micro-batch's loss, the teacher's whole distribution at each counted
  position against the student's (`distilled_scores`), coef x the loss added to the policy loss.

In a mixture each task has its own teacher (`Teachers.of(chunk.task)`), or none: a micro-batch of a task without one
trains as it would without a teacher.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpg_vl.models.logits import logits_entropy
from gpg_vl.objective import loss_alpha
from gpg_vl.objective.teacher_losses import combined_valid, get_teacher_loss, teacher_kl
from gpg_vl.rollout.engine import EngineUnreachable
from gpg_vl.train.teacher.local import chunk_logits


@dataclass
class Shaping:
    """The policy-gradient form's part of one update: the teachers' log-probs [n, C] of each micro-batch whose
    teacher reads them (`nus`, by id), and the sums teacher_kl and AGE's count read (`kl_sum`, `tokens`, `rejected`
    groups). Both log-probs are kept on each attempt's rollout (`Rollout.token_logps`) for the rollout log."""

    learner: object
    nus: dict  # `key(chunk)` -> the teacher's log-probs [n, C]
    rollouts: dict  # id(prompts) -> the attempt's rollout
    kl_sum: float = 0.0
    tokens: int = 0
    rejected: int = 0
    nonfinite: int = 0  # groups whose combined advantage is NaN or infinite on a counted token (left out, and said)

    def reads(self, chunk) -> bool:
        """Whether `chunk`'s teacher reads the student's log-probs (its advantages come from them)."""
        return key(chunk) in self.nus

    def shape(self, chunk, student: torch.Tensor):
        """`chunk` with its teacher loss's per-token advantages [n, C] (reverse_kl: its group advantage, 0 with
        teacher.only, + teacher.coef * (log teacher - log student)), the student's log-probs `student` [n, C]."""
        teacher, nu = self.learner.teacher.of(chunk.task), self.nus[key(chunk)].to(student.device)
        counted = chunk.counted.to(student.device)
        advantages = get_teacher_loss(teacher.settings.loss)(
            chunk.advantages.to(student.device), nu, student, counted, coef=teacher.settings.coef,
            only=teacher.settings.only, tolerance=teacher.settings.tolerance)  # [n, C]
        keep_token_logps(self.rollouts[id(chunk.prompts)], chunk, student, nu)
        total, count = teacher_kl(nu, student, counted)
        self.kl_sum, self.tokens = self.kl_sum + total, self.tokens + count
        return chunk._replace(advantages=advantages.cpu())

    def reject(self, chunks: list) -> tuple[list, int]:
        """One mini-batch's micro-batches (`chunks`, those a teacher shaped with their advantages) with the sequences
        of each group whose combined advantage is all zero (or not finite) marked `rejected`, and the number of such
        groups (added to `rejected`)."""
        groups = {}
        for index, chunk in enumerate(chunks):
            if self.reads(chunk):
                for row, prompt in enumerate(chunk.prompt_index):  # a group's sequences may span micro-batches
                    groups.setdefault((id(chunk.prompts), prompt), []).append((index, row))
        rejected = {}
        for members in groups.values():
            width = max(chunks[c].completion_mask.shape[1] for c, _ in members)
            adv = torch.stack([_padded(chunks[c].advantages[r], width) for c, r in members])
            mask = torch.stack([_padded(chunks[c].counted[r], width) for c, r in members])
            keep = bool(combined_valid(adv, mask, len(members))[0])
            self.nonfinite += bool((mask.bool() & ~torch.isfinite(adv)).any())  # left out: counted and said (loop.py)
            rejected.update({member: not keep for member in members})
        marked = []
        for index, chunk in enumerate(chunks):
            if self.reads(chunk):
                flags = torch.tensor([rejected[(index, row)] for row in range(len(chunk.prompt_index))])
                chunk = chunk._replace(rejected=flags if chunk.rejected is None else flags | chunk.rejected)
            marked.append(chunk)
        count = sum(rejected[members[0]] for members in groups.values())
        self.rejected += count
        return marked, count


def key(chunk) -> tuple:
    """A micro-batch's sequences, as they stay when it is replaced (its advantages, its rejected flags): its attempt's
    prompts and its rows in that attempt's rollout."""
    return id(chunk.prompts), tuple(chunk.rows)


def teacher_shaping(learner, plan: list[list], attempts: list) -> Shaping:
    """The teachers' log-probs of every micro-batch of `plan` whose teacher reads log-probs (the teachers' forwards,
    or their servers' answers), before any student forward. Collective: a teacher server unreachable from any
    process raises EngineUnreachable on every one (gpg_vl/train/loop.py then checkpoints the step before)."""
    accelerator, teachers, device = learner.accelerator, learner.teacher, learner.accelerator.device
    rollouts = {id(a.prompts): a.rollout for a in attempts if a.rollout is not None}
    messages, cache = {id(a.prompts): a.messages for a in attempts if a.rollout is not None}, {}
    nus, lost = {}, None
    try:  # this process's own requests (a server teacher); a local teacher's forward is not collective
        for chunk in (c for chunks in plan for c in chunks if teachers.needs(c.task) == "logps"):
            nus[key(chunk)] = teachers.of(chunk.task).logps(
                learner.policy.family, chunk, device, temperature=learner.temperature,
                logits_chunk_tokens=learner.settings.logits_chunk_tokens, messages=messages[id(chunk.prompts)],
                cache=cache)
    except EngineUnreachable as error:
        lost = str(error)
    if accelerator.reduce(torch.tensor(float(lost is not None), device=device), "sum"):  # every process stops
        raise EngineUnreachable(lost or "another training process could not reach the teacher's vLLM server (its "
                                "log names the server); check the servers, then continue with resume=auto.")
    return Shaping(learner, nus, rollouts)


def taught(shaping: Shaping, plan: list[list], attempts: list, accelerator) -> dict:
    """The update's teacher figures over all processes: the valid groups (every group the plan forwards carries a
    teacher's signal, or without a teacher its task's, but those whose combined advantage is all zero), the sampled
    groups; with a teacher that reads log-probs also teacher_kl (the token mean of log student - log teacher) and the
    groups whose advantages were NaN or infinite (nonfinite); a teacher that reads logits logs its own figure,
    teacher_jsd. Collective."""
    groups = len({(id(c.prompts), p) for chunks in plan for c in chunks for p in c.prompt_index})
    sampled = sum(len(a.valid) for a in attempts)
    totals = accelerator.reduce(torch.tensor([groups - shaping.rejected, sampled, shaping.kl_sum,
                                              float(shaping.tokens), float(shaping.nonfinite)],
                                             device=accelerator.device, dtype=torch.float64), "sum").tolist()
    found = {"valid": int(totals[0]), "groups": int(totals[1])}
    if shaping.learner.teacher.any_needs("logps"):  # the sampled KL, and the groups whose advantages were not finite
        found.update({"teacher_kl": totals[2] / max(totals[3], 1.0), "nonfinite": int(totals[4])})
    return found


def keep_token_logps(rollout, chunk, student: torch.Tensor, teacher: torch.Tensor) -> None:
    """Write a micro-batch's student and teacher log-probs [n, c] into its rollout's `token_logps` [B * G, C]."""
    if rollout.token_logps is None:
        rollout.token_logps = {key: torch.zeros(rollout.completion_ids.shape) for key in ("student", "teacher")}
    width = student.shape[1]
    for key, values in (("student", student), ("teacher", teacher)):
        rollout.token_logps[key][chunk.rows, :width] = values.detach().float().cpu()


def _padded(row: torch.Tensor, width: int) -> torch.Tensor:
    """A micro-batch row [c] padded with zeros to `width` (sequences of one group may sit in micro-batches of
    different widths)."""
    return torch.nn.functional.pad(row, (0, width - row.shape[0]))


def taught_metrics(taught: dict | None, settings) -> dict[str, float]:
    """With a teacher: every sampled group forwarded, the valid ones those whose combined advantage is not all zero
    (groups_used, AGE's alpha), and with a teacher that reads log-probs teacher_kl and teacher_nonfinite_groups (and
    `nonfinite` when they left no valid group); nothing without one."""
    if taught is None:
        return {}
    found = {"groups_used": taught["valid"], "alpha": loss_alpha(settings.age, taught["groups"], taught["valid"])}
    if "teacher_kl" in taught:  # the sampled KL, and the groups whose advantages were not finite
        found.update({"teacher_kl": taught["teacher_kl"], "teacher_nonfinite_groups": taught["nonfinite"]})
        if taught["nonfinite"] and not taught["valid"]:  # no group left by numbers that are not finite: a bad step
            found["nonfinite"] = 1.0  # (loop.py counts it in nonfinite_steps)
    return found


def distilled_scores(learner, teacher, chunk, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The supervised form, a micro-batch in the update: (log-probs [n, C] with gradient, entropies [n, C] without,
    its teacher loss [n, C] on the counted tokens: the loss of the student's logits against the teacher's, GKD's
    generalized JSD for jsd), from one student forward and one teacher forward."""
    family = learner.policy.family
    rows = chunk.counted.to(device).nonzero(as_tuple=True)
    logits, targets = chunk_logits(family, learner.model, chunk, device, path=learner.path,
                                   temperature=learner.temperature)  # [T, V'], [T]
    teacher_logits, _ = teacher.logits(family, chunk, device, temperature=learner.temperature)  # [T, V']
    zeros = torch.zeros(chunk.completion_ids.shape, dtype=torch.float32, device=device)  # [n, C]
    picked = torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None]).squeeze(-1)  # [T]
    loss = get_teacher_loss(teacher.settings.loss)(logits, teacher_logits, beta=teacher.settings.beta)  # [T]
    return (zeros.index_put(rows, picked), zeros.index_put(rows, logits_entropy(logits.detach())),
            zeros.index_put(rows, loss))
