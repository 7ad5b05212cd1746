"""Video-R1's accuracy rewards per problem type, T-GRPO's bonus rule and VSI-Bench's scores, on hand-worked cases."""

import random

import pytest
import torch
from gpg_vl_tasks.videor1 import (
    free_form_reward,
    multiple_choice_reward,
    numerical_reward,
    ocr_reward,
    question_text,
    regression_reward,
    shuffle_frames,
    temporal_bonus,
)
from gpg_vl_tasks.vsibench import THRESHOLDS, mca_reward, mean_relative_accuracy, na_reward


def said(text):
    return f"<think> hmm </think><answer>{text}</answer>"


OPTIONS = ["A. dog", "B. cat", "C. bird"]


@pytest.mark.parametrize("answer, expected", [
    ("B", 1.0), ("(B)", 1.0), ("B.", 1.0), ("b", 1.0), ("B. cat", 1.0),
    ("cat", 0.0),  # the option's text alone: Video-R1 asks for the letter
    ("B. dog", 0.0), ("A", 0.0), ("B or C", 0.0), ("", 0.0), ("D", 0.0),
])
def test_multiple_choice_scores_the_option_letter(answer, expected):
    assert multiple_choice_reward(said(answer), "B", OPTIONS) == expected
    assert multiple_choice_reward("B", "B", OPTIONS) == 0.0  # no answer tag


@pytest.mark.parametrize("truth, answer, expected", [
    ("3", "3", 1.0), ("3", "03", 1.0), ("3", "4", 0.0),
    ("3", "3.0", 0.0),  # Video-R1: a decimal mark on one side only never matches
    ("1.004", "1.00", 1.0), ("1.004", "1.001", 1.0), ("1.004", "1.01", 0.0),  # rounded to 2 places: 1.0, 1.0, 1.01
    ("1,234.5", "1234.5", 1.0),  # both have a decimal mark; commas are dropped
    ("1,000", "1000", 0.0),  # ',' counts as a decimal mark (Video-R1)
    ("2.5", "two and a half", 0.0), ("2.5", "nan", 0.0),
])
def test_numerical_is_equality_after_rounding_to_two_places(truth, answer, expected):
    assert numerical_reward(said(answer), truth) == expected


@pytest.mark.parametrize("answer, expected", [
    ("the cat sat on the mat", 1.0),
    ("the cat sat on a mat", 5 / 6),  # one substitution in six words
    ("the cat", 1 / 3),  # four deletions
    ("The cat sat on the mat", 5 / 6),  # case is kept: 'The' is a substitution
    ("a b c d e f g h i j k l m n", 0.0),  # WER over 1 (insertions) is clipped
    ("", 0.0),
])
def test_ocr_is_one_minus_word_error_rate_clipped(answer, expected):
    assert ocr_reward(said(answer), "the cat sat on the mat") == pytest.approx(expected)


def test_free_form_is_the_mean_rouge_1_2_l_f1():
    # the cat sat on the mat / the cat lay on the mat: ROUGE-1 5/6 (the x2, cat, on, mat), ROUGE-2 3/5 (the-cat,
    # on-the, the-mat of 5 bigrams each), ROUGE-L 5/6 (LCS 'the cat on the mat'): mean 34/45.
    assert free_form_reward(said("the cat lay on the mat"), "the cat sat on the mat") == pytest.approx(34 / 45)
    assert free_form_reward(said("Running dogs"), "run dog") == pytest.approx(1.0)  # Porter stemming, lower case
    assert free_form_reward(said("nothing alike"), "the cat sat") == 0.0
    assert free_form_reward("no tags", "the cat sat") == 0.0


@pytest.mark.parametrize("truth, answer, expected", [
    ("10", "10", 1.0), ("10", "8", 0.8), ("10", "12.5", 0.75), ("10", "25", 0.0), ("10", "-10", 0.0),
    ("-4", "-3", 0.75), ("0", "0", 1.0), ("0", "0.1", 0.0), ("10", "ten", 0.0),
])
def test_regression_is_one_minus_relative_error_clipped(truth, answer, expected):
    assert regression_reward(said(answer), truth) == pytest.approx(expected)


