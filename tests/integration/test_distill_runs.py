"""On-policy distillation end to end (gpg_vl/train/teacher/local.py): a teacher equal to the student gives no signal
(every group's combined advantage is zero: no step), a perturbed teacher makes every group valid and logs teacher_kl,
the supervised form (teacher.loss=jsd) and the top-entropy mask train, and a teacher with another vocabulary is refused
in one sentence before any model loads. Every step logs entropy_mean."""

from __future__ import annotations

import json

import pytest
from helpers.runs import train_run

from gpg_vl.errors import UserError
from gpg_vl.models.tiny import EMBEDDED_TINY

QUICK = ["trainer.max_steps=1", "trainer.save_every=0", "seed=0"]


def metrics(folder) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def test_teacher_equal_to_the_student_gives_no_signal(tmp_path):
    """teacher.only with the student's own weights: log teacher = log student on every token, so every group's
    combined advantage is zero, AGE finds no valid group, and no weight changes."""
    train_run(tmp_path, *QUICK, f"teacher.model={EMBEDDED_TINY}", "teacher.only=true")
    step = metrics(tmp_path)[0]
    assert step["teacher_kl"] == 0.0
    assert step["groups_used"] == 0 and step["alpha"] == 0.0
    assert step["skipped"] == 1.0


def test_reward_and_teacher(tmp_path, perturbed_teacher):
    train_run(tmp_path, *QUICK, f"teacher.model={perturbed_teacher}")
    step = metrics(tmp_path)[0]
    assert step["teacher_kl"] > 0.01  # sampled KL(student || teacher) per token
    assert step["groups_used"] == step["groups_sampled"] == 4 and step["alpha"] == 1.0  # every group carries signal
    assert step["skipped"] == 0.0 and step["entropy_mean"] > 0
    # the rollout log keeps each token's student and teacher log-probs; the viewer colours tokens by their gap
    from gpg_vl.observe.viewer import write_rollouts_html

    completion = json.loads((tmp_path / "rollouts" / "step-1.json").read_text())["groups"][0]["completions"][0]
    scored = completion["scored"]
    assert len(scored["tokens"]) == len(scored["student"]) == len(scored["teacher"]) == completion["tokens"]
    assert all(s <= 0 and t <= 0 for s, t in zip(scored["student"], scored["teacher"], strict=True))
    assert scored["student"] != scored["teacher"]
    page = write_rollouts_html(tmp_path).read_text()
    assert "teacher - student log-prob per token" in page and f"teacher {scored['teacher'][0]:.3f}" in page


def test_jsd_and_top_entropy(tmp_path, perturbed_teacher):
    train_run(tmp_path / "jsd", *QUICK, f"teacher.model={perturbed_teacher}", "teacher.loss=jsd", "teacher.only=true",
              "teacher.beta=0.5")
    step = metrics(tmp_path / "jsd")[0]
    assert step["teacher_jsd"] > 0 and step["skipped"] == 0.0 and step["grad_norm"] > 0
    train_run(tmp_path / "plain", *QUICK, "trainer.beta_th=0.4")  # resampled until some group has signal
    train_run(tmp_path / "top", *QUICK, "trainer.beta_th=0.4", "trainer.top_entropy_quantile=0.2")
    plain, top = metrics(tmp_path / "plain")[0], metrics(tmp_path / "top")[0]
    assert plain["reward_mean"] == top["reward_mean"]  # the same samples
    assert plain["entropy_mean"] == top["entropy_mean"]  # the mask takes gradient away, not the metric
    # 80% of the tokens give no gradient; they are the near-certain ones, whose gradient is small anyway (the 80/20
    # result), so the norm moves little
    assert top["grad_norm"] != plain["grad_norm"]
    # verl's Clip-Cov with a band every counted token lies in: the share asked for gives no gradient
    train_run(tmp_path / "cov", *QUICK, "trainer.beta_th=0.4", "trainer.clip_cov_ratio=0.25",
              "trainer.clip_cov_bounds=[-100,100]")
    cov = metrics(tmp_path / "cov")[0]
    assert cov["reward_mean"] == plain["reward_mean"] and cov["grad_norm"] != plain["grad_norm"]
    assert 0.2 <= cov["clip_cov_fraction"] <= 0.25  # int(0.25 x counted) per micro-batch
    assert "clip_cov_fraction" not in plain


