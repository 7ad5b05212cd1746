"""Reward primitives: right, wrong, malformed and adversarial answers for every reward, and their ranges."""

import math
import threading
import time

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from gpg_vl.reward import math_check
from gpg_vl.reward.primitives import (
    ANSWER_PATTERN,
    FORMAT_PATTERN,
    box_giou,
    box_iou,
    choice_letter,
    choice_reward,
    extract_answer,
    format_reward,
    giou_reward,
    iou_reward,
    label_reward,
    math_reward,
    parse_box,
)

CHOICES = ["blue", "red", "green", "yellow"]
TARGET = [0, 0, 10, 10]
HUGE = ["<answer>" + "9" * 1_000_000 + "</answer>", "<think>" * 200_000, "<answer>" * 200_000,
        "</answer>" + "<answer>" * 200_000, "<think></think><answer>" * 100_000]
UNICODE = ["<answer>\u0000\ud7ff\U0001f600 \u202e\u00e9\u0301 \u4e2d\u6587</answer>", "<answer>\u200b</answer>",
           "<answer>\x85\u2028</answer>", "\U0010ffff" * 100]


def answer(text: str) -> str:
    return f"<think>ok</think><answer>{text}</answer>"


def each_reward(completion: str) -> dict[str, float]:
    """Every reward on one completion (math with a short timeout, so property tests stay fast)."""
    return {
        "format": format_reward(completion),
        "choice": choice_reward(completion, CHOICES, "B"),
        "math": math_reward(completion, "140", timeout_s=0.5),
        "label": label_reward(completion, ["rose", "pink rose"]),
        "iou": iou_reward(completion, TARGET),
        "giou": giou_reward(completion, TARGET),
    }


RANGES = {"format": (0, 1), "choice": (0, 1), "math": (0, 1), "label": (0, 1), "iou": (0, 1), "giou": (0, 2)}


def assert_in_range(scores: dict[str, float]) -> None:
    for name, value in scores.items():
        low, high = RANGES[name]
        assert isinstance(value, float) and low <= value <= high, (name, value)
        if name in ("format", "choice", "math", "label"):
            assert value in (0.0, 1.0), (name, value)


# ---------------------------------------------------------------- extraction and format


def test_extraction_and_format_are_linear_on_adversarial_megabyte_strings():
    # The plain regexes rescan to the end from every unclosed tag: minutes on these.
    start = time.perf_counter()
    for completion in HUGE:
        extract_answer(completion)
        format_reward(completion)
    assert time.perf_counter() - start < 1.0
    assert extract_answer(HUGE[0]) == "9" * 1_000_000
    assert extract_answer(HUGE[2]) is None and extract_answer(HUGE[3]) is None
    assert format_reward("<think>" + "</think>x" * 100_000 + "</think> <answer>a</answer>") == 1.0


TAG_SOUP = st.lists(st.sampled_from(["<think>", "</think>", "<answer>", "</answer>", "<answer", "think>", " ", "\n",
                                     "\u00a0", "\u2003", "\x1c", "\x85", "x", "B", "<", ">", "/"]),
                    max_size=14).map("".join)


@settings(max_examples=300, deadline=None)
@given(TAG_SOUP)
def test_extraction_and_format_agree_with_their_published_regexes(text):
    matches = ANSWER_PATTERN.findall(text)
    assert extract_answer(text) == (matches[-1].strip() if matches else None)
    assert format_reward(text) == (1.0 if FORMAT_PATTERN.fullmatch(text.strip()) else 0.0)


# ---------------------------------------------------------------- multiple choice


@pytest.mark.parametrize("prediction", ["B", "(B)", "B.", "b", "B)", "[B]", "(B).", "**B**", " B ", "(B) red",
                                        "B. red", "B: Red.", "red", " RED. ", "Red!"])
def test_choice_accepts_the_right_letter_or_option_text(prediction):
    assert choice_reward(answer(prediction), CHOICES, "B") == 1.0


@pytest.mark.parametrize("right", ["B", "(B)", "B.", "b", "red", "Red."])
def test_choice_reads_the_reference_in_any_form(right):
    assert choice_reward(answer("B"), CHOICES, right) == 1.0
    assert choice_reward(answer("A"), CHOICES, right) == 0.0


@pytest.mark.parametrize("prediction", ["A", "(A)", "blue", "E", "Z", "(B) blue", "(A) red", "B. purple",
                                        "reddish", "not red"])