def test_video_r1_prompt_lists_options_for_multiple_choice_only():
    text = question_text("Which animal?", "multiple choice", OPTIONS)
    assert text.startswith("Which animal?Options:\nA. dog\nB. cat\nC. bird\n\nPlease think about this question")
    assert text.endswith("Please provide only the single option letter (e.g., A, B, C, D, etc.) within the <answer> "
                         "</answer> tags.")
    assert question_text("How many?", "numerical", []).startswith("How many?\nPlease think")


# ---------------------------------------------------------------- T-GRPO

def bonus_loop(ordered, shuffled, bonus=0.3, ratio=0.8, right=0.1):
    """The rule written out, one completion at a time (Video-R1's trainer)."""
    if not shuffled or not ordered:
        return [0.0] * len(ordered)
    earned = sum(ordered) / len(ordered) >= ratio * (sum(shuffled) / len(shuffled))
    return [bonus if earned and score > right else 0.0 for score in ordered]


@pytest.mark.parametrize("ordered, shuffled, expected", [
    ([1.0, 0.0, 1.0, 0.05], [1.0, 0.0], [0.3, 0.0, 0.3, 0.0]),  # 0.5125 >= 0.8 * 0.5; 0.05 is not right
    ([0.2, 0.0, 0.0, 0.0], [1.0, 1.0], [0.0, 0.0, 0.0, 0.0]),  # 0.05 < 0.8: the shuffled frames did better
    ([0.4, 0.4], [0.5, 0.5], [0.3, 0.3]),  # exactly 0.8 times: earned
    ([0.0, 0.0], [0.0], [0.0, 0.0]),  # earned (0 >= 0), but nothing is right
    ([1.0, 0.5], [], [0.0, 0.0]),  # no shuffled rollout: no bonus
])
def test_temporal_bonus_hand_worked(ordered, shuffled, expected):
    got = temporal_bonus(torch.tensor(ordered), torch.tensor(shuffled))
    assert got.tolist() == pytest.approx(expected)
    assert got.tolist() == pytest.approx(bonus_loop(ordered, shuffled))


def test_temporal_bonus_matches_the_loop_on_random_groups():
    rng = random.Random(0)
    for _ in range(200):
        ordered = [rng.choice([0.0, 0.05, 0.5, 1.0]) for _ in range(rng.randint(1, 8))]
        shuffled = [rng.choice([0.0, 0.5, 1.0]) for _ in range(rng.randint(0, 4))]
        assert temporal_bonus(torch.tensor(ordered, dtype=torch.float64),
                              torch.tensor(shuffled, dtype=torch.float64)).tolist() == bonus_loop(ordered, shuffled)


def test_shuffled_frames_are_a_permutation_that_is_never_the_identity():
    frames = list("abcdefgh")
    for seed in range(50):
        shuffled = shuffle_frames(frames, seed)
        assert sorted(shuffled) == frames and shuffled != frames
        assert shuffle_frames(frames, seed) == shuffled  # the seed decides
    assert shuffle_frames(["a"], 3) == ["a"] and shuffle_frames([], 3) == []


# ---------------------------------------------------------------- VSI-Bench

def test_vsibench_thresholds_and_mean_relative_accuracy():
    assert THRESHOLDS.tolist() == pytest.approx([0.5 + 0.05 * k for k in range(10)])
    assert mean_relative_accuracy(10.0, 10.0) == 1.0
    assert mean_relative_accuracy(10.4, 10.0) == 1.0  # 0.04 <= 1 - 0.95
    assert mean_relative_accuracy(7.3, 10.0) == pytest.approx(0.5)  # 0.27 <= 1 - t for t = 0.50 .. 0.70
    assert mean_relative_accuracy(20.0, 10.0) == 0.0
    assert na_reward(said("7.3 meters"), "10") == pytest.approx(0.5)  # the first word is read
    assert na_reward(said("about 7"), "10") == 0.0 and na_reward("7.3", "10") == 0.0


def test_vsibench_multiple_choice_reads_the_first_word():
    assert mca_reward(said("B. the chair"), "B") == 1.0 and mca_reward(said("b"), "B") == 1.0
    assert mca_reward(said("A"), "B") == 0.0 and mca_reward(said("(B)"), "B") == 0.0  # as VSI-Bench reads it
