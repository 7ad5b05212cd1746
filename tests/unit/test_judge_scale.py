"""The judge that grades on a scale (gpg_vl/reward/judge_scale.py): its rubric prompt and its score parser by
hand-worked cases, the rubric and scale settings, and what it refuses in one sentence. The requests themselves are
tested against a scripted endpoint (tests/integration/test_judge_endpoint.py) and a real vLLM server
(tests/integration/test_judge_vllm_real.py)."""

import re
import types

import pytest

from gpg_vl.config.schema import JudgeSettings
from gpg_vl.errors import UserError
from gpg_vl.reward.judge import JUDGE_MODES, PROMPT, JudgeError, JudgeMode, fill, judge_mode, judge_prompt
from gpg_vl.reward.judge_scale import RUBRIC, parse_score, rubric_template

QUESTION = ("What colour is the bag?", "The bag is black.", "black")


@pytest.mark.parametrize(("reply", "low", "high", "score"), [
    ("Score: 7/10", 0, 10, 0.7),  # the rubric's form, with its scale
    ("Score: 7", 0, 10, 0.7),
    ("score=10", 0, 10, 1.0),
    ("**Score:** 0", 0, 10, 0.0),
    ("The score is 4.5", 0, 10, 0.45),
    ("7 out of 10", 0, 10, 0.7),
    ("7", 0, 10, 0.7),  # one number and nothing else
    ("**8**.", 0, 10, 0.8),
    ('{"score": 8}', 0, 10, 0.8),  # JSON
    ('```json\n{"reason": "close, but not the shade", "score": "6.5"}\n```', 0, 10, 0.65),
    ('{"Score": 3, "reason": "wrong colour"}', 0, 10, 0.3),
    ('{"reason": "two steps"} then {"score": 9}', 0, 10, 0.9),
    ("Score: 3 (2 points off for the colour; 1 for the size)", 0, 10, 0.3),  # numbers after the labelled one
    ("Score: 6\nOn reflection the shade matches. Score: 9", 0, 10, 0.9),  # the last label is the final word
    ("Score: 4", 1, 5, 0.75),  # a 1..5 Likert scale: (4 - 1) / (5 - 1)
    ("Score: 1", 1, 5, 0.0),
    ("Score: 2/4", 0, 4, 0.5),  # miles_diffusion's 0..4
])
def test_a_score_on_the_declared_scale_maps_to_0_1(reply, low, high, score):
    assert parse_score(reply, low, high) == pytest.approx(score, abs=1e-12)


@pytest.mark.parametrize(("reply", "why"), [
    ("Score: 11", "outside reward.judge.scale_min..scale_max (0..10)"),  # out of range: never clipped to 10
    ("Score: -1", "outside"),
    ('{"score": 12.5}', "outside"),
    ("Score: 3/5", "out of 5, not out of reward.judge.scale_max=10"),  # another scale
    ("I would say 7 or maybe 8", "several numbers and no Score: label"),
    ("There are 3 bags; the answer names 2.", "several numbers"),
    ("The answer is right.", "holds no score"),
    ("", "holds no score"),
    ("Score: seven", "holds no score"),
    ('{"score": "high"}', "is not a number"),
    ('{"score": true}', "is not a number"),
    ('{"score": [7]}', "is not a number"),
])
def test_a_reply_without_a_score_on_the_scale_gives_none(reply, why):
    with pytest.raises(JudgeError, match=re.escape(why)):
        parse_score(reply, 0, 10)


def test_the_rubric_prompt_holds_the_question_the_reference_the_answer_and_the_scale():
    mode = judge_mode(JudgeSettings(mode="scale", scale_min=1, scale_max=5))
    assert mode.name == "scale" and mode.max_tokens == 32
    prompt = mode.prompt(QUESTION)
    filled = {"{low}": "1", "{high}": "5", "{question}": "What colour is the bag?",
              "{reference}": "The bag is black.", "{answer}": "black"}
    expected = RUBRIC
    for placeholder, value in filled.items():
        expected = expected.replace(placeholder, value)
    assert prompt == expected
    assert "Give a score from 1 to 5: 5 when" in prompt and prompt.endswith('written as "Score: N".')
    assert mode.read("Score: 4") == 0.75
    # the verdict mode is the yes/no prompt it always was
    assert judge_prompt(QUESTION) == PROMPT.format(question=QUESTION[0], reference=QUESTION[1], answer=QUESTION[2])
    assert judge_mode(JudgeSettings()).read("Yes") == 1.0 and judge_mode(JudgeSettings()).max_tokens == 4