def test_choice_rejects_a_wrong_or_out_of_range_option(prediction):
    assert choice_reward(answer(prediction), CHOICES, "B") == 0.0


@pytest.mark.parametrize("prediction", ["A or B", "B or A", "(A) (B)", "A, B", "B, A", "A and B", "AB", "B A",
                                        "A/B", "red, blue", "red or blue", "(B) (B) red", "B. red (C)"])
def test_choice_naming_two_options_is_wrong(prediction):
    assert choice_letter(prediction, CHOICES) is None
    assert choice_reward(answer(prediction), CHOICES, "B") == 0.0


def test_choice_letter_strips_option_prefixes_and_flags_ambiguity():
    prefixed = ["A. blue", "B. red", "(C) green"]
    assert [choice_letter(t, prefixed) for t in ("red", "B. red", "(B) red", "green", "C", "D")] == [
        "B", "B", "B", "C", "C", None]
    assert choice_letter("red", ["red", "red"]) is None  # duplicate option texts name two options
    assert [choice_letter(t, ["I", "II", "III"]) for t in ("I", "ii", "B", "(C)", "IV")] == ["A", "B", "B", "C", None]
    assert choice_letter("C", []) == "C" and choice_letter("red", []) is None  # options known only by letter
    assert choice_reward(answer("red"), CHOICES, "no such option") == 0.0  # bad reference: nothing scores


@pytest.mark.parametrize("completion", ["<answer></answer>", "<answer>  </answer>",
                                        "<answer><answer>B</answer></answer>",
                                        "B", "<answer>B", "B</answer>", "<think>B</think>", *HUGE, *UNICODE])
def test_choice_scores_malformed_and_adversarial_completions_zero(completion):
    assert choice_reward(completion, CHOICES, "B") == 0.0


def test_choice_counts_the_last_answer():
    assert choice_reward("<answer>A</answer> no, <answer>B</answer>", CHOICES, "B") == 1.0
    assert choice_reward("<answer>B</answer> no, <answer>A</answer>", CHOICES, "B") == 0.0


# ---------------------------------------------------------------- math


@pytest.mark.parametrize("prediction, truth", [
    ("140°", "140"), ("140", "140°"), ("$140^\\circ$", "140"), ("140^{\\circ}", "$140$"), ("\\frac{1}{2}", "0.5"),
    ("0.5", "\\frac{1}{2}"), ("\\boxed{3}", "3"), ("1,000", "1000"), ("2\\sqrt{2}", "\\sqrt{8}"), ("x = 3", "3"),
    ("2^{100}", "1267650600228229401496703205376"), ("9^9^9^9^9", "9^9^9^9^9"),
])
def test_math_accepts_equal_values(prediction, truth):
    assert math_reward(answer(prediction), truth) == 1.0


@pytest.mark.parametrize("prediction", ["141", "-140", "14", "1/2", "140 or 141", "x", "\\frac{1}{3}"])
def test_math_rejects_wrong_values(prediction):
    assert math_reward(answer(prediction), "140") == 0.0


@pytest.mark.parametrize("completion", ["<answer></answer>", "<answer> $ ° $ </answer>", "140", "<answer>140",
                                        "<answer><answer>140</answer></answer>", *HUGE, *UNICODE])
def test_math_scores_malformed_and_adversarial_completions_zero(completion):
    assert math_reward(completion, "140", timeout_s=1.0) == 0.0
    assert math_reward(completion, "9", timeout_s=1.0) == 0.0  # '9' * 1_000_000 is not 9


def test_math_counts_the_last_answer_and_never_matches_an_empty_reference():
    assert math_reward("<answer>3</answer><answer>140</answer>", "140") == 1.0
    assert math_reward("<answer>140</answer><answer>3</answer>", "140") == 0.0
    assert math_reward(answer("140"), "") == 0.0 and math_reward(answer("140"), "$°$") == 0.0
    assert math_reward(answer("140"), "140", timeout_s=0) == 1.0  # identical text needs no parsing
    assert math_reward(answer("140.0"), "140", timeout_s=0) == 0.0


def run_in_thread(fn):
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("value", fn()))
    thread.start()
    thread.join(30)
    assert not thread.is_alive()
    return result["value"]


