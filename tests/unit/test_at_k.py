"""mean@k, pass@k (Chen et al.'s unbiased estimator), maj@k and their standard errors, on hand-worked cases and
against brute-force enumeration."""

import itertools
import math

import pytest

from gpg_vl.train.eval.at_k import at_k_metrics, majority, pass_at_k, pass_ks, stderr


@pytest.mark.parametrize(("n", "c", "k", "expected"), [
    (4, 0, 4, 0.0), (4, 1, 4, 1.0), (4, 4, 4, 1.0),  # k = n: 1 when any sample is right, else 0
    (4, 1, 1, 1 / 4), (4, 3, 1, 3 / 4),  # k = 1: the fraction right
    (4, 2, 2, 1 - 1 / 6),  # 1 - C(2, 2) / C(4, 2)
    (5, 2, 3, 1 - 1 / 10),  # 1 - C(3, 3) / C(5, 3)
    (10, 3, 2, 1 - 21 / 45),  # 1 - C(7, 2) / C(10, 2) = 8/15
    (10, 0, 3, 0.0), (10, 8, 3, 1.0),  # n - c < k: every draw of 3 holds a right one
])
def test_pass_at_k_by_hand(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize(("n", "c", "k"),
                         [(n, c, k) for n in range(1, 8) for c in range(n + 1) for k in range(1, n + 1)])
def test_pass_at_k_is_the_chance_that_k_of_the_n_samples_hold_a_right_one(n, c, k):
    samples = [True] * c + [False] * (n - c)
    draws = list(itertools.combinations(samples, k))
    assert pass_at_k(n, c, k) == pytest.approx(sum(any(d) for d in draws) / len(draws), abs=1e-12)
    assert pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k), abs=1e-12)


def test_pass_at_k_refuses_impossible_counts():
    for n, c, k in ((4, 5, 1), (4, 1, 5), (4, 1, 0)):
        with pytest.raises(ValueError):
            pass_at_k(n, c, k)


def test_majority_votes_with_answers_and_breaks_ties_by_the_first_seen():
    assert majority(["B", "C", "B", None]) == 0
    assert majority(["C", "B", "B", "C"]) == 0  # 2 - 2: C came first
    assert majority(["B", "C", "C", "B"]) == 0
    assert majority([None, "x", "y", "y"]) == 2  # no answer does not vote
    assert majority([None, None]) is None


def test_pass_ks_and_stderr():
    assert pass_ks(1) == [1] and pass_ks(4) == [1, 2, 4] and pass_ks(6) == [1, 2, 4, 6] and pass_ks(8) == [1, 2, 4, 8]
    assert stderr([1.0]) == 0.0 and stderr([0.5, 0.25]) == pytest.approx(0.125)  # std 0.1768 / sqrt(2)


def test_at_k_metrics_by_hand():
    # row 1: right on samples 0 and 3, answers B C C B (a 2 - 2 tie: B came first, and B is right) -> maj 1
    # row 2: right on sample 3 only, answers A A A D -> maj A, wrong -> 0
    accuracy = [[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 1.0]]
    answers = [["B", "C", "C", "B"], ["A", "A", "A", "D"]]
    metrics = at_k_metrics(accuracy, answers, [["x"], ["y"]])
    assert metrics["mean@4"] == pytest.approx((0.5 + 0.25) / 2)
    assert metrics["pass@1"] == pytest.approx(metrics["mean@4"])  # binary rewards: pass@1 = mean@k
    assert metrics["pass@2"] == pytest.approx((5 / 6 + 1 / 2) / 2)  # row 2: 1 - C(3, 2) / C(4, 2) = 1/2
    assert metrics["pass@4"] == 1.0 and metrics["maj@4"] == pytest.approx(0.5)
    assert metrics["mean@4_stderr"] == pytest.approx(0.125) and metrics["maj@4_stderr"] == pytest.approx(0.5)
    assert metrics["pass@4_stderr"] == 0.0
    assert (metrics["mean@4/x"], metrics["pass@4/x"], metrics["maj@4/x"]) == (0.5, 1.0, 1.0)
    assert (metrics["mean@4/y"], metrics["pass@4/y"], metrics["maj@4/y"]) == (0.25, 1.0, 0.0)


def test_a_continuous_accuracy_counts_as_right_for_pass_at_k_only_at_full_marks():
    metrics = at_k_metrics([[0.6, 1.0], [0.9, 0.8]], [["1", "2"], ["3", None]])
    assert metrics["mean@2"] == pytest.approx((0.8 + 0.85) / 2)
    assert metrics["pass@2"] == pytest.approx(0.5) and metrics["pass@1"] == pytest.approx(0.25)
    assert metrics["maj@2"] == pytest.approx((0.6 + 0.9) / 2)  # a 1 - 1 tie: the first sample's answer