def test_teacher_with_another_vocabulary_is_refused(tmp_path):
    """A tokenizer with one more token: refused in one sentence before any model loads (the folder holds no
    weights at all)."""
    from transformers import AutoConfig, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(EMBEDDED_TINY)
    tokenizer.add_tokens(["<not-in-the-student>"])
    tokenizer.save_pretrained(tmp_path / "teacher")
    AutoConfig.from_pretrained(EMBEDDED_TINY).save_pretrained(tmp_path / "teacher")
    with pytest.raises(UserError, match="another tokenizer or vocabulary"):
        train_run(tmp_path / "run", *QUICK, f"teacher.model={tmp_path / 'teacher'}")


def test_evaluation_reports_answer_entropy():
    """Greedy and sampled held-out answers: entropy_mean, per generated token, from one forward of the policy; a
    greedy answer of the tiny model is more certain than the same model's sampled answers at temperature 1."""
    from gpg_vl.config.schema import RolloutSettings
    from gpg_vl.data.task import get_task
    from gpg_vl.models.load import load_policy
    from gpg_vl.rollout.engine import build_engine
    from gpg_vl.train.eval.evaluate import Decoding, evaluate

    policy = load_policy(str(EMBEDDED_TINY), dtype="float32")
    task = get_task("shapes")
    rows = list(task.load(task.eval_split))[:6]
    engine = build_engine(RolloutSettings(max_new_tokens=24), policy)
    greedy, decoded = evaluate(policy, task, rows, engine=engine, batch_size=6, max_new_tokens=24)
    sampled, _ = evaluate(policy, task, rows, engine=engine, batch_size=6, max_new_tokens=24,
                          decoding=Decoding(samples=4, temperature=1.0))
    assert 0 < greedy["entropy_mean"] < sampled["entropy_mean"]
    tokens = [d.entropy[1] for d in decoded]
    assert all(0 < t <= 24 for t in tokens)
    assert greedy["entropy_mean"] == pytest.approx(sum(d.entropy[0] for d in decoded) / sum(tokens))


TWO_TASKS = ["task=mix", "task.mixture={shapes: 1, zoom: 1}", "task.options.zoom.image_size=224",
             "task.options.zoom.train_size=8"]


@pytest.fixture(scope="module")
def mixture_with_one_teacher(tmp_path_factory, perturbed_teacher) -> dict:
    """Step 1 of a two-task mixture (shapes, and zoom: two turns) whose tasks share the run's teacher."""
    folder = tmp_path_factory.mktemp("two")
    train_run(folder, *QUICK, f"teacher.model={perturbed_teacher}", *TWO_TASKS)
    return metrics(folder)[0]


def test_a_mixture_logs_each_tasks_teacher_kl(tmp_path, perturbed_teacher, mixture_with_one_teacher):
    """task=mix with a teacher: each task's teacher_kl, the same token sums as the step's, grouped by task (one task:
    the step's own; two: the step's lies between theirs, a token-weighted mean)."""
    train_run(tmp_path / "one", *QUICK, f"teacher.model={perturbed_teacher}", "task=mix", "task.mixture={shapes: 1}")
    step = metrics(tmp_path / "one")[0]
    assert step["shapes/teacher_kl"] == pytest.approx(step["teacher_kl"], rel=1e-6) and step["teacher_kl"] > 0.01
    step = mixture_with_one_teacher
    parts = sorted([step["shapes/teacher_kl"], step["zoom/teacher_kl"]])
    assert parts[0] < parts[1] and parts[0] - 1e-9 <= step["teacher_kl"] <= parts[1] + 1e-9


def test_each_task_of_a_mixture_learns_from_its_own_teacher(tmp_path, perturbed_teacher, mixture_with_one_teacher):
    """task.teacher.<entry>.model: shapes' teacher is the student's own weights, zoom's the perturbed model. Step 1
    samples what the run with one teacher for both samples; shapes' sequences are scored by its own teacher (log
    teacher = log student on every token: its teacher_kl is 0, where the perturbed teacher gives it more than 0.01),
    zoom's by the perturbed one (its teacher_kl equal, to the bit, to that teacher's scoring of the same tokens)."""
    train_run(tmp_path, *QUICK, *TWO_TASKS, f"task.teacher.shapes.model={EMBEDDED_TINY}",
              f"task.teacher.zoom.model={perturbed_teacher}")
    own, one = metrics(tmp_path)[0], mixture_with_one_teacher
    assert own["reward_mean"] == one["reward_mean"] and own["groups_sampled"] == one["groups_sampled"]
    assert own["shapes/teacher_kl"] == 0.0 and one["shapes/teacher_kl"] > 0.01
    assert own["zoom/teacher_kl"] == one["zoom/teacher_kl"] > 0.01
    assert 0.0 < own["teacher_kl"] < own["zoom/teacher_kl"]  # the token mean over both tasks
