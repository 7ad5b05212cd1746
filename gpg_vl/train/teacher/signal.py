"""What the teacher gives the update, by what its loss reads of it (gpg_vl/objective/teacher_losses.py: `needs`):

- "logps", the policy-gradient form: before the optimizer steps, each micro-batch's per-token advantages from the
  teacher's log-probs of the sampled tokens against the student's (`teach`), the groups whose combined advantage is
  all zero marked rejected (AGE leaves them out);
- "logits", the supervised form: inside each micro-batch's loss, the teacher's whole distribution at each counted
  position against the student's (`distilled_scores`), coef x the loss added to the policy loss.

In a mixture each task has its own teacher (`Teachers.of(chunk.task)`), or none: a micro-batch of a task without one
trains as it would without a teacher.
"""

from __future__ import annotations

import torch

from gpg_vl.models.logits import logits_entropy
from gpg_vl.objective import loss_alpha
from gpg_vl.objective.teacher_losses import combined_valid, get_teacher_loss, teacher_kl
from gpg_vl.rollout.engine import EngineUnreachable
from gpg_vl.train.teacher.local import chunk_logits


def teach(learner, plan: list[list], attempts: list, score_plan) -> tuple[list[list], dict]:
    """The teachers' part before the update's optimizer steps: the plan's micro-batches whose task's teacher reads
    log-probs get per-token advantages, the groups whose combined advantage is all zero marked rejected (`shaped`; the
    student scored by `score_plan(learner, model, plan, attempts, calls)`, train/step/update.py's); the others stay as
    they are (every group of a teacher that reads logits carries its signal). Returns (plan, {valid groups and sampled
    groups over all processes; with a teacher that reads log-probs also teacher_kl (the token mean of log student - log
    teacher) and the groups whose advantages were NaN or infinite (nonfinite); a teacher that reads logits logs its
    own figure, teacher_jsd}). Collective: a teacher server unreachable from any process raises EngineUnreachable on
    every one."""
    accelerator, teachers = learner.accelerator, learner.teacher
    sampled = sum(len(a.valid) for a in attempts)
    lost = None  # a teacher's server could not be reached from this process (teacher.urls): its sentence
    report = {"teacher_kl_sum": 0.0, "teacher_tokens": 0.0, "rejected": 0, "nonfinite": 0}
    if teachers.any_needs("logps"):  # the same on every process (the settings): the collectives below match
        wanted = [[c for c in chunks if teachers.needs(c.task) == "logps"] for chunks in plan]
        calls = accelerator.gather(torch.tensor([[len(chunks) for chunks in wanted]], device=accelerator.device))
        try:  # the student's collective scoring comes first; the teachers' requests are this process's own
            students = score_plan(learner, learner.model, wanted, attempts, calls.max(dim=0).values.tolist())
            plan, report = shaped(learner, plan, attempts, {id(c): s for chunks, scored in zip(wanted, students,
                                                                                          strict=True)
                                                             for c, s in zip(chunks, scored, strict=True)})
        except EngineUnreachable as error:
            lost = str(error)
    # every group the plan forwards carries a teacher's signal (or, without a teacher, its task's), but those whose
    # combined advantage is all zero
    valid = len({(id(c.prompts), p) for chunks in plan for c in chunks for p in c.prompt_index}) - report["rejected"]
    totals = accelerator.reduce(torch.tensor([valid, sampled, report["teacher_kl_sum"], report["teacher_tokens"],
                                              float(lost is not None), report["nonfinite"]],
                                             device=accelerator.device, dtype=torch.float64), "sum").tolist()
    if totals[4]:  # every process stops at this step (gpg_vl/train/loop.py checkpoints the step before)
        raise EngineUnreachable(lost or "another training process could not reach the teacher's vLLM server (its "
                                "log names the server); check the servers, then continue with resume=auto.")
    taught = {"valid": int(totals[0]), "groups": int(totals[1])}
    if teachers.any_needs("logps"):  # the sampled KL, and the groups whose advantages were not finite
        taught.update({"teacher_kl": totals[2] / max(totals[3], 1.0), "nonfinite": int(totals[5])})
    return plan, taught