# Power towers and factorials would build gigantic exact integers (rejected before sympy evaluates them);
# the sum and product are slow sympy work (their child process is killed at the deadline).
PATHOLOGICAL = ["9^9^9^9^9", "9^{9^{9^{9^{9}}}}", "10^{10^{10}}", "(10^{100})!", "1" * 5000, "9" * 1999,
                "10^{10^{10}} - 10^{10^{10}} + 3", "\\sum_{k=1}^{1000} k^{k}", "\\prod_{k=1}^{3000} (1+\\frac{1}{k^2})"]


@pytest.mark.parametrize("in_thread", [False, True], ids=["main-thread", "other-thread"])
def test_math_is_bounded_in_time_on_pathological_answers(in_thread):
    def check():
        times = []
        for prediction in PATHOLOGICAL:
            start = time.perf_counter()
            assert math_reward(answer(prediction), "3", timeout_s=0.5) == 0.0
            times.append(time.perf_counter() - start)
        return times

    times = run_in_thread(check) if in_thread else check()
    assert max(times) < 0.5 + 1.0, dict(zip(PATHOLOGICAL, times, strict=True))


def test_math_scores_correctly_from_another_thread():
    assert run_in_thread(lambda: [math_reward(answer(p), "140") for p in ("140°", "\\frac{280}{2}", "141")]) == [
        1.0, 1.0, 0.0]


def test_an_overrunning_check_is_killed_and_the_next_one_works():
    assert math_reward(answer("1"), "2") == 0.0  # a child process is up
    start = time.perf_counter()
    assert math_reward(answer("\\sum_{k=1}^{1000} k^{k}"), "3", timeout_s=0.3) == 0.0
    assert time.perf_counter() - start < 1.3
    assert all(process.alive() for process in math_check._IDLE_PROCESSES)  # the overrunning one is gone
    assert math_reward(answer("\\frac{1}{2}"), "0.5") == 1.0


def test_the_size_screen_rejects_giant_exact_integers_before_sympy_builds_them():
    assert math_check._math_equal("3", "9^{9^{9^{9^{9}}}}") is False
    assert math_check._math_equal("3", "(10^{100})!") is False
    assert math_check._math_equal("2^{100}", "1267650600228229401496703205376") is True
    assert math_check._math_equal("10^{1000}", "10^{1000}") is True


# ---------------------------------------------------------------- labels


@pytest.mark.parametrize("prediction", ["rose", "Rose.", " ROSE ", "\"rose\"", "**rose**"])
def test_label_accepts_the_label_up_to_case_and_edge_punctuation(prediction):
    assert label_reward(answer(prediction), "rose") == 1.0


@pytest.mark.parametrize("prediction", ["pink rose", "Pink_Rose", "pink-rose", "pink  rose.", "PINK - ROSE"])
def test_label_treats_underscores_and_hyphens_as_spaces(prediction):
    assert label_reward(answer(prediction), "pink_rose") == 1.0
    assert label_reward(answer(prediction), ["tulip", "pink-rose"]) == 1.0


@pytest.mark.parametrize("prediction", ["rose", "pink", "roses", "a pink rose", "pink rose or tulip", "tulip"])
def test_label_does_not_count_substrings_or_other_labels(prediction):
    assert label_reward(answer(prediction), "pink rose") == 0.0


def test_label_accepts_listed_synonyms_only():
    assert label_reward(answer("rose"), ["pink rose", "rose"]) == 1.0
    assert label_reward(answer("flower"), ["pink rose", "rose"]) == 0.0
    assert label_reward(answer("rose"), []) == 0.0
    assert label_reward(answer("rose"), "pink rose, rose") == 0.0  # a str is one label, never split


@pytest.mark.parametrize("completion", ["<answer></answer>", "<answer> . </answer>", "<answer>_-_</answer>",
                                        "<answer><answer>rose</answer></answer>", "rose", "<answer>rose",
                                        *HUGE, *UNICODE])
def test_label_scores_empty_malformed_and_adversarial_answers_zero(completion):
    assert label_reward(completion, "rose") == 0.0
    assert label_reward(completion, ["", "rose"]) == 0.0  # an empty label matches nothing, not even ''


def test_label_counts_the_last_answer():
    assert label_reward("<answer>tulip</answer><answer>rose</answer>", "rose") == 1.0
    assert label_reward("<answer>rose</answer><answer>tulip</answer>", "rose") == 0.0


# ---------------------------------------------------------------- boxes


