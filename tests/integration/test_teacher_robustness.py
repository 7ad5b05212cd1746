"""A teacher's faults and extremes (issue 59): a teacher server lost mid-step checkpoints the counters the step began
with (a resumed run logs the uninterrupted run's completions_sampled and tokens_sampled), a teacher.coef whose
advantages overflow is counted and said, and teacher.loss=jsd logs its real figure instead of teacher_kl 0."""

from __future__ import annotations

import json

import pytest
from helpers.runs import train_run, untimed

from gpg_vl.errors import UserError
from gpg_vl.models.tiny import EMBEDDED_TINY


def metrics(folder) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def test_a_teacher_lost_mid_step_resumes_with_the_uninterrupted_runs_counters(tmp_path, monkeypatch, perturbed_teacher):
    """The teacher's server unreachable in step 2's update (EngineUnreachable, as teacher/server.py raises it): the
    run stops with checkpoint-1, and resume=auto logs steps 2-3 as the uninterrupted run, counters included (they
    were 8 completions and 128 tokens too high: the failed step's samples were counted)."""
    import gpg_vl.train.step.update as teacher_module  # the update asks train/teacher/signal.py's teacher_shaping
    from gpg_vl.rollout.engine import EngineUnreachable

    run = ["trainer.max_steps=3", "trainer.lr=1e-3", "seed=0", f"teacher.model={perturbed_teacher}"]
    real, calls = teacher_module.teacher_shaping, []

    def lost_at_step_2(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise EngineUnreachable("the vLLM server at http://127.0.0.1:9 did not answer POST /v1/completions "
                                    "within teacher.timeout_s; raise teacher.timeout_s.")
        return real(*args, **kwargs)

    monkeypatch.setattr(teacher_module, "teacher_shaping", lost_at_step_2)
    with pytest.raises(UserError, match="the run stopped after step 1 and wrote checkpoint-1"):
        train_run(tmp_path / "out", *run)
    monkeypatch.setattr(teacher_module, "teacher_shaping", real)
    train_run(tmp_path / "out", *run, "resume=auto")
    train_run(tmp_path / "whole", *run)
    resumed, whole = metrics(tmp_path / "out"), metrics(tmp_path / "whole")
    assert [m["step"] for m in resumed] == [1, 2, 3]
    assert [m["completions_sampled"] for m in resumed] == [m["completions_sampled"] for m in whole]
    assert [m["tokens_sampled"] for m in resumed] == [m["tokens_sampled"] for m in whole]
    assert [untimed(m) for m in resumed] == [untimed(m) for m in whole]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["completions_sampled"] == whole[-1]["completions_sampled"]


def test_a_teacher_coef_whose_advantages_overflow_is_counted_and_said(tmp_path, perturbed_teacher, capsys):
    """teacher.coef=1e300 overflowed every advantage: every group invalid, nonfinite_steps 0, not a word (issue 59).
    Now each step counts as one with NaN or infinite numbers, and a warning names teacher.coef."""
    train_run(tmp_path, "trainer.max_steps=2", "trainer.save_every=0", "seed=0", f"teacher.model={perturbed_teacher}",
              "teacher.coef=1e300")
    lines = metrics(tmp_path)
    assert [m["nonfinite_steps"] for m in lines] == [1, 2]
    assert [m["teacher_nonfinite_groups"] for m in lines] == [4, 4] and all(m["skipped"] for m in lines)
    out = capsys.readouterr()
    said = [line for line in (out.out + out.err).splitlines() if "teacher's advantages" in line]
    assert len(said) == 2 and "teacher.coef=1e+300" in said[0] and "\n" not in said[0]


def test_jsd_logs_its_own_figure_and_no_teacher_kl_placeholder(tmp_path, perturbed_teacher):
    """teacher.loss=jsd logged teacher_kl 0.0 every step, which reads as "the student equals the teacher"."""
    train_run(tmp_path, "trainer.max_steps=1", "trainer.save_every=0", "seed=0", f"teacher.model={perturbed_teacher}",
              "teacher.loss=jsd", "teacher.only=true")
    (step,) = metrics(tmp_path)
    assert "teacher_kl" not in step and step["teacher_jsd"] > 0


def test_a_lora_adapter_folder_as_the_teacher_is_named_as_such(tmp_path):
    """An adapter-only folder (model.lora.save=adapter) said "no tokenizer or config that loads" (issue 59)."""
    from gpg_vl.config.schema import TeacherSettings
    from gpg_vl.train.teacher.local import check_tokenizer

    adapter = tmp_path / "final"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(EMBEDDED_TINY),
                                                             "peft_type": "LORA"}))
    (adapter / "adapter_model.safetensors").write_bytes(b"")
    with pytest.raises(UserError) as error:
        check_tokenizer(TeacherSettings(model=str(adapter)), str(EMBEDDED_TINY))
    assert str(error.value) == (f"teacher.model={adapter} holds a LoRA adapter without its base model's weights "
                                f"(adapter_config.json, base {EMBEDDED_TINY}); a teacher is loaded whole: name a "
                                "folder saved with model.lora.save=merged (or the adapter merged into its base).")
