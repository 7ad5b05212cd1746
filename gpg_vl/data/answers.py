"""What a completion's answer and a box are, read the same way by the tasks' data checks (gpg_vl/data/task.py) and
by the rewards (gpg_vl/reward/primitives.py): the last complete `<answer>...</answer>`, and four finite numbers
x1 < x2, y1 < y2. Plain text and numbers: nothing here imports the rest of the package."""

from __future__ import annotations

import math

Box = tuple[float, float, float, float]  # (x1, y1, x2, y2) with x2 > x1 and y2 > y1


def extract_answer(completion: str) -> str | None:
    """The content of the last complete `<answer>...</answer>`, stripped; None when there is none."""
    # Same result as ANSWER_PATTERN.findall(completion)[-1].strip(), found with str.find: the regex rescans to
    # the end from every unclosed '<answer>', which is quadratic ('<answer>' * 200_000 takes minutes).
    last = None
    start = completion.find("<answer>")
    while start >= 0:
        end = completion.find("</answer>", start + 8)
        if end < 0:
            break
        last = (start + 8, end)
        start = completion.find("<answer>", end + 9)
    return completion[last[0]:last[1]].strip() if last else None


def as_box(values: object) -> Box | None:
    """Four finite numbers with x2 > x1 and y2 > y1 and an area that floats can hold, as a float tuple; None
    otherwise (inverted is rejected)."""
    try:
        if isinstance(values, (str, bytes)) or len(values) != 4 or any(isinstance(v, bool) for v in values):
            return None
        x1, y1, x2, y2 = (float(v) for v in values)
    except (TypeError, ValueError, OverflowError):
        return None
    if not all(math.isfinite(v) for v in (x1, y1, x2, y2)) or x2 <= x1 or y2 <= y1:
        return None
    scale = max(abs(x1), abs(y1), abs(x2), abs(y2))  # > 0, as x2 > x1
    if (x2 / scale - x1 / scale) * (y2 / scale - y1 / scale) <= 0.0:
        return None  # an area that underflows at the box's own scale ([-5e-324, 0, 0, 2]): no IoU with itself
    return x1, y1, x2, y2
