"""The teacher of on-policy distillation (`teacher.*`, docs/distillation.md): loaded frozen beside the student,
it scores the student's own samples through the update's one scoring path (each prompt once per group, images and
video included, a multi-turn trajectory's observations in its forward, its generated tokens only counted).

The policy-gradient form (`teacher.loss=reverse_kl`) turns the teacher's log-probs into per-token advantages before
the update's optimizer steps (`with_teacher`: one teacher forward and one student forward without gradient per
micro-batch); the supervised form (`teacher.loss=jsd`) reads the teacher's full-vocabulary logits inside each
micro-batch's loss (`teacher_logits`). The maths is in gpg_vl/distill.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpg_vl.config.schema import TeacherSettings
from gpg_vl.distill import combined_valid, generalized_jsd, logits_entropy, teacher_advantages, teacher_kl
from gpg_vl.errors import UserError
from gpg_vl.models import scoring
from gpg_vl.models.batch import unwrap
from gpg_vl.models.logits import output_logits
from gpg_vl.models.scoring import ScoringPath
from gpg_vl.objective import loss_alpha
from gpg_vl.rollout.engine import EngineUnreachable


@dataclass
class Teacher:
    """The frozen teacher model (no gradient, no optimizer state), its scoring path, and `teacher.*`."""

    model: torch.nn.Module
    path: ScoringPath
    settings: TeacherSettings

    def logps(self, family, chunk, device, *, temperature: float, logits_chunk_tokens: int, messages=None,
              cache=None) -> torch.Tensor:
        """The teacher's log-probs [n, C] of a micro-batch's completions (no gradient). `messages`, `cache`: what the
        teacher on vLLM servers reads (gpg_vl/train/teacher_server.py); the model here has the prompts' pixels."""
        del messages, cache
        with torch.no_grad():
            return chunk.logps(_Frozen(family), self.model, device, path=self.path, temperature=temperature,
                               logits_chunk_tokens=logits_chunk_tokens)

    def bind(self, policy) -> Teacher:
        """Nothing to learn from the student's policy (the teacher on vLLM servers reads its family here)."""
        del policy
        return self

    def logits(self, family, chunk, device, *, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        """The teacher's full-vocabulary logits [T, V'] at the micro-batch's counted positions, and the sampled
        tokens' columns [T] (no gradient)."""
        with torch.no_grad():
            return chunk_logits(family, self.model, chunk, device, path=self.path, temperature=temperature)


@dataclass
class _Frozen:
    """What MicroBatch.logps reads of a policy (its family), for a model that is not the policy."""

    family: object


def chunk_logits(family, model, chunk, device, *, path: ScoringPath,
                 temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(full-vocabulary logits [T, V'] (float32, divided by `temperature`, softcapped as sampled) of `model` at the
    T counted positions of micro-batch `chunk`, row-major, the suppressed ids left out (V' = V minus them); the
    sampled tokens' columns [T] in them): what a loss over the whole distribution (GKD's JSD) reads. One forward
    on `path` (gpg_vl/models/scoring.py's `completion_states`), with gradient where it is enabled."""
    counted, ids = chunk.counted.to(device), chunk.completion_ids.to(device)
    hidden, logits = scoring.completion_states(family, model, chunk.prompts.to(device), chunk.prompt_index, ids,
                                               counted, path=path, observations=chunk.trajectories)
    bare = unwrap(model)
    if hidden is not None:
        logits = output_logits(hidden[counted], bare.get_output_embeddings().weight, None, temperature,
                                       family.logit_softcap(bare))  # [T, V]
    else:
        logits = logits[counted] / temperature  # [T, V]
    targets = ids[counted]  # [T]
    if family.suppressed_ids:
        kept = torch.ones(logits.shape[-1], dtype=torch.bool, device=logits.device)
        kept[torch.tensor(family.suppressed_ids, device=logits.device)] = False
        logits, targets = logits[:, kept], (kept.long().cumsum(0) - 1)[targets]  # a sampled id is never suppressed
    return logits, targets


def check_teacher(teacher: TeacherSettings, student_name: str, *, lora: bool = False) -> None:
    """Refuse, in one sentence and before any model loads, a teacher whose tokenizer differs from the student's
    (its log-probs would score other tokens)."""
    if teacher.model is None:
        return
    from transformers import AutoConfig, AutoTokenizer

    from gpg_vl.models.load import resolve_path

    paths = {"model.name_or_path": resolve_path(str(student_name)), "teacher.model": resolve_path(str(teacher.model))}
    _refuse_adapter(teacher.model, paths["teacher.model"])
    vocabularies, sizes = {}, {}
    for key, path in paths.items():
        try:
            vocabularies[key] = AutoTokenizer.from_pretrained(path).get_vocab()
            config = AutoConfig.from_pretrained(path)
        except (OSError, ValueError) as error:
            raise UserError(f"{key}={path} has no tokenizer or config that loads ({type(error).__name__}); "
                            "name a model folder or hub id.") from None
        text = getattr(config, "text_config", None) or config
        sizes[key] = getattr(text, "vocab_size", None)
    if vocabularies["teacher.model"] != vocabularies["model.name_or_path"] or \
            sizes["teacher.model"] != sizes["model.name_or_path"]:
        raise UserError(f"teacher.model={teacher.model} has another tokenizer or vocabulary than the student "
                        f"({student_name}); on-policy distillation scores the student's tokens, so pick a teacher "
                        "of the same tokenizer (the same model family).")


def _refuse_adapter(given: str, path) -> None:
    """A folder holding a LoRA adapter and no model of its own (model.lora.save=adapter): one sentence naming it."""
    from pathlib import Path

    from gpg_vl.models.lora import adapter_base, adapter_folder

    folder = adapter_folder(path) if Path(str(path)).is_dir() else None
    if folder is not None and not (Path(str(path)) / "config.json").is_file():
        raise UserError(f"teacher.model={given} holds a LoRA adapter without its base model's weights "
                        f"(adapter_config.json, base {adapter_base(folder)}); a teacher is loaded whole: name a folder "
                        "saved with model.lora.save=merged (or the adapter merged into its base).")


def load_teacher(teacher: TeacherSettings, model_cfg, device, *, trainer) -> Teacher | None:
    """The frozen teacher (None without teacher.model): loaded like the student (`model.*`, its processor
    settings) from teacher.model in teacher.dtype, without LoRA, every parameter frozen, in eval mode; its
    scoring path chosen as the student's (prompt once per group where the model allows)."""
    if teacher.model is None:
        return None
    from omegaconf import OmegaConf

    from gpg_vl.train import build

    settings = OmegaConf.merge(model_cfg, {"name_or_path": teacher.model, "freeze_vision": False,
                                           "lora": {"r": 0},
                                           **({} if teacher.dtype == "auto" else {"dtype": teacher.dtype})})
    policy = build.build_policy(settings, device)
    return frozen_teacher(policy.model, policy.family, teacher, trainer)


def frozen_teacher(model: torch.nn.Module, family, teacher: TeacherSettings, trainer) -> Teacher:
    """`model` frozen as the teacher, with its scoring path."""
    model.requires_grad_(False)
    model.eval()
    path = scoring.choose_scoring_path(family, model, share_prompt=trainer.share_prompt,
                                       share_vision=trainer.share_vision, packing=trainer.packing)
    return Teacher(model, path, teacher)


def with_teacher(learner, plan: list[list], attempts: list, score_student) -> tuple[list[list], dict[str, float], int]:
    """The policy-gradient form: each micro-batch of `plan` (every sampled group's sequences) with per-token
    advantages [n, C] = its group advantage (0 with teacher.only) + teacher.coef * (log teacher - log student),
    the student scored without gradient (`score_student(plan)`: one [n, C] per micro-batch, collective where the
    model's forward is); the sequences of a group whose combined advantage is all zero marked `rejected`, so the
    loss's normalizer leaves them out (AGE). Returns (plan, metrics: teacher_kl, the token mean of log student -
    log teacher, this process's token count as teacher_tokens, valid groups of this process). Both log-probs are
    kept on each attempt's rollout (`Rollout.token_logps`) for the rollout log. The report also counts the groups
    whose combined advantage is NaN or infinite on a counted token (`nonfinite`: left out, as invalid)."""
    teacher, settings = learner.teacher, learner.settings
    device = learner.accelerator.device
    students = score_student(plan)
    rollouts = {id(a.prompts): a.rollout for a in attempts if a.rollout is not None}
    messages, cache = {id(a.prompts): a.messages for a in attempts if a.rollout is not None}, {}
    scored, kl_sum, tokens, groups = [], 0.0, 0, {}
    for chunks, logps in zip(plan, students, strict=True):
        scored.append([])
        for chunk, student in zip(chunks, logps, strict=True):
            nu = teacher.logps(learner.policy.family, chunk, device, temperature=learner.temperature,
                               logits_chunk_tokens=settings.logits_chunk_tokens, messages=messages[id(chunk.prompts)],
                               cache=cache).to(student.device)
            counted = chunk.counted.to(student.device)
            advantages = teacher_advantages(chunk.advantages.to(student.device), nu, student, counted,
                                            coef=teacher.settings.coef, only=teacher.settings.only,
                                            tolerance=teacher.settings.tolerance)  # [n, C]
            keep_token_logps(rollouts[id(chunk.prompts)], chunk, student, nu)
            total, count = teacher_kl(nu, student, counted)
            kl_sum, tokens = kl_sum + total, tokens + count
            for row, prompt in enumerate(chunk.prompt_index):  # a group's sequences may span micro-batches
                groups.setdefault((id(chunk.prompts), prompt), []).append((len(scored) - 1, len(scored[-1]), row))
            scored[-1].append((chunk._replace(advantages=advantages.cpu()), counted.cpu()))
    rejected, nonfinite = {}, 0
    for members in groups.values():
        width = max(scored[p][c][1].shape[1] for p, c, _ in members)
        adv = torch.stack([_padded(scored[p][c][0].advantages[r], width) for p, c, r in members])
        mask = torch.stack([_padded(scored[p][c][1][r], width) for p, c, r in members])
        keep = bool(combined_valid(adv, mask, len(members))[0])
        nonfinite += bool((mask.bool() & ~torch.isfinite(adv)).any())  # left out: counted and said (loop.py)
        for member in members:
            rejected[member] = not keep
    marked = []
    for part, chunks in enumerate(scored):
        marked.append([])
        for index, (chunk, _) in enumerate(chunks):
            flags = torch.tensor([rejected[(part, index, row)] for row in range(len(chunk.prompt_index))])
            earlier = chunk.rejected
            marked[-1].append(chunk._replace(rejected=flags if earlier is None else flags | earlier))
    valid = sum(not rejected[members[0]] for members in groups.values())
    return marked, {"teacher_kl_sum": kl_sum, "teacher_tokens": float(tokens), "nonfinite": float(nonfinite)}, valid


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


def jsd_teacher_valid(plan: list[list]) -> int:
    """The supervised form: every sampled group carries the teacher's signal (the JSD is zero only where the two
    distributions agree everywhere), so every group counts as valid."""
    return len({(id(c.prompts), p) for chunks in plan for c in chunks for p in c.prompt_index})


def require_teacher_settings(teacher: TeacherSettings, trainer) -> None:
    """Contradictions between teacher.* and the trainer, in one sentence, before anything loads."""
    if not teacher.enabled:
        return
    key = "teacher.model" if teacher.model is not None else "teacher.urls"
    if teacher.model is not None and teacher.urls is not None:
        raise UserError("teacher.model and teacher.urls both name a teacher; set one: teacher.model loads it beside "
                        "the student, teacher.urls asks vLLM servers that serve it.")
    if teacher.urls is not None and teacher.loss == "jsd":
        raise UserError("teacher.loss=jsd reads the teacher's whole distribution at every position, which "
                        "teacher.urls (the sampled tokens' log-probs from vLLM) does not give; use teacher.model for "
                        "jsd, or teacher.loss=reverse_kl with teacher.urls.")
    if getattr(trainer, "max_staleness", 0) > 0:
        raise UserError(f"{key} with trainer.max_staleness >= 1 is not supported: the teacher's advantages "
                        "are computed in the update from the current weights; set trainer.max_staleness=0.")




def teach(learner, plan: list[list], attempts: list, score_plan) -> tuple[list[list], dict]:
    """The teacher's part before the update's optimizer steps: with teacher.loss=reverse_kl the plan's per-token
    advantages, the groups whose combined advantage is all zero marked rejected (`with_teacher`; the student scored
    by `score_plan(learner, model, plan, attempts, calls)`, train/update.py's); with jsd the plan as it is (every
    group carries the JSD). Returns (plan, {valid groups and sampled groups over all processes; reverse_kl also
    teacher_kl (the token mean of log student - log teacher) and the groups whose advantages were NaN or infinite
    (nonfinite); jsd has no teacher_kl: its loss logs teacher_jsd}). Collective: a teacher server unreachable from
    any process raises EngineUnreachable on every one."""
    accelerator = learner.accelerator
    sampled = sum(len(a.valid) for a in attempts)
    lost = None  # the teacher's server could not be reached from this process (teacher.urls): its sentence
    jsd = learner.teacher.settings.loss == "jsd"
    if jsd:  # the loss logs its own figure, teacher_jsd
        valid, report = jsd_teacher_valid(plan), {"teacher_kl_sum": 0.0, "teacher_tokens": 0.0}
    else:
        calls = accelerator.gather(torch.tensor([[len(chunks) for chunks in plan]], device=accelerator.device))
        try:  # the student's collective scoring comes first; the teacher's requests are this process's own
            plan, report, valid = with_teacher(learner, plan, attempts, lambda scored: score_plan(
                learner, learner.model, scored, attempts, calls.max(dim=0).values.tolist()))
        except EngineUnreachable as error:
            report, valid, lost = {"teacher_kl_sum": 0.0, "teacher_tokens": 0.0}, 0, str(error)
    totals = accelerator.reduce(torch.tensor([valid, sampled, report["teacher_kl_sum"], report["teacher_tokens"],
                                              float(lost is not None), report.get("nonfinite", 0.0)],
                                             device=accelerator.device, dtype=torch.float64), "sum").tolist()
    if totals[4]:  # every process stops at this step (gpg_vl/train/loop.py checkpoints the step before)
        raise EngineUnreachable(lost or "another training process could not reach the teacher's vLLM server (its "
                                "log names the server); check the servers, then continue with resume=auto.")
    if jsd:
        return plan, {"valid": int(totals[0]), "groups": int(totals[1])}
    return plan, {"valid": int(totals[0]), "groups": int(totals[1]), "teacher_kl": totals[2] / max(totals[3], 1.0),
                  "nonfinite": int(totals[5])}


def taught_metrics(taught: dict | None, settings) -> dict[str, float]:
    """With a teacher: every sampled group forwarded, the valid ones those whose combined advantage is not all zero
    (groups_used, AGE's alpha), and with reverse_kl teacher_kl and teacher_nonfinite_groups (and `nonfinite` when
    they left no valid group); nothing without one."""
    if taught is None:
        return {}
    found = {"groups_used": taught["valid"], "alpha": loss_alpha(settings.age, taught["groups"], taught["valid"])}
    if "teacher_kl" in taught:  # reverse_kl: the sampled KL, and the groups whose advantages were not finite
        found.update({"teacher_kl": taught["teacher_kl"], "teacher_nonfinite_groups": taught["nonfinite"]})
        if taught["nonfinite"] and not taught["valid"]:  # no group left by numbers that are not finite: a bad step
            found["nonfinite"] = 1.0  # (loop.py counts it in nonfinite_steps)
    return found


def scored_chunk(learner, chunk, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A micro-batch in the update: (log-probs [n, C] with gradient, entropies [n, C] without, from the same
    logits: no extra forward; with teacher.loss=jsd, the per-token generalized JSD [n, C] to the teacher on the
    counted tokens (GKD), else None)."""
    teacher = learner.teacher
    if teacher is None or teacher.settings.loss != "jsd":
        return (*chunk.logps(learner.policy, learner.model, device, temperature=learner.temperature,
                             path=learner.path, logits_chunk_tokens=learner.settings.logits_chunk_tokens,
                             entropy=True), None)
    family = learner.policy.family
    rows = chunk.counted.to(device).nonzero(as_tuple=True)
    logits, targets = chunk_logits(family, learner.model, chunk, device, path=learner.path,
                                   temperature=learner.temperature)  # [T, V'], [T]
    teacher_logits, _ = teacher.logits(family, chunk, device, temperature=learner.temperature)  # [T, V']
    zeros = torch.zeros(chunk.completion_ids.shape, dtype=torch.float32, device=device)  # [n, C]
    picked = torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None]).squeeze(-1)  # [T]
    jsd = generalized_jsd(logits, teacher_logits, beta=teacher.settings.beta)  # [T]
    return (zeros.index_put(rows, picked), zeros.index_put(rows, logits_entropy(logits.detach())),
            zeros.index_put(rows, jsd))
