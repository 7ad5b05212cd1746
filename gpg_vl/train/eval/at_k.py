"""Evaluation over k samples per row: mean@k, pass@k, maj@k and their standard errors (pure functions).

Each held-out row gets n completions (eval.samples = n), each with its `accuracy` reward a_ij in [0, 1]:

* ``mean@n`` = mean over rows of (1/n) sum_j a_ij: the expected accuracy of one sample (Mini-o3's Avg@n, verl's
  mean@N, lmms-eval's expected accuracy). With n = 1 and greedy decoding it is the greedy accuracy.
* ``pass@k`` for k in 1, 2, 4, ... n (and n): the unbiased estimator of Chen et al. (2021, "Evaluating Large
  Language Models Trained on Code"), per row ``1 - C(n - c, k) / C(n, k)`` with c the samples counted correct
  (accuracy reward 1, full marks), averaged over rows. At k = n it is 1 when any sample is correct, else 0; with
  n > k it is the probability that k samples drawn without replacement from the n hold a correct one.
* ``maj@n``: per row the accuracy of the majority answer (lmms-eval's consensus accuracy, verl's maj@N): the
  samples vote with their parsed answers (the task's `parsed_answer`, else the `<answer>` content, whitespace
  collapsed); samples without an answer do not vote. Tie rule: among the answers with the most votes, the one
  that came first (the lowest sample index) wins. The row scores the accuracy of the first sample giving the
  winning answer; a row where no sample answered scores 0.
* ``<metric>_stderr``: the standard error of the mean over rows, ``std(per-row values, ddof=1) / sqrt(rows)``
  (0 with one row): the n samples of a row are one cluster, so it measures the spread over questions.

Each is also given per category (`task.group_columns`: the value of each column), as ``mean@n/<value>``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

CORRECT = 1.0 - 1e-9  # an accuracy reward at least this counts as correct for pass@k (full marks)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Chen et al.'s unbiased pass@k for one problem: n samples, c of them correct. ``1 - C(n-c, k) / C(n, k)``,
    computed as ``1 - prod_{i = n-c+1}^{n} (1 - k / i)`` (no large binomials); 1.0 when n - c < k."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def majority(answers: Sequence[str | None]) -> int | None:
    """The index of the sample whose answer wins the vote (see the module doc's tie rule), None when no sample
    has an answer."""
    counts: dict[str, int] = {}
    first: dict[str, int] = {}
    for index, answer in enumerate(answers):
        if answer is None:
            continue
        counts[answer] = counts.get(answer, 0) + 1
        first.setdefault(answer, index)
    if not counts:
        return None
    best = max(counts.values())
    return min(first[answer] for answer, count in counts.items() if count == best)


def pass_ks(n: int) -> list[int]:
    """The k of the pass@k reported for n samples: the powers of 2 below n, and n."""
    return sorted({2 ** e for e in range(n.bit_length()) if 2 ** e < n} | {n})


def stderr(values: Sequence[float]) -> float:
    """The standard error of the mean of `values` (sample std, ddof 1); 0.0 for fewer than two."""
    if len(values) < 2:
        return 0.0
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1) / len(values))


def per_row(accuracy: Sequence[Sequence[float]], answers: Sequence[Sequence[str | None]]) -> dict[str, list[float]]:
    """accuracy, answers: [rows][n] -> {metric name: per-row values} for mean@n, pass@k and maj@n."""
    n = len(accuracy[0]) if accuracy else 1
    if any(len(scores) != n for scores in accuracy) or len(answers) != len(accuracy):
        raise ValueError("every row needs the same number of samples, with an answer per sample")
    values: dict[str, list[float]] = {f"mean@{n}": [sum(scores) / n for scores in accuracy]}
    correct = [sum(score >= CORRECT for score in scores) for scores in accuracy]
    for k in pass_ks(n):
        values[f"pass@{k}"] = [pass_at_k(n, c, k) for c in correct]
    winners = [majority(row_answers) for row_answers in answers]
    values[f"maj@{n}"] = [0.0 if w is None else scores[w] for w, scores in zip(winners, accuracy, strict=True)]
    return values


def at_k_metrics(accuracy: Sequence[Sequence[float]], answers: Sequence[Sequence[str | None]],
                 categories: Sequence[Sequence[str]] = ()) -> dict[str, float]:
    """mean@n, pass@k (k in `pass_ks(n)`), maj@n over every row, the standard errors of mean@n, pass@n and maj@n,
    and those three per category. accuracy, answers: [rows][n]; categories: [rows][the row's category values]."""
    if not accuracy:
        return {}
    n = len(accuracy[0])
    values = per_row(accuracy, answers)
    result = {name: sum(column) / len(column) for name, column in values.items()}
    headline = (f"mean@{n}", f"pass@{n}", f"maj@{n}")
    result.update({f"{name}_stderr": stderr(values[name]) for name in headline})
    groups: dict[str, list[int]] = {}
    for row, names in enumerate(categories):
        for name in names:
            groups.setdefault(str(name), []).append(row)
    for group, rows in sorted(groups.items()):
        for name in headline:
            result[f"{name}/{group}"] = sum(values[name][row] for row in rows) / len(rows)
    return result
