"""Coordinates written in a completion's text (boxes and points), found in one pass, and rewritten from a model
family's frame into original-image pixels.

A grounding answer writes a box, `[x1, y1, x2, y2]` or `(x1, y1), (x2, y2)`, or a point: `(x, y)`, `[x, y]`,
`<point>x y</point>`, and so the point inside UI-TARS' `click(start_box='(x,y)')`, GUI-R1's `'point': [x, y]`, a
computer-use call's `"coordinate": [x, y]` or Seg-Zero's `"point_2d": [x, y]`. `COORDINATES` finds each of them
left to right, a box before the pairs inside it, so that every number is read, and rewritten, exactly once:
`(1, 2), (3, 4)` is one box, never two points. `Family.completion_to_original(text, sizes, points=True)`
(models/family.py) rewrites through `coordinates_to_original`; gpg_vl/reward/gui.py reads the answer with the
same patterns.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

NUMBER = r"(-?\d+(?:\.\d+)?)"
_N = NUMBER
SHAPES = {  # name -> pattern, tried in this order at each position (a box before the pairs it holds)
    "box": rf"\[\s*{_N}\s*,\s*{_N}\s*,\s*{_N}\s*,\s*{_N}\s*\]",  # [x1, y1, x2, y2]
    "corners": rf"\(\s*{_N}\s*,\s*{_N}\s*\)\s*,\s*\(\s*{_N}\s*,\s*{_N}\s*\)",  # (x1, y1), (x2, y2)
    "point_tag": rf"<point>\s*{_N}\s+{_N}\s*</point>",  # <point>x y</point>
    "point": rf"[\[(]\s*{_N}\s*,\s*{_N}\s*[\])]",  # (x, y) or [x, y]
}
COORDINATES = re.compile("|".join(f"(?P<{name}>{pattern})" for name, pattern in SHAPES.items()))
_NUMBER = re.compile(NUMBER)


def format_number(value: float) -> str:
    """Two decimals at most, none when they are zero: 50.0 -> '50', 12.345 -> '12.35'."""
    text = f"{value:.2f}".rstrip("0").rstrip(".")
    return "0" if text == "-0" else text


def found_coordinates(text: str) -> list[tuple[str, list[float]]]:
    """Every box and point written in `text`, left to right: ("box", [x1, y1, x2, y2]) for either box form,
    ("point", [x, y]) for any point form."""
    found = []
    for match in COORDINATES.finditer(text):
        kind = "box" if match.lastgroup in ("box", "corners") else "point"
        found.append((kind, [float(v) for v in _NUMBER.findall(match.group(0))]))
    return found


def coordinates_to_original(text: str, to_original: Callable[[Sequence[float]], Sequence[float]]) -> str:
    """`text` with every box and point rewritten by `to_original` (four values x1, y1, x2, y2 to four; a point
    goes through as the box (x, y, x, y)), each number written by `format_number`; the rest of the text as it was."""

    def rewrite(match: re.Match) -> str:
        values = [float(v) for v in _NUMBER.findall(match.group(0))]
        converted = to_original(values) if len(values) == 4 else to_original(values * 2)[:2]
        numbers = iter(format_number(v) for v in converted)
        return _NUMBER.sub(lambda _: next(numbers), match.group(0))

    return COORDINATES.sub(rewrite, text)
