"""GUI grounding: reading a click from an answer, checking it against a target box, and the rewards of GUI-R1 and
GUI-G², registered by name (`task.options.rewards` of tasks/gui.py, screenspot.py, screenspot_pro.py).

Every function here works in original-image pixels: the model family has already moved the answer's coordinates
out of the model's frame (`Task.uses_points`, gpg_vl/models/points.py). A click is read (`read_click`) from the
one box or point the answer writes, in any form of models/points.py (a box is read as its centre, as ScreenSpot's
and GUI-G²'s evaluations do); an answer with no coordinates, or with several, is no click. A refusal ("not found",
"none", ...: `REFUSALS`) is read as such, for ScreenSpot-Pro's negative rows.

The rewards (`GUI_REWARDS`), each `reward(click, target) -> float` with the default `weight` the task uses, the
click given as a `Click` and the target as a box (x1, y1, x2, y2):

- `point_in_box` (GUI-R1, `r1gui.py`'s `r1gui_accuracy_reward` for a click): 1.0 when the click lies STRICTLY
  inside the box, `x1 < x < x2 and y1 < y < y2` (GUI-R1's comparison: a click on an edge scores 0), else 0.0;
  weight 0.8 (GUI-R1's `0.8 * accuracy + 0.2 * format`).
- `gaussian_point` (GUI-G², `gaussian_grpo.py`'s `gaussian_point_reward`): `exp(-((x - cx)^2 / sx^2 +
  (y - cy)^2 / sy^2) / 2)`, (cx, cy) the box's centre, sx = 0.5 x its width, sy = 0.5 x its height, rounded to 3
  decimals as GUI-G² rounds it; weight 1.
- `gaussian_coverage` (GUI-G², `gaussian_plane_reward`): `exp(-D)`, D the Bhattacharyya distance between the
  predicted and the true box seen as Gaussians (mean the centre, covariance diag((0.5 w)^2, (0.5 h)^2)):
  `D = (mu_p - mu_t)^T S^-1 (mu_p - mu_t) / 8 + ln(det S / sqrt(det S_p det S_t)) / 2`, S the mean of the two
  covariances, with GUI-G²'s 1e-8 added to S's diagonal before inverting it and under the square root; rounded
  to 3 decimals; weight 1. A point answer is a box of no size: its coverage is about 0.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from gpg_vl.config.names import GUI_REWARD_BUILTINS
from gpg_vl.data.answers import as_box
from gpg_vl.models.points import found_coordinates
from gpg_vl.registry import Registry
from gpg_vl.reward.primitives import Box, Point

MAX_ANSWER_CHARS = 2048  # longer answers are not read (no click)
# What a refusal says (the whole answer, lower-cased, stripped of punctuation): the target is not on the screen.
REFUSALS = ("none", "not found", "not present", "not on the screen", "not on screen", "no such element",
            "does not exist", "target does not exist", "the target does not exist", "element not found",
            "the element is not on the screen", "negative")
_SPACE = re.compile(r"\s+")
GUI_G2_EPS = 1e-8  # gaussian_plane_reward's eps


@dataclass(frozen=True)
class Click:
    """What an answer says: where it clicks (a box answer's centre), the box it gave, or that it refuses."""

    point: Point | None
    box: Box | None = None
    refused: bool = False


def read_click(text: str | None) -> Click | None:
    """The click `text` (an answer) writes: its one box or point (`found_coordinates`), or a refusal (`REFUSALS`);
    None when it writes no coordinates and no refusal, several, an inverted or empty box, or over
    `MAX_ANSWER_CHARS` characters."""
    if text is None or len(text) > MAX_ANSWER_CHARS:
        return None
    found = found_coordinates(text)
    if not found:
        words = _SPACE.sub(" ", text.lower()).strip(" .,:;!?\"'`*()[]{}")
        return Click(None, refused=True) if words in REFUSALS else None
    if len(found) != 1:
        return None
    kind, values = found[0]
    if kind == "point":
        return Click((values[0], values[1]))
    box = as_box(values)
    return None if box is None else Click(((box[0] + box[2]) / 2, (box[1] + box[3]) / 2), box)


def inside_image(point: Sequence[float], size: Sequence[float]) -> bool:
    """Whether (x, y) lies on an image of `size` (W, H), edges included, coordinates finite."""
    x, y = float(point[0]), float(point[1])
    return math.isfinite(x) and math.isfinite(y) and 0.0 <= x <= size[0] and 0.0 <= y <= size[1]


def strictly_inside(point: Sequence[float], box: Sequence[float]) -> bool:
    """GUI-R1's hit: x1 < x < x2 and y1 < y < y2 (an edge is outside)."""
    return box[0] < point[0] < box[2] and box[1] < point[1] < box[3]


def normalized_hit(point: Sequence[float], box: Sequence[float], size: Sequence[float]) -> bool:
    """ScreenSpot's and ScreenSpot-Pro's hit: the box and the point both divided by the image size (W, H), then
    `x1 <= x <= x2 and y1 <= y <= y2` (every edge inside), compared in those normalised numbers as their code does."""
    width, height = float(size[0]), float(size[1])
    x, y = point[0] / width, point[1] / height
    x1, y1, x2, y2 = box[0] / width, box[1] / height, box[2] / width, box[3] / height
    return x1 <= x <= x2 and y1 <= y <= y2


def gaussian_point(point: Sequence[float], target: Sequence[float]) -> float:
    """GUI-G²'s Gaussian point reward of a click (see the module doc), rounded to 3 decimals."""
    sx, sy = 0.5 * (target[2] - target[0]), 0.5 * (target[3] - target[1])
    cx, cy = (target[0] + target[2]) / 2, (target[1] + target[3]) / 2
    exponent = -0.5 * ((point[0] - cx) ** 2 / sx ** 2 + (point[1] - cy) ** 2 / sy ** 2)
    return round(math.exp(exponent), 3)


def bhattacharyya(predicted: Sequence[float], target: Sequence[float], eps: float = GUI_G2_EPS) -> float:
    """The Bhattacharyya distance of two boxes seen as axis-aligned Gaussians (GUI-G²'s, eps as it adds it)."""
    pvx, pvy = (0.5 * (predicted[2] - predicted[0])) ** 2, (0.5 * (predicted[3] - predicted[1])) ** 2
    tvx, tvy = (0.5 * (target[2] - target[0])) ** 2, (0.5 * (target[3] - target[1])) ** 2
    ax, ay = (pvx + tvx) / 2, (pvy + tvy) / 2  # the mean covariance, diagonal
    dx = (predicted[0] + predicted[2]) / 2 - (target[0] + target[2]) / 2
    dy = (predicted[1] + predicted[3]) / 2 - (target[1] + target[3]) / 2
    mahalanobis = dx * dx / (ax + eps) + dy * dy / (ay + eps)
    return mahalanobis / 8 + 0.5 * math.log(ax * ay / math.sqrt(pvx * pvy * tvx * tvy + eps))


def gaussian_coverage(box: Sequence[float], target: Sequence[float]) -> float:
    """GUI-G²'s Gaussian coverage ("plane") reward of a predicted box (see the module doc), rounded to 3 decimals;
    0.0 where GUI-G²'s own computation fails (the logarithm of 0: two boxes both of no width or height)."""
    try:
        return round(math.exp(-bhattacharyya(box, target)), 3)
    except (ValueError, ZeroDivisionError, OverflowError):
        return 0.0


# ---------------------------------------------------------------- rewards, picked by name
GUI_REWARDS = Registry("GUI grounding reward", "task.options.rewards", builtins=GUI_REWARD_BUILTINS)


@GUI_REWARDS.register("point_in_box", weight=0.8)
def point_in_box_reward(click: Click, target: Box) -> float:
    """GUI-R1's accuracy of a click: 1.0 strictly inside the target box, else 0.0."""
    return float(click.point is not None and strictly_inside(click.point, target))


@GUI_REWARDS.register("gaussian_point", weight=1.0)
def gaussian_point_reward(click: Click, target: Box) -> float:
    """GUI-G²'s Gaussian point reward of the click (a box answer's centre)."""
    return 0.0 if click.point is None else gaussian_point(click.point, target)


@GUI_REWARDS.register("gaussian_coverage", weight=1.0)
def gaussian_coverage_reward(click: Click, target: Box) -> float:
    """GUI-G²'s Gaussian coverage reward of the answer's box (a point answer: a box of no size at the point)."""
    if click.point is None:
        return 0.0
    box = click.box if click.box is not None else (*click.point, *click.point)
    return gaussian_coverage(box, target)
