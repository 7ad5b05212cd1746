"""One door for the teacher (gpg_vl/train/teacher/build.py) and the teacher-loss registry
(gpg_vl/objective/teacher_losses.py): each task's teacher settings in a mixture (the run's teacher.* with the task's
task.teacher.<entry>.* over them), the sentences for a key or an entry that names nothing, and teacher losses
registered with what they read of the teacher."""

from __future__ import annotations

import pytest
import torch

from gpg_vl.config.schema import TeacherSettings, TrainerSettings
from gpg_vl.data.mixture import build_mixture
from gpg_vl.errors import UserError
from gpg_vl.objective.teacher_losses import (
    TEACHER_LOSSES,
    get_teacher_loss,
    register_teacher_loss,
    teacher_loss_needs,
)
from gpg_vl.train.teacher.build import Teachers, require_teachers, task_teachers


def test_each_task_takes_the_runs_teacher_with_its_own_settings_over_it():
    run = TeacherSettings(model="run-teacher", coef=0.5)
    found = task_teachers(run, ["shapes", "zoom", "motion"],
                          {"zoom": {"model": "zoom-teacher", "coef": 2.0}, "motion": {"model": None}})
    assert found["shapes"] == run
    assert found["zoom"] == TeacherSettings(model="zoom-teacher", coef=2.0)
    assert not found["motion"].enabled  # a task leaves the run's teacher with model=null
    served = task_teachers(TeacherSettings(urls="http://t:1"), ["shapes", "zoom"], {"zoom": {"model": "local"}})
    assert served["shapes"].urls == "http://t:1" and served["zoom"] == TeacherSettings(model="local")
    assert task_teachers(run, None, None) == {None: run}  # a run of one task


def test_a_tasks_teacher_key_or_entry_that_names_nothing_is_one_sentence():
    with pytest.raises(UserError, match=r"^task.teacher.zoom.modle is not a teacher setting; a task's teacher takes "
                                        r"model, coef, tolerance, only, loss"):
        task_teachers(TeacherSettings(), ["zoom"], {"zoom": {"modle": "x"}})
    with pytest.raises(UserError, match=r"^task.teacher.motion names no task of task.mixture \(shapes\)"):
        build_mixture({"shapes": 1}, None, None, teachers={"motion": {"model": "x"}})
    mixture = build_mixture({"shapes": 1}, None, None, teachers={"shapes": {"model": "x", "coef": 0.1}})
    assert mixture.teachers == {"shapes": {"model": "x", "coef": 0.1}}


def test_a_tasks_teacher_is_checked_under_its_own_key():
    mixture = build_mixture({"shapes": 1, "zoom": 1}, None, None)
    settings = task_teachers(TeacherSettings(), ["shapes", "zoom"], {"zoom": {"urls": "http://t:1", "loss": "jsd"}})
    with pytest.raises(UserError, match=r"^task.teacher.zoom.loss=jsd reads the teacher's whole distribution at every "
                                        r"position, which task.teacher.zoom.urls"):
        require_teachers(settings, TrainerSettings(), mixture)


def test_teachers_answer_for_each_task():
    class Stub:
        def __init__(self, loss):
            self.settings = TeacherSettings(model="x", loss=loss)

    teachers = Teachers({"shapes": Stub("reverse_kl"), "zoom": Stub("jsd"), "motion": None})
    assert [teachers.needs(task) for task in ("shapes", "zoom", "motion", None)] == ["logps", "logits", None, None]
    assert teachers.any_needs("logps") and teachers.any_needs("logits")
    assert teachers.of("motion") is None and teachers.of(None) is None


def test_teacher_losses_are_registered_with_what_they_read():
    assert {"reverse_kl", "jsd"} <= set(TEACHER_LOSSES.names())
    assert teacher_loss_needs("reverse_kl") == "logps" and teacher_loss_needs("jsd") == "logits"

    @register_teacher_loss("test_half_jsd", needs="logits")
    def half(student_logits, teacher_logits, *, beta=0.5):
        return get_teacher_loss("jsd")(student_logits, teacher_logits, beta=beta) / 2

    try:
        logits = torch.randn(3, 5)
        assert torch.allclose(get_teacher_loss("test_half_jsd")(logits, logits.flip(0)) * 2,
                              get_teacher_loss("jsd")(logits, logits.flip(0)))
    finally:
        TEACHER_LOSSES.unregister("test_half_jsd")
    with pytest.raises(UserError, match=r"^teacher loss 'x' needs 'ids'; a teacher loss needs one of: logps, logits"):
        register_teacher_loss("x", needs="ids")
    with pytest.raises(UserError, match=r"^teacher.loss=torch:zeros declares no needs; register it with "
                                        r"@register_teacher_loss"):
        get_teacher_loss("torch:zeros")
    with pytest.raises(UserError, match=r"^unknown teacher.loss 'kl'; valid options: jsd, reverse_kl"):
        get_teacher_loss("kl")
