"""teacher.tolerance: a teacher log-prob within it of the student's is agreement, no signal (issue 59: a teacher on a
vLLM server, equal to the student, differed by rounding and trained on it)."""

from __future__ import annotations

import pytest
import torch

from gpg_vl.config.schema import TeacherSettings
from gpg_vl.errors import UserError
from gpg_vl.objective.teacher_losses import combined_valid, teacher_advantages


def test_gaps_within_the_tolerance_give_no_advantage_and_no_valid_group():
    student = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -2.0, -0.5]])
    teacher = student + torch.tensor([[4e-4, -9e-4, 9.5e-4], [3e-3, 0.0, -2e-3]])  # within; out, -, out
    mask = torch.ones(2, 3, dtype=torch.bool)
    advantages = teacher_advantages(torch.zeros(2), teacher, student, mask, coef=2.0, only=True, tolerance=1e-3)
    assert advantages[0].tolist() == [0.0, 0.0, 0.0]
    assert advantages[1].tolist() == pytest.approx([6e-3, 0.0, -4e-3], abs=1e-6)  # float32 inputs
    assert combined_valid(advantages[:1], mask[:1], 1).tolist() == [False]  # the noise alone: no signal
    assert combined_valid(advantages[1:], mask[1:], 1).tolist() == [True]
    exact = teacher_advantages(torch.zeros(2), teacher, student, mask, coef=2.0, only=True)  # tolerance 0: as before
    assert exact[0].tolist() == pytest.approx([8e-4, -1.8e-3, 1.9e-3], abs=1e-6)
    with_reward = teacher_advantages(torch.tensor([0.5, 0.0]), teacher, student, mask, coef=2.0, tolerance=1e-3)
    assert with_reward[0].tolist() == [0.5, 0.5, 0.5]  # the group's own advantage stays


def test_the_tolerance_is_a_declared_setting():
    assert TeacherSettings().tolerance == 1e-3
    from gpg_vl.config.compose import load_config

    with pytest.raises(UserError, match="teacher.tolerance=-1"):
        load_config("train", ["teacher.tolerance=-1"])
