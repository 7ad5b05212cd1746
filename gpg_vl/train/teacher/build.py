"""One door for the teacher (`teacher.*`, docs/distillation.md): `build_teacher` turns a task's teacher settings into
the teacher the update asks, a model loaded beside the student (`teacher.model`: local.py) or vLLM servers that serve
it (`teacher.urls`: server.py), after the checks that need no model; `build_teachers` gives each task of a run its
own (`Teachers`): the run's `teacher.*`, and in a mixture each task's `task.teacher.<entry>.*` over them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, replace

import torch

from gpg_vl.config.schema import TeacherSettings
from gpg_vl.errors import UserError
from gpg_vl.objective.teacher_losses import teacher_loss_needs
from gpg_vl.train.teacher.local import Teacher, check_tokenizer, frozen_teacher
from gpg_vl.train.teacher.server import ServerTeacher, connect_teacher, student_tokenizer

TEACHER_KEYS = tuple(item.name for item in fields(TeacherSettings))  # what task.teacher.<entry> may set


@dataclass
class Student:
    """What a teacher is checked against and loaded like: the student's folder or hub id (`name_or_path`, read before
    it loads) or its loaded `tokenizer` and `vocab_size`; `load(name_or_path, dtype)` loads a model as the student's
    `model.*` load it (None: a teacher model must be given)."""

    name_or_path: str | None = None
    tokenizer: object = None
    vocab_size: int | None = None
    load: Callable | None = None


def require_teacher_settings(teacher: TeacherSettings, trainer, key: str = "teacher") -> None:
    """Contradictions between a teacher's settings (`key`.*: teacher, or task.teacher.<entry>) and the trainer, in
    one sentence, before anything loads."""
    if not teacher.enabled:
        return
    if teacher.model is not None and teacher.urls is not None:
        raise UserError(f"{key}.model and {key}.urls both name a teacher; set one: {key}.model loads it beside the "
                        f"student, {key}.urls asks vLLM servers that serve it.")
    if teacher.urls is not None and teacher_loss_needs(teacher.loss) == "logits":
        raise UserError(f"{key}.loss={teacher.loss} reads the teacher's whole distribution at every position, which "
                        f"{key}.urls (the sampled tokens' log-probs from vLLM) does not give; use {key}.model for "
                        f"{teacher.loss}, or {key}.loss=reverse_kl with {key}.urls.")
    if getattr(trainer, "max_staleness", 0) > 0:
        chosen = f"{key}.model" if teacher.model is not None else f"{key}.urls"
        raise UserError(f"{chosen} with trainer.max_staleness >= 1 is not supported: the teacher's advantages "
                        "are computed in the update from the current weights; set trainer.max_staleness=0.")


def build_teacher(settings: TeacherSettings, student: Student, *, trainer, rollout, device, rank: int = 0,
                  model: torch.nn.Module | None = None, family=None) -> Teacher | ServerTeacher | None:
    """The teacher `settings` name (None without one): `teacher.model` checked against the student's tokenizer, then
    `model` (one the caller loaded, of the student's `family`) or `student.load`'s, frozen; `teacher.urls` connected
    and checked (connect_teacher). A server teacher reads the student's family once it is built (`bind`)."""
    if settings.model is not None:
        if model is None:
            if student.name_or_path is not None:
                check_tokenizer(settings, student.name_or_path)  # before the teacher loads
            policy = student.load(settings.model, settings.dtype)
            model, family = policy.model, policy.family
        return frozen_teacher(model.to(device), family, settings, trainer)
    if settings.urls is not None:
        tokenizer, vocab_size = student.tokenizer, student.vocab_size
        if tokenizer is None:
            tokenizer, vocab_size = student_tokenizer(student.name_or_path)
        return connect_teacher(settings, tokenizer=tokenizer, vocab_size=vocab_size, rollout=rollout, rank=rank)
    return None


@dataclass
class Teachers:
    """Each task's teacher (`by_task`: task name -> teacher or None; a run of one task: None -> its teacher), as the
    update asks for a micro-batch's (`of(chunk.task)`)."""

    by_task: dict

    def of(self, task: str | None):
        return self.by_task.get(task)

    def needs(self, task: str | None) -> str | None:
        """What task `task`'s teacher loss reads of its teacher ("logps", "logits"), None without a teacher."""
        teacher = self.of(task)
        return None if teacher is None else teacher_loss_needs(teacher.settings.loss)

    def any_needs(self, needs: str) -> bool:
        """Whether some task's teacher loss reads `needs` of its teacher."""
        return any(self.needs(task) == needs for task in self.by_task)

    def bind(self, policy) -> Teachers:
        """Each teacher with the student's family (a server teacher reads its prompts' media)."""
        bound = {}
        for task, teacher in self.by_task.items():
            bound[task] = None if teacher is None else teacher.bind(policy)
        return Teachers(bound)


def task_teachers(run: TeacherSettings, tasks: list[str] | None, overrides: dict | None) -> dict:
    """Each task's teacher settings: `run` (teacher.*), and in a mixture (`tasks`, its task names) each task's
    `overrides[task]` (task.teacher.<entry>.*) over them; a run of one task: {None: run}. Unknown keys: one sentence."""
    if tasks is None:
        return {None: run}
    found = {}
    for name in tasks:
        own = dict((overrides or {}).get(name) or {})
        unknown = sorted(set(own) - set(TEACHER_KEYS))
        if unknown:
            raise UserError(f"task.teacher.{name}.{unknown[0]} is not a teacher setting; a task's teacher takes "
                            f"{', '.join(TEACHER_KEYS)} (as teacher.*).")
        if own.get("model") is not None and "urls" not in own:
            own["urls"] = None  # a task naming its own model is not also the run's server teacher
        if own.get("urls") is not None and "model" not in own:
            own["model"] = None
        found[name] = replace(run, **own)
    return found


def require_teachers(settings: dict, trainer, task) -> None:
    """Each task's teacher settings (`task_teachers`) checked before anything loads: contradictions with the trainer
    (`require_teacher_settings`), one sentence each."""
    for name, one in settings.items():
        require_teacher_settings(one, trainer, key="teacher" if name is None else f"task.teacher.{name}")


def build_teachers(settings: dict, student: Student, *, trainer, rollout, device, rank: int = 0,
                   models: dict | None = None, family=None) -> Teachers | None:
    """The run's `Teachers` from each task's settings (`task_teachers`, checked by `require_teachers`), each distinct
    teacher built once (`build_teacher`); `models`: teacher models the caller loaded, by task (None for a run of one
    task). None when no task has a teacher."""
    if not any(one.enabled for one in settings.values()):
        return None
    built, by_task = {}, {}
    for name, one in settings.items():
        key = "teacher" if name is None else f"task.teacher.{name}"
        model = (models or {}).get(name)
        if (model is None) != (one.model is None) and student.load is None:
            raise UserError(f"{key}.model and the teacher model given for it go together: pass both (the model and its "
                            f"{key}.* settings) or neither.")
        same = (tuple(vars(one).items()), None if model is None else id(model))  # one teacher, built once
        if same not in built:
            built[same] = build_teacher(one, student, trainer=trainer, rollout=rollout, device=device, rank=rank,
                                        model=model, family=family)
        by_task[name] = built[same]
    return Teachers(by_task)
