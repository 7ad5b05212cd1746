"""The task registry and the built-in synthetic task."""

import pytest

from gpg_vl import Task, UserError, get_task, list_tasks, register_task
from gpg_vl.reward.primitives import exact_match_reward, extract_answer, format_reward


def test_registry_rejects_duplicates_and_lists_known_names_for_unknown_ones():
    assert "shapes" in list_tasks()

    class Other(Task):
        name = "shapes"

    with pytest.raises(UserError, match="already registered"):
        register_task(Other)
    with pytest.raises(UserError, match="unknown task.name 'no-such-task'; valid options: .*shapes"):
        get_task("no-such-task")
    with pytest.raises(UserError, match="train_size"):
        get_task("shapes", colour_count=3)


def test_out_of_tree_task_loads_from_a_file(tmp_path):
    plugin = tmp_path / "mytask.py"
    plugin.write_text(
        "from gpg_vl import Task\n"
        "class Echo(Task):\n"
        "    name = 'echo-test'\n"
        "    def load(self, split):\n"
        "        return [{'id': '0', 'answer': 'x'}]\n"
    )
    task = get_task(f"{plugin}:Echo")
    assert task.name == "echo-test" and task.load("train")[0]["answer"] == "x"
    with pytest.raises(UserError, match="does not exist"):
        get_task(f"{tmp_path}/missing.py:Echo")


def test_shapes_rows_are_deterministic_and_their_reference_answers_score_full_marks(shapes):
    rows = shapes.load("test")
    assert rows[3]["question"] == shapes.load("test")[3]["question"]
    assert {r["question_type"] for r in rows} == {"color", "shape", "count", "relation"}
    for row in rows:
        assert shapes.reward(row["solution"], row) == 2.0
        assert row["image"].size == (112, 112) and row["image"].mode == "RGB"
    assert shapes.metrics(rows, [r["solution"] for r in rows])["accuracy"] == 1.0


@pytest.mark.parametrize("completion, expected", [
    ("<think> a </think>\n<answer> red </answer>", (1.0, "red")),
    ("<think>a</think><answer>blue</answer>", (1.0, "blue")),
    ("<answer> red </answer>", (0.0, "red")),
    ("<think> a </think><answer></answer>", (1.0, "")),
    ("no tags at all", (0.0, None)),
    ("<think> a </think><answer> red </answer> trailing", (0.0, "red")),
])
def test_format_and_answer_extraction(completion, expected):
    assert (format_reward(completion), extract_answer(completion)) == expected


def test_exact_match_never_rewards_an_empty_or_missing_answer():
    assert exact_match_reward("<answer> Red. </answer>", "red") == 1.0
    assert exact_match_reward("<answer>  </answer>", "red") == 0.0
    assert exact_match_reward("<answer>", "red") == 0.0
    assert exact_match_reward("<answer> blue </answer><answer> red </answer>", "red") == 1.0  # the last one
