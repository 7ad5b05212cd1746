"""Tool-use reward primitives (gpg_vl/reward/tooluse.py) and the judge's parsing (gpg_vl/reward/judge.py), by
hand-worked cases; the crop count is also checked against real rollouts in
tests/integration/test_tool_rewards_on_trajectories.py."""

import math

import pytest

from gpg_vl.errors import UserError
from gpg_vl.reward.judge import EndpointJudge, JudgeError, chat_url, read_verdict
from gpg_vl.reward.tooluse import (
    TOOL_REWARDS,
    crops_used,
    lettered_options,
    options_text,
    shuffled,
    tool_bonus,
    tool_format_reward,
)

CALL = '<think>small</think><tool_call>{"name": "zoom_in", "arguments": {"bbox_2d": [1, 2, 40, 50]}}</tool_call>'
CROP = "\nuser\n<tool_response>\n\n</tool_response>\nassistant\n"
ERROR = "\nuser\n<tool_response>\nError: the box is 3 x 3 pixels.\n</tool_response>\nassistant\n"


def test_lettered_options_read_the_trailing_run_of_option_lines():
    text = "What is the colour?\n(A) red\n(B) dark blue\n(C) green\nAnswer with the option's letter."
    assert lettered_options(text) == ("What is the colour?", ["red", "dark blue", "green"])
    assert lettered_options("Q?\nA. left\nB. right") == ("Q?", ["left", "right"])
    assert lettered_options("Q?\n(A) left\n(C) right") == ("Q?\n(A) left\n(C) right", [])  # not A, B, ...
    assert lettered_options("Q?\n(A) only one") == ("Q?\n(A) only one", [])
    assert lettered_options("No options here.") == ("No options here.", [])
    assert options_text(["red", "blue"]) == "(A) red\n(B) blue"


def test_shuffled_is_a_function_of_its_key_and_the_label_follows_its_option():
    options = ["red", "blue", "green", "yellow"]
    for key in range(50):  # loop reference: the right option's text never changes
        order, label = shuffled(options, "A", f"0:{key}")
        assert sorted(order) == sorted(options) and order["ABCD".index(label)] == "red"
        assert shuffled(options, "A", f"0:{key}") == (order, label)
    labels = {shuffled(options, "A", f"0:{key}")[1] for key in range(50)}
    assert labels == {"A", "B", "C", "D"}  # over 50 questions the right option lands on every letter


@pytest.mark.parametrize(("completion", "crops"), [
    ("<think>x</think><answer>A</answer>", 0),
    (f"{CALL}{CROP}<answer>A</answer>", 1),
    (f"{CALL}{CROP}{CALL}{CROP}<answer>A</answer>", 2),
    (f"{CALL}{ERROR}<answer>A</answer>", 0),  # refused: an error observation
    (f"{CALL}{ERROR}{CALL}{CROP}<answer>A</answer>", 1),
    ("<think>x</think><tool_response>\n\n</tool_response><answer>A</answer>", 0),  # written by the model itself
    (CALL, 0),  # the turn limit: the call was not run
])
def test_crops_used_counts_successful_observations_after_a_call(completion, crops):
    assert crops_used(completion) == crops
    assert tool_bonus(completion, 1.0) == float(crops > 0)
    assert tool_bonus(completion, 0.0) == 0.0  # a wrong answer earns no tool bonus, crop or not


@pytest.mark.parametrize(("completion", "score"), [
    ("<think>x</think><answer>A</answer>", 0.0),
    (f"{CALL}{CROP}<think>y</think><answer>A</answer>", 0.0),
    ("<answer>A</answer>", 0.0),  # DeepEyes does not require a think block
    ("no tags at all", 0.0),
    ("<think>x<answer>A</answer>", -1.0),  # unbalanced think
    ("<think>x</think><tool_call>{}<answer>A</answer>", 0.0),  # an unclosed call: DeepEyes never checks these tags
    ("<think>x</think></tool_call><answer>A</answer>", 0.0),  # nor a stray closing one
    ("x" * 1000, -1.0),  # no <answer>: the whole reply is DeepEyes' answer text, 1000 characters
    ("<think>x</think><answer>A", -1.0),  # unclosed answer
    ("<think>x</think><answer>A</answer></answer>", -1.0),
    ("<think>x</think><answer>" + "a" * 999 + "</answer>", 0.0),
    ("<think>x</think><answer>" + "a" * 1000 + "</answer>", -1.0),  # 1000 characters or more
])
def test_tool_format_reward_is_deepeyes_zero_or_minus_one(completion, score):
    assert tool_format_reward(completion) == score


def test_reward_sets_by_name_with_the_given_weights():
    def accuracy(completion, row):
        return 1.0 if "<answer>A</answer>" in completion else 0.0

    weights = {"accuracy": 0.8, "format": 0.2, "tool": 1.2}
    functions, given = TOOL_REWARDS.get("deepeyes")(accuracy, weights)
    assert given == weights and set(functions) == {"accuracy", "format", "tool"}
    crop = f"{CALL}{CROP}<answer>A</answer>"
    assert {name: fn(crop, {}) for name, fn in functions.items()} == {"accuracy": 1.0, "format": 0.0, "tool": 1.0}
    functions, given = TOOL_REWARDS.get("accuracy")(accuracy, weights)
    assert given == {"accuracy": 0.8} and list(functions) == ["accuracy"]
    with pytest.raises(UserError, match="task.options.rewards"):
        TOOL_REWARDS.get("deepeye")


@pytest.mark.parametrize(("reply", "verdict"), [
    ("Yes", 1.0), ("yes.", 1.0), (" YES, they match", 1.0), ("1", 1.0), ("No", 0.0), ("no", 0.0), ("0", 0.0),
    ("**No**", 0.0),
])
def test_judge_verdicts(reply, verdict):
    assert read_verdict(reply) == verdict


@pytest.mark.parametrize("reply", ["maybe", "", "Yesterday", "10", "The answers are consistent"])
def test_unreadable_judge_replies_raise(reply):
    with pytest.raises(JudgeError):
        read_verdict(reply)


def test_judge_urls_and_settings():
    assert chat_url("http://h:8000/v1") == "http://h:8000/v1/chat/completions"
    assert chat_url("http://h:8000/v1/chat/completions/") == "http://h:8000/v1/chat/completions"
    with pytest.raises(UserError, match="not an http"):
        EndpointJudge("ftp://h/v1")
    with pytest.raises(UserError, match="above 0"):
        EndpointJudge("http://h/v1", timeout_s=0)


def test_a_failed_verdict_is_missing_remembered_for_the_step_and_asked_again_in_the_next(capsys):
    from gpg_vl.reward.judge import Judge, judge_tally

    class Refusing(Judge):
        asked = 0

        def decide(self, question):
            self.asked += 1
            raise JudgeError("the judge at http://h/v1 gave no reply (HTTP 400)")

    judge = Refusing()
    with judge_tally() as tally:
        for _ in range(3):  # the accuracy, then the tool bonus asking the same completion's accuracy again
            assert math.isnan(judge("Q?", "The bag is black.", "black"))
    assert judge.asked == 1 and judge.missing == 1 and (tally.asked, tally.missing) == (3, 3)
    assert capsys.readouterr().err.count("gave no reply (HTTP 400); that completion's score is missing") == 1
    judge.new_step()
    assert math.isnan(judge("Q?", "The bag is black.", "black"))
    assert judge.asked == 2 and judge.missing == 2
    assert "missing" not in capsys.readouterr().err  # said once per judge