@pytest.mark.parametrize("text", [
    "[1, 2, 3, 4]", "[1,2,3,4]", " [ 1 , 2 , 3 , 4 ] ", "[1.0, 2.00, 3., 4e0]", "(1, 2), (3, 4)", "(1,2)(3,4)",
    '{"bbox_2d": [1, 2, 3, 4]}', '{"bbox_2d": [1, 2, 3, 4], "label": "cat"}',
    '[{"bbox_2d": [1, 2, 3, 4], "label": "cat"}]', '```json\n[{"bbox_2d": [1, 2, 3, 4], "label": "cat"}]\n```',
    "```\n[1, 2, 3, 4]\n```", "[[1, 2, 3, 4]]",
])
def test_parse_box_reads_every_documented_format(text):
    assert parse_box(text) == (1.0, 2.0, 3.0, 4.0)


def test_parse_box_handles_negative_and_float_coordinates():
    assert parse_box("[-10.5, -2, 3.25, +4]") == (-10.5, -2.0, 3.25, 4.0)
    assert parse_box("(-1, -1), (-0.5, -.25)") == (-1.0, -1.0, -0.5, -0.25)


@pytest.mark.parametrize("text", [
    "", "[]", "[1, 2, 3]", "[1, 2, 3, 4, 5]", "[3, 2, 1, 4]", "[1, 4, 3, 2]", "[1, 2, 1, 4]", "(3, 4), (1, 2)",
    "[NaN, 0, 1, 1]", "[0, 0, Infinity, 1]", "[0, 0, 1e999, 1]", "[true, 0, 1, 1]", '["0", "0", "1", "1"]',
    "box: [1, 2, 3, 4]", "[1, 2, 3, 4].", "[1, 2, 3, 4], [5, 6, 7, 8]", "[[1, 2, 3, 4], [5, 6, 7, 8]]",
    '[{"bbox_2d": [1, 2, 3, 4]}, {"bbox_2d": [5, 6, 7, 8]}]', '{"bbox": [1, 2, 3, 4]}', '{"bbox_2d": [1, 2, 3]}',
    '[{"label": "cat"}]', "[1, 2, 3, 4" , "[" * 2000, "[" * 100_000 + "]" * 100_000, "[1, 2, 3, " + "9" * 5000 + "]",
    "<answer>[1, 2, 3, 4]", "\U0001f600",
])
def test_parse_box_rejects_malformed_inverted_and_multiple_boxes(text):
    assert parse_box(text) is None


def test_box_iou_and_giou_match_hand_computed_values():
    a, b = [0, 0, 10, 10], [5, 5, 15, 15]
    assert box_iou(a, b) == pytest.approx(25 / 175)
    # intersection 5x5 = 25, union 100 + 100 - 25 = 175, enclosing box [0, 0, 15, 15] = 225 (not 20x20 = 400)
    assert box_giou(a, b) == pytest.approx(25 / 175 - (225 - 175) / 225)
    assert box_iou(a, a) == 1.0 and box_giou(a, a) == 1.0
    assert (box_iou([0, 0, 1, 1], [2, 2, 3, 3]), box_giou([0, 0, 1, 1], [2, 2, 3, 3])) == (0.0, pytest.approx(-7 / 9))
    assert (box_iou([0, 0, 1, 1], [1, 0, 2, 1]), box_giou([0, 0, 1, 1], [1, 0, 2, 1])) == (0.0, 0.0)  # touching
    assert box_iou(a, [2, 2, 4, 4]) == pytest.approx(0.04) and box_giou(a, [2, 2, 4, 4]) == pytest.approx(0.04)
    assert -1.0 < box_giou([0, 0, 1, 1], [1e6, 1e6, 1e6 + 1, 1e6 + 1]) < -0.999999


@pytest.mark.parametrize("bad", [[1, 1, 1, 1], [2, 2, 1, 1], [0, 0, math.nan, 1], [0, 0, math.inf, 1], [0, 0, 1],
                                 [0, 0, 1, 1, 1], None, "0011", [True, 0, 1, 1], ["a", 0, 1, 1], [10**400, 0, 1, 1]])
def test_invalid_boxes_score_zero_iou_and_minus_one_giou(bad):
    assert box_iou(bad, TARGET) == 0.0 and box_iou(TARGET, bad) == 0.0
    assert box_giou(bad, TARGET) == -1.0 and box_giou(TARGET, bad) == -1.0


