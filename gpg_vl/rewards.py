"""Reward primitives: answer extraction, format check and answer matching.

Every function here takes model output (any string) and never raises on it; each documents its range.
"""

from __future__ import annotations

import re

FORMAT_PATTERN = re.compile(r"<think>.*?</think>\s*<answer>.*?</answer>", re.DOTALL)
ANSWER_PATTERN = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def extract_answer(completion: str) -> str | None:
    """The content of the last complete `<answer>...</answer>`, stripped; None when there is none."""
    matches = ANSWER_PATTERN.findall(completion)
    return matches[-1].strip() if matches else None


def format_reward(completion: str) -> float:
    """1.0 if the completion fullmatches `<think>.*?</think>\\s*<answer>.*?</answer>` (DOTALL), else 0.0."""
    return 1.0 if FORMAT_PATTERN.fullmatch(completion.strip()) else 0.0


def normalize_text(text: str) -> str:
    """Lower-case, collapse whitespace, strip surrounding punctuation: 'Red.' -> 'red'."""
    return " ".join(text.lower().split()).strip(" .,:;!?\"'")


def exact_match_reward(completion: str, target: str) -> float:
    """1.0 if the extracted answer equals `target` after `normalize_text`, else 0.0 (0.0 with no answer tag)."""
    answer = extract_answer(completion)
    if answer is None or not normalize_text(answer):
        return 0.0
    return 1.0 if normalize_text(answer) == normalize_text(target) else 0.0