def shaped(learner, plan: list[list], attempts: list, students: dict) -> tuple[list[list], dict[str, float]]:
    """The policy-gradient form: each micro-batch of `plan` whose teacher reads log-probs with per-token advantages
    [n, C] from its teacher's loss (reverse_kl: its group advantage, 0 with teacher.only, + teacher.coef * (log
    teacher - log student)), the student's log-probs `students[id(chunk)]` [n, C]; the sequences of a group whose
    combined advantage is all zero marked `rejected`, so the loss's normalizer leaves them out (AGE). Returns (plan,
    {teacher_kl_sum: the summed log student - log teacher, teacher_tokens: this process's token count, rejected: the
    groups rejected, nonfinite: those whose combined advantage is NaN or infinite on a counted token}). Both
    log-probs are kept on each attempt's rollout (`Rollout.token_logps`) for the rollout log."""
    teachers, device = learner.teacher, learner.accelerator.device
    rollouts = {id(a.prompts): a.rollout for a in attempts if a.rollout is not None}
    messages, cache = {id(a.prompts): a.messages for a in attempts if a.rollout is not None}, {}
    kl_sum, tokens, groups, marked = 0.0, 0, {}, []
    for part, chunks in enumerate(plan):
        marked.append(list(chunks))
        for index, chunk in enumerate(chunks):
            if id(chunk) not in students:
                continue
            teacher, student = teachers.of(chunk.task), students[id(chunk)]
            nu = teacher.logps(learner.policy.family, chunk, device, temperature=learner.temperature,
                               logits_chunk_tokens=learner.settings.logits_chunk_tokens,
                               messages=messages[id(chunk.prompts)], cache=cache).to(student.device)
            counted = chunk.counted.to(student.device)
            advantages = get_teacher_loss(teacher.settings.loss)(
                chunk.advantages.to(student.device), nu, student, counted, coef=teacher.settings.coef,
                only=teacher.settings.only, tolerance=teacher.settings.tolerance)  # [n, C]
            keep_token_logps(rollouts[id(chunk.prompts)], chunk, student, nu)
            total, count = teacher_kl(nu, student, counted)
            kl_sum, tokens = kl_sum + total, tokens + count
            for row, prompt in enumerate(chunk.prompt_index):  # a group's sequences may span micro-batches
                groups.setdefault((id(chunk.prompts), prompt), []).append((part, index, row))
            marked[part][index] = (chunk._replace(advantages=advantages.cpu()), counted.cpu())
    rejected, nonfinite = {}, 0
    for members in groups.values():
        width = max(marked[p][c][1].shape[1] for p, c, _ in members)
        adv = torch.stack([_padded(marked[p][c][0].advantages[r], width) for p, c, r in members])
        mask = torch.stack([_padded(marked[p][c][1][r], width) for p, c, r in members])
        keep = bool(combined_valid(adv, mask, len(members))[0])
        nonfinite += bool((mask.bool() & ~torch.isfinite(adv)).any())  # left out: counted and said (loop.py)
        for member in members:
            rejected[member] = not keep
    for part, chunks in enumerate(marked):
        for index, entry in enumerate(chunks):
            if isinstance(entry, tuple):
                chunk = entry[0]
                flags = torch.tensor([rejected[(part, index, row)] for row in range(len(chunk.prompt_index))])
                earlier = chunk.rejected
                chunks[index] = chunk._replace(rejected=flags if earlier is None else flags | earlier)
    return marked, {"teacher_kl_sum": kl_sum, "teacher_tokens": float(tokens),
                    "rejected": sum(rejected[members[0]] for members in groups.values()), "nonfinite": nonfinite}


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