def test_boxes_near_float_limits_give_no_nan():
    big = [0, 0, 1e308, 1e308]
    assert box_iou(big, big) == 1.0 and box_giou(big, big) == 1.0
    assert box_iou([-1e308, -1e308, 1e308, 1e308], [0, 0, 1e308, 1e308]) == pytest.approx(0.25)
    tiny = [0, 0, 1e-300, 1e-300]
    assert box_iou(tiny, tiny) == 1.0
    assert 0.0 <= box_iou(tiny, big) <= 1.0 and -1.0 <= box_giou(tiny, big) <= 1.0


def test_iou_and_giou_rewards():
    assert iou_reward(answer("[0, 0, 10, 10]"), TARGET) == 1.0 and giou_reward(answer("[0, 0, 10, 10]"), TARGET) == 2.0
    assert iou_reward(answer("[5, 5, 15, 15]"), TARGET) == pytest.approx(25 / 175)
    assert giou_reward(answer('[{"bbox_2d": [5, 5, 15, 15]}]'), TARGET) == pytest.approx(1 + 25 / 175 - 50 / 225)
    assert iou_reward(answer("(20, 20), (30, 30)"), TARGET) == 0.0
    assert giou_reward(answer("(20, 20), (30, 30)"), TARGET) == pytest.approx(1 - (900 - 200) / 900)
    assert iou_reward(answer("[0, 0, 10, 10]"), [5, 5, 1, 1]) == 0.0  # invalid target
    assert giou_reward(answer("[0, 0, 10, 10]"), [5, 5, 1, 1]) == 0.0
    # the last answer counts
    assert iou_reward("<answer>[20, 20, 30, 30]</answer><answer>[0, 0, 10, 10]</answer>", TARGET) == 1.0
    assert iou_reward("<answer>[0, 0, 10, 10]</answer><answer>[20, 20, 30, 30]</answer>", TARGET) == 0.0


@pytest.mark.parametrize("completion", ["<answer></answer>", "<answer><answer>[0, 0, 10, 10]</answer></answer>",
                                        "[0, 0, 10, 10]", "<answer>[0, 0, 10, 10]", "<answer>[10, 10, 0, 0]</answer>",
                                        "<answer>[0, 0, 10, 10] [0, 0, 10, 10]</answer>", *HUGE, *UNICODE])
def test_box_rewards_score_malformed_and_adversarial_completions_zero(completion):
    assert iou_reward(completion, TARGET) == 0.0
    assert giou_reward(completion, TARGET) == 0.0


# ---------------------------------------------------------------- properties of every reward


@pytest.mark.parametrize("completion", ["", "<answer></answer>", "<answer><answer>B</answer></answer>", *HUGE,
                                        *UNICODE])
def test_every_reward_stays_in_range_on_adversarial_input(completion):
    assert_in_range(each_reward(completion))


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_every_reward_stays_in_range_on_arbitrary_text(text):
    assert_in_range(each_reward(text))


@settings(max_examples=200, deadline=None)
@given(st.one_of(st.text(), TAG_SOUP, st.sampled_from(["B", "(B) red", "140°", "rose", "[0, 0, 10, 10]"])),
       st.sampled_from(["{}", "<answer>{}</answer>", "<think>x</think><answer>{}</answer>",
                        "<answer>{}</answer><answer>{}</answer>", "<answer><answer>{}</answer></answer>"]))
def test_every_reward_stays_in_range_on_text_wrapped_in_tags(text, template):
    assert_in_range(each_reward(template.replace("{}", text)))


COORD = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False)


@settings(max_examples=200, deadline=None)
@given(st.lists(COORD, min_size=4, max_size=4), st.lists(COORD, min_size=4, max_size=4))
@example([-5e-324, 0.0, 0.0, 2.0], [0.0, 0.0, 1.0, 1.0])  # a width that underflows at the box's scale: no box
def test_box_metrics_are_bounded_symmetric_and_ordered(a, b):
    iou, giou = box_iou(a, b), box_giou(a, b)
    assert 0.0 <= iou <= 1.0 and -1.0 <= giou <= 1.0 and giou <= iou + 1e-12
    assert iou == pytest.approx(box_iou(b, a)) and giou == pytest.approx(box_giou(b, a))
    if parse_box(str(a)) is not None:
        assert box_iou(a, a) == 1.0 and box_giou(a, a) == 1.0
        assert iou_reward(answer(str(a)), b) == pytest.approx(iou)
        assert giou_reward(answer(str(a)), b) == pytest.approx(giou + 1.0)
