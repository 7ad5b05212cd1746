"""The `measure` task (tasks/measure.py): its rows (seeded, balanced, the answer's area the largest or smallest and
within 5% of the next), that the squares are specks at the experiment's pixel budget, its rewards and metrics, and
the cold-start demonstrations of scripts/build_tiny.py --code, whose code run in the sandbox prints the answer."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from helpers.sandbox import needs_bwrap

from gpg_vl.data.task import get_task
from gpg_vl.errors import UserError

ROOT = Path(__file__).resolve().parents[2]
NAMES = {(220, 40, 40): "red", (30, 170, 60): "green", (40, 80, 225): "blue", (235, 200, 30): "yellow"}


@pytest.fixture(scope="module")
def task():
    return get_task("measure", train_size=40, test_size=16)


def test_rows_are_seeded_balanced_and_the_answer_is_the_largest_or_smallest_area_by_a_few_per_cent(task):
    from gpg_vl_tasks.measure import GAP

    rows = task.load("train")
    assert rows[5]["question"] == get_task("measure").load("train")[5]["question"]
    assert rows[5]["image"].tobytes() == get_task("measure").load("train")[5]["image"].tobytes()
    for row in rows[:16]:
        counts = {NAMES[colour]: count for count, colour in row["image"].getcolors() if colour in NAMES}
        assert counts == row["areas"]  # exact colours: the areas are the pixel counts
        ranked = sorted(counts, key=counts.get)
        answer = ranked[-1] if row["kind"] == "largest" else ranked[0]
        nearest = ranked[-2] if row["kind"] == "largest" else ranked[1]
        assert row["answer"] == answer and 0 < abs(counts[answer] - counts[nearest]) <= GAP * counts[answer]
        assert row["kind"] in row["question"]
    answers = [(row["answer"], row["kind"]) for row in rows[:8]]
    assert len(set(answers)) == 8  # every colour, for both questions: a constant answer scores 1/4
    with pytest.raises(UserError, match="no split 'dev'"):
        task.load("dev")
    with pytest.raises(UserError, match="image_size=64"):
        get_task("measure", image_size=64)


def test_rewards_and_metrics_by_hand(task):
    row = task.load("test")[0]
    code = "<code>\n```python\nprint(1)\n```\n</code>"
    right = f"{code}\n<tool_response>\n1\n</tool_response> <answer> {row['answer']} </answer>"
    rewards = {name: fn(right, row) for name, fn in task.reward_functions.items()}
    assert rewards == {"accuracy": 1.0, "format": 1.0}
    assert task.reward_functions["format"]("<code> print(1) <answer> red </answer>", row) == 0.0  # unclosed
    assert task.reward_functions["format"](f"<answer> {row['answer']} </answer> more", row) == 0.0
    metrics = task.metrics([row, row], [right, "<answer> nothing </answer>"])
    assert metrics["tool_call_rate"] == 0.5 and metrics["accuracy/with_tool"] == 1.0
    assert metrics["accuracy/without_tool"] == 0.0


@needs_bwrap
def test_demonstrations_run_their_code_in_the_sandbox_and_answer_what_it_printed(task):
    from gpg_vl.models.load import load_policy

    spec = importlib.util.spec_from_file_location("build_tiny", ROOT / "scripts" / "build_tiny.py")
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    policy = load_policy("embedded:tiny-qwen2.5-vl", dtype="float32", min_pixels=3136, max_pixels=112 * 112)
    family = policy.family
    rows = task.load("train")[:2]
    batch = family.encode([task.messages(r) for r in rows])
    assert batch.image_sizes[0][0][2:] == (112, 112)  # 448 px shown at 112: each square 1 to 6 pixels across
    for k, row in enumerate(rows):
        trajectory = build.tool_demonstration(family, row, batch.image_sizes[k][0], build.code_call(row), "python")
        (observation,) = trajectory.observations
        seen = family.tokenizer.decode(trajectory.token_ids[slice(*observation)])
        colour = next(rgb for rgb, name in NAMES.items() if name == row["answer"])
        assert str(colour) in seen  # the code printed the answer's colour
        answer = family.tokenizer.decode(trajectory.token_ids[slice(*trajectory.segments[1])])
        assert f"<answer> {row['answer']} </answer>" in answer
        assert sum(trajectory.loss_mask) == sum(end - start for start, end in trajectory.segments)
    direct = build.tool_demonstration(family, rows[0], batch.image_sizes[0][0], None, "python")
    assert direct.turns == 1 and not direct.observations


@needs_bwrap
def test_the_cold_start_model_runs_the_code_and_answers_from_what_it_printed(task):
    """The shipped embedded:tiny-qwen2.5-vl-code, greedy on 8 held-out rows (both questions, every colour): it runs
    code in its trajectories and is right more often than a constant answer."""
    from gpg_vl.models.load import load_policy

    spec = importlib.util.spec_from_file_location("build_tiny", ROOT / "scripts" / "build_tiny.py")
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    policy = load_policy("embedded:tiny-qwen2.5-vl-code", dtype="float32", min_pixels=3136, max_pixels=112 * 112)
    metrics = build.tool_metrics(policy, task, task.load("test")[:8], sample=False,
                                 segment_tokens=build.CODE_SEGMENT_TOKENS)
    assert metrics["tool_call_rate"] >= 0.5 and metrics["accuracy/with_tool"] > 0.25, metrics