def test_a_rubric_of_ones_own_keeps_other_braces_and_an_answer_holding_a_placeholder_stays_as_written(tmp_path):
    own = 'Rate {answer} against {reference} from {low} to {high}. Reply as JSON: {"score": N}'
    mode = judge_mode(JudgeSettings(mode="scale", rubric=own, max_tokens=64))
    assert mode.max_tokens == 64
    assert mode.prompt(("q", "The bag is black.", "a {reference} bag")) == (
        'Rate a {reference} bag against The bag is black. from 0 to 10. Reply as JSON: {"score": N}')
    file = tmp_path / "rubric.txt"
    file.write_text("Q: {question}\nA: {answer}\nScore from {low} to {high}.")
    assert judge_mode(JudgeSettings(mode="scale", rubric=str(file))).prompt(QUESTION) == (
        "Q: What colour is the bag?\nA: black\nScore from 0 to 10.")
    assert fill("{question} {other} {answer}", {"question": "q", "answer": "a"}) == "q {other} a"


@pytest.mark.parametrize(("settings", "words"), [
    ({"rubric": "/no/such/rubric.txt"}, "reward.judge.rubric='/no/such/rubric.txt' is neither a template holding "
                                        "{answer} nor an existing file"),
    ({"rubric": "FILE"}, "holds no {answer}, so the judge would never see the model's answer"),
])
def test_a_rubric_that_cannot_be_used_is_one_sentence(tmp_path, settings, words):
    file = tmp_path / "rubric.txt"
    file.write_text("Grade the answer from 0 to 10.")
    settings = {key: str(file) if value == "FILE" else value for key, value in settings.items()}
    with pytest.raises(UserError) as error:
        rubric_template(settings["rubric"])
    assert words in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize(("settings", "words"), [
    ({"scale_min": 10, "scale_max": 10}, "reward.judge.scale_max=10 must be above reward.judge.scale_min=10"),
    ({"scale_min": 5, "scale_max": 1}, "must be above"),
])
def test_a_scale_without_room_is_refused_with_the_config(settings, words):
    with pytest.raises(UserError, match=words):
        JudgeSettings(mode="scale", **settings)


def test_modes_are_picked_by_name_and_a_plugin_mode_must_build_a_judge_mode():
    assert {"verdict", "scale"} <= set(JUDGE_MODES)
    with pytest.raises(UserError, match="unknown reward.judge.mode 'likert'; valid options: scale, verdict"):
        judge_mode(types.SimpleNamespace(mode="likert"))
    JUDGE_MODES.register("broken")(lambda settings: "Score: N")
    try:
        with pytest.raises(UserError, match="reward.judge.mode=broken built a str, not a JudgeMode"):
            judge_mode(types.SimpleNamespace(mode="broken"))
    finally:
        JUDGE_MODES.unregister("broken")
    halves = JudgeMode("halves", "{answer}?", lambda reply: 0.5, 2)
    JUDGE_MODES.register("halves")(lambda settings: halves)
    try:
        assert judge_mode(types.SimpleNamespace(mode="halves")).prompt(QUESTION) == "black?"
    finally:
        JUDGE_MODES.unregister("halves")


def test_the_local_judge_refuses_the_scale_before_its_model_loads():
    from gpg_vl.reward.local_judge import local_judge

    with pytest.raises(UserError, match="reward.judge.kind=local compares the log-probs of yes and no, so it gives "
                                        "verdicts only, not reward.judge.mode=scale"):
        local_judge(JudgeSettings(kind="local", model="/no/such/model", mode="scale"), "cpu")

