"""Reward primitives: answer extraction, format check, and answer matching (text, choice, math, label, box).

Every function here takes model output (any string) and never raises on it; each documents its range.
The answer is always the content of the last complete `<answer>...</answer>` (`extract_answer`); a completion
without one scores 0 for accuracy. Answers longer than `_MAX_PARSE_CHARS` are not parsed (they score 0, except
where a plain string comparison decides), so a 1 MB completion costs a linear scan, not a parse.
"""

from __future__ import annotations

import json
import math
import re
import threading
from collections.abc import Sequence

from gpg_vl.data.answers import Box, as_box, extract_answer
from gpg_vl.reward.math_check import _math_check

FORMAT_PATTERN = re.compile(r"<think>.*?</think>\s*<answer>.*?</answer>", re.DOTALL)


ANSWER_PATTERN = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)




# No sensible final answer (a letter, a label, a box, a number) is longer; longer ones are not parsed at all.
_MAX_PARSE_CHARS = 2048


_SPACES = re.compile(r"\s*")  # the `\s*` of FORMAT_PATTERN, so both agree on what whitespace is


def first_answer(completion: str) -> str | None:
    """The content of the FIRST complete `<answer>...</answer>`, stripped; None when there is none.

    What `re.search(r"<answer>\\s*(.*?)\\s*</answer>", completion, re.DOTALL)` finds (Video-R1's reading), found
    with str.find: the content runs from the first '<answer>' to the first '</answer>' after it."""
    start = completion.find("<answer>")
    end = -1 if start < 0 else completion.find("</answer>", start + 8)
    return completion[start + 8:end].strip() if end >= 0 else None


def format_reward(completion: str, *, strip: bool = True) -> float:
    """1.0 if the completion fullmatches `<think>.*?</think>\\s*<answer>.*?</answer>` (DOTALL), else 0.0.

    `strip` (the default) strips surrounding whitespace first; `strip=False` matches the completion as it is
    (Video-R1's format reward: a leading space or newline fails)."""
    # Same result as FORMAT_PATTERN.fullmatch(completion.strip()), but linear: the regex backtracks to every
    # '</think>' and rescans to the end from each (quadratic on '<think></think><answer>' * 100_000).
    text = completion.strip() if strip else completion
    if not (text.startswith("<think>") and text.endswith("</answer>")):
        return 0.0
    latest_answer = len(text) - len("<answer></answer>")  # the last index '<answer>' may start at
    close = text.find("</think>", len("<think>"))
    while close >= 0:
        start = _SPACES.match(text, close + 8).end()  # whitespace runs after distinct '</think>' are disjoint
        if start <= latest_answer and text.startswith("<answer>", start):
            return 1.0
        close = text.find("</think>", close + 1)
    return 0.0


def normalize_text(text: str) -> str:
    """Lower-case, collapse whitespace, strip surrounding punctuation: 'Red.' -> 'red'."""
    return " ".join(text.lower().split()).strip(" .,:;!?\"'")


def exact_match_reward(completion: str, target: str) -> float:
    """1.0 if the extracted answer equals `target` after `normalize_text`, else 0.0 (0.0 with no answer tag)."""
    answer = extract_answer(completion)
    if answer is None or not normalize_text(answer):
        return 0.0
    return 1.0 if normalize_text(answer) == normalize_text(target) else 0.0


# Stripped from both ends of labels and option texts: sentence punctuation, quotes, brackets, markdown emphasis.
_EDGE_PUNCT = " .,:;!?\"'`*()[]{}\u201c\u201d\u2018\u2019\u00ab\u00bb\u3002\uff0c\uff01\uff1f\uff1a\uff1b"


_LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"


# A bare letter: 'B', 'b', '(B)', '[B]', 'B)', 'B.', 'B:', '(B).'
_LETTER_ONLY = re.compile(r"[(\[]?\s*([A-Za-z])\s*[)\]]?\s*[.:]?")


# A letter with a delimiter, then text: '(B) red', 'B. red', 'B) red', 'B: red'
_LETTER_TEXT = re.compile(r"[(\[]?\s*([A-Za-z])\s*(?:[)\]]\s*[.:]?|[.:])\s*(.+)", re.DOTALL)


def _text_key(text: str) -> str:
    """Lower-case, collapse whitespace, strip `_EDGE_PUNCT` at the ends."""
    return " ".join(text.lower().split()).strip(_EDGE_PUNCT)


def _label_key(text: str) -> str:
    """`_text_key` with '_' and '-' read as spaces: 'Pink_Rose' and 'pink-rose' -> 'pink rose'."""
    return _text_key(text.replace("_", " ").replace("-", " "))


def label_reward(completion: str, labels: str | list[str]) -> float:
    """1.0 if the answer equals the label or one of its listed synonyms (`_label_key`), else 0.0; range {0, 1}.

    A str is one label (never split). An empty answer scores 0, and a substring does not count:
    'rose' does not match 'pink rose' unless 'rose' is listed.
    """
    answer = extract_answer(completion)
    if answer is None or len(answer) > _MAX_PARSE_CHARS:
        return 0.0
    key = _label_key(answer)
    if not key:  # `"" in label` is true for every label: an empty answer must not match
        return 0.0
    candidates = [labels] if isinstance(labels, str) else labels
    return 1.0 if any(isinstance(c, str) and _label_key(c) == key for c in candidates) else 0.0


def _option_key(option: str, letter: str) -> str:
    """`_text_key` of an option's text, without its own letter prefix ('B. red' as option B -> 'red')."""
    prefixed = _LETTER_TEXT.fullmatch(option.strip())
    if prefixed and prefixed.group(1).upper() == letter:
        option = prefixed.group(2)
    return _text_key(option)


def choice_letter(text: str, choices: Sequence[str]) -> str | None:
    """The one option letter `text` names ('A' = choices[0]); None when it names none or several.

    Read in this order: a bare letter of an option ('B', 'b', '(B)', 'B.'); an option's text (case-,
    whitespace- and edge-punctuation-insensitive, so option 'I' of ['I', 'II'] is 'A'); a letter followed by
    that same option's text ('(B) red'). Anything else names no single option: 'A or B', '(A) (B)', 'A, B',
    '(B) <another option's text>', two option texts. Options past Z have no letter; with `choices` empty,
    letters A-Z are accepted (options known only by letter).
    """
    if len(text) > _MAX_PARSE_CHARS:
        return None
    letters = _LETTERS[: len(choices)] if choices else _LETTERS
    core = text.strip().strip("*`'\"").strip()  # markdown emphasis and quotes around the answer
    bare = _LETTER_ONLY.fullmatch(core)
    if bare and bare.group(1).upper() in letters:
        return bare.group(1).upper()
    keys = [_option_key(str(option), letter) for option, letter in zip(choices, letters, strict=False)]
    key = _text_key(core)
    named = [letter for letter, option_key in zip(letters, keys, strict=False) if key and option_key == key]
    if named:
        return named[0] if len(named) == 1 else None  # duplicate option texts: ambiguous
    prefixed = _LETTER_TEXT.fullmatch(core)
    if prefixed:
        letter = prefixed.group(1).upper()
        index = letters.find(letter)
        if 0 <= index < len(keys) and keys[index] and _text_key(prefixed.group(2)) == keys[index]:
            return letter
    return None


def choice_reward(completion: str, choices: Sequence[str], answer: str) -> float:
    """1.0 if the answer names the right option and only it (see `choice_letter`), else 0.0; range {0, 1}.

    `answer` is the right letter ('B', '(B)', 'B.') or the right option's text; an `answer` that names no
    single option makes every completion score 0.
    """
    right = choice_letter(answer, choices)
    predicted = extract_answer(completion)
    if right is None or predicted is None:
        return 0.0
    return 1.0 if choice_letter(predicted, choices) == right else 0.0


# '140°', '140^\circ', '140^{\circ}', '140\degree' all mean 140.
_DEGREES = re.compile(r"\^\s*\{\s*\\circ\s*\}|\^\s*\\circ|\\degree|°")


# Root and pi signs as GeoQA writes them, rewritten into LaTeX that math_verify reads: '2√{3}' and '2√3' ->
# '2\sqrt{3}', '√(3)' -> '\sqrt{3}', 'π' and the word 'pi' -> '\pi' (math_verify reads '2√{3}' as 2, '4pi' as 4ip).
_ROOT = re.compile(r"√\s*(?:(\{)|\(([^()]*)\)|(\d+(?:\.\d+)?|[A-Za-z])|)")  # √{ , √(x) , √3 , √x , √


_PI = re.compile(r"π|(?<![\\A-Za-z])pi(?![A-Za-z])")


# Units after a value (strip_units=True): length, area, time and angle words in English and Chinese, longest first
# (so '5mm' loses 'mm', not one 'm'), with an optional power ('cm²', 'cm^2', 'cm^{2}', GeoQA's 'cm^2^'), bare or
# in \text{} / \mathrm{}. Only at the very end, after a digit, '}', ')' or pi, so no variable inside is touched.
_UNIT_NAMES = ("平方厘米", "平方分米", "平方千米", "平方公里", "平方米", "立方厘米", "立方米", "厘米", "毫米", "分米",
               "千米", "公里", "海里", "米", "小时", "分钟", "秒", "度", "km", "dm", "cm", "mm", "m")


_POWER = r"(?:\^\s*\{\s*\d\s*\}|\^\s*\d\^?|[²³])"


_UNIT = rf"(?:{'|'.join(_UNIT_NAMES)})\s*{_POWER}?"


_UNIT_SUFFIX = re.compile(
    rf"(.*?(?:\d|\}}|\)|π|\\pi))(?:\s|\\[,;:! ]|~)*"
    rf"(?:\\(?:text|mathrm|rm|mbox)\s*\{{\s*{_UNIT}\s*\}}\s*{_POWER}?|{_UNIT})\s*",
    re.DOTALL,
)


def math_text(text: str, *, strip_units: bool = False) -> str:
    """An answer text as LaTeX that math_verify reads as written (both sides of `math_reward` go through it).

    Surrounding whitespace and `$` are stripped and degree marks removed ('$140^\\circ$' -> '140'); roots and pi
    become LaTeX ('2√{3}', '2√3' -> '2\\sqrt{3}'; '\\frac{4}{3}π', '4pi' -> '\\frac{4}{3}\\pi', '4\\pi'; '²' -> '^{2}');
    with `strip_units`, a unit at the end ('cm', 'm', 'mm', '米', '厘米', '海里', '平方米', '秒', '小时', 'cm²',
    'cm^{2}', 'cm^2^', '\\text{cm}', ...; see `_UNIT_NAMES`) is removed: '4πcm^{2}' -> '4\\pi'.
    """
    text = _DEGREES.sub("", text).strip().strip("$").strip()
    if len(text) > _MAX_PARSE_CHARS:  # never parsed: only a plain comparison can decide (keeps this linear)
        return text
    if strip_units:
        bare = _UNIT_SUFFIX.fullmatch(text)
        text = bare.group(1).strip() if bare else text
    text = _ROOT.sub(_root_latex, text)
    text = _PI.sub(lambda m: "\\pi ", text).replace("²", "^{2}").replace("³", "^{3}")
    return text.strip()


def _root_latex(match: re.Match) -> str:
    """'√{' -> '\\sqrt{' (its own brace closes it), '√(x)' / '√3' / '√x' -> '\\sqrt{x}', a bare '√' -> '\\sqrt'."""
    brace, inner, atom = match.groups()
    if brace:
        return "\\sqrt{"
    argument = inner if inner is not None else atom
    return "\\sqrt" if argument is None else "\\sqrt{" + argument.strip() + "}"


def math_reward(completion: str, ground_truth: str, *, timeout_s: float = 5.0, strip_units: bool = False) -> float:
    """1.0 if the answer is mathematically equal to `ground_truth` (math_verify), else 0.0; range {0, 1}.

    Both sides first go through `math_text` (degree marks, √ and π as LaTeX; units at the end removed with
    `strip_units`). Identical answers (ignoring whitespace) then score 1 without parsing. Otherwise both sides are
    parsed with `math_verify.parse` and compared with `math_verify.verify` in a child process, which is killed if it has
    not answered within `timeout_s` seconds (the call returns by then, from any thread; the first call in a
    process also spends about a second of it starting the child). Empty answers, answers over
    `_MAX_PARSE_CHARS`, expressions whose exact value would exceed `_MAX_DIGITS` digits, parse failures, errors
    and timeouts score 0.0.
    """
    answer = extract_answer(completion)
    if answer is None:
        return 0.0
    pred, gold = math_text(answer, strip_units=strip_units), math_text(ground_truth, strip_units=strip_units)
    if not pred or not gold:
        return 0.0
    if "".join(pred.split()) == "".join(gold.split()):
        return 1.0
    if max(len(pred), len(gold)) > _MAX_PARSE_CHARS or not timeout_s > 0:
        return 0.0
    return 1.0 if _math_check(gold, pred, min(timeout_s, threading.TIMEOUT_MAX)) is True else 0.0


_NUMBER = r"\s*([-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?)\s*"


_BRACKET_BOX = re.compile(rf"\[{_NUMBER},{_NUMBER},{_NUMBER},{_NUMBER}\]")  # [x1, y1, x2, y2]


_CORNER_BOX = re.compile(rf"\({_NUMBER},{_NUMBER}\)\s*(?:,\s*)?\({_NUMBER},{_NUMBER}\)")  # (x1, y1), (x2, y2)


_FENCE = re.compile(r"```(?:json)?\s*(.*?)\s*```", re.DOTALL)  # models often fence their JSON


def _json_box(obj: object) -> Box | None:
    """The box of `{"bbox_2d": [...]}`, `[x1, y1, x2, y2]`, or a list holding exactly one of those."""
    if isinstance(obj, list) and len(obj) == 1 and isinstance(obj[0], (dict, list)):
        obj = obj[0]  # Seg-Zero / VLM-R1: [{"bbox_2d": [...], "label": ...}]
    if isinstance(obj, dict):
        obj = obj.get("bbox_2d")
    if isinstance(obj, list) and all(isinstance(v, (int, float)) for v in obj):
        return as_box(obj)
    return None


def _unfenced(text: str) -> str | None:
    """`text` stripped and taken out of a ``` fence; None when it is over `_MAX_PARSE_CHARS`."""
    if len(text) > _MAX_PARSE_CHARS:
        return None
    text = text.strip()
    fenced = _FENCE.fullmatch(text)
    return fenced.group(1) if fenced else text


def parse_box(text: str) -> Box | None:
    """The one box `text` is, as (x1, y1, x2, y2) floats; None when it is not exactly one valid box.

    Accepted (the whole text, optionally in a ``` fence): `[x1, y1, x2, y2]`, `(x1, y1), (x2, y2)`,
    `{"bbox_2d": [x1, y1, x2, y2], ...}` and a JSON list holding one such dict. Several boxes are rejected
    (an answer must commit to one), as are inverted or empty boxes (x2 <= x1 or y2 <= y1: never swapped),
    non-finite numbers, text around the box and texts over `_MAX_PARSE_CHARS`.
    """
    text = _unfenced(text)
    if text is None:
        return None
    for pattern in (_BRACKET_BOX, _CORNER_BOX):
        match = pattern.fullmatch(text)
        if match:
            return as_box(match.groups())
    if not text.startswith(("{", "[")):
        return None
    try:
        return _json_box(json.loads(text))
    except (ValueError, RecursionError):  # invalid JSON, over-long int literal, deep nesting
        return None


def _box_areas(a: object, b: object) -> tuple[float, float, float] | None:
    """(intersection, union, enclosing box) areas of two boxes; None if either is not a valid box."""
    box_a, box_b = as_box(a), as_box(b)
    if box_a is None or box_b is None:
        return None
    # Scale coordinates into [-1, 1]: areas of boxes near float max would overflow to inf (inf / inf = NaN).
    scale = max(abs(v) for v in box_a + box_b)  # > 0: a valid box has x2 > x1
    ax1, ay1, ax2, ay2 = (v / scale for v in box_a)
    bx1, by1, bx2, by2 = (v / scale for v in box_b)
    inter = max(0.0, min(ax2, bx2) - max(ax1, bx1)) * max(0.0, min(ay2, by2) - max(ay1, by1))
    union = (ax2 - ax1) * (ay2 - ay1) + (bx2 - bx1) * (by2 - by1) - inter
    enclosing = (max(ax2, bx2) - min(ax1, bx1)) * (max(ay2, by2) - min(ay1, by1))
    if not (union > 0 and enclosing > 0):  # both boxes underflow to nothing next to a huge coordinate
        return None
    return inter, union, enclosing


def box_iou(a: Sequence[float], b: Sequence[float]) -> float:
    """Intersection over union of two (x1, y1, x2, y2) boxes; range [0, 1]; 0.0 if either box is invalid."""
    areas = _box_areas(a, b)
    if areas is None:
        return 0.0
    inter, union, _ = areas
    return min(1.0, max(0.0, inter / union))


def box_giou(a: Sequence[float], b: Sequence[float]) -> float:
    """Generalised IoU: IoU - (enclosing - union) / enclosing; range [-1, 1]; -1.0 if either box is invalid.

    -1 (the worst score) rather than 0, so an invalid box never beats a valid but distant one.
    """
    areas = _box_areas(a, b)
    if areas is None:
        return -1.0
    inter, union, enclosing = areas
    return min(1.0, max(-1.0, inter / union - (enclosing - union) / enclosing))


def iou_reward(completion: str, target_box: Sequence[float]) -> float:
    """IoU of the answer's box (`parse_box`) with `target_box`; range [0, 1]; 0.0 with no valid box."""
    answer = extract_answer(completion)
    box = None if answer is None else parse_box(answer)
    return 0.0 if box is None else box_iou(box, target_box)


def giou_reward(completion: str, target_box: Sequence[float]) -> float:
    """GIoU + 1 of the answer's box with `target_box`; range [0, 2]; 0.0 with no valid box (or target)."""
    answer = extract_answer(completion)
    box = None if answer is None else parse_box(answer)
    return 0.0 if box is None else box_giou(box, target_box) + 1.0


Point = tuple[float, float]  # (x, y)


def _as_point(values: object) -> Point | None:
    """Two finite numbers (not bools, not strings) as a float tuple; None otherwise."""
    if not isinstance(values, list) or len(values) != 2 or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        return None
    try:
        x, y = (float(v) for v in values)
    except OverflowError:  # an int literal too large for a float
        return None
    return (x, y) if math.isfinite(x) and math.isfinite(y) else None


def parse_box_point(text: str) -> tuple[Box, Point] | None:
    """Seg-Zero's answer `[{"bbox_2d": [x1, y1, x2, y2], "point_2d": [x, y]}]` as (box, point); None otherwise.

    Accepted (the whole text, optionally in a ``` fence): a JSON list holding exactly one object with both keys,
    or that object alone; other keys are ignored. The box must be valid (`as_box`: x2 > x1, y2 > y1, numbers
    only) and the point two finite numbers; several objects, missing keys, broken JSON and texts over
    `_MAX_PARSE_CHARS` give None.
    """
    text = _unfenced(text)
    if text is None:
        return None
    if not text.startswith(("{", "[")):
        return None
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError):
        return None
    if isinstance(obj, list) and len(obj) == 1:
        obj = obj[0]
    if not isinstance(obj, dict):
        return None
    values = obj.get("bbox_2d")
    box = as_box(values) if isinstance(values, list) and all(
        isinstance(v, (int, float)) for v in values) else None
    point = _as_point(obj.get("point_2d"))
    return None if box is None or point is None else (box, point)


def box_point_format_reward(completion: str) -> float:
    """1.0 if the completion has the `format_reward` shape and its answer is Seg-Zero's JSON (`parse_box_point`),
    else 0.0; range {0, 1}."""
    if format_reward(completion) == 0.0:
        return 0.0
    answer = extract_answer(completion)
    return 0.0 if answer is None or parse_box_point(answer) is None else 1.0


def point_inside(point: Sequence[float], mask: object = None, box: Sequence[float] | None = None) -> bool:
    """Whether the point (x, y), in pixels, lies on the mask, or inside `box` when there is no mask.

    `mask`: a compressed COCO RLE (`{"size": [h, w], "counts": bytes or str}`) or a 2-D array indexed
    [y, x]; the point is on pixel (floor(x), floor(y)), and a point outside the image is not inside.
    `box` (x1, y1, x2, y2): x1 <= x < x2 and y1 <= y < y2 (x2 and y2 are the far pixel edges).
    """
    x, y = float(point[0]), float(point[1])
    if not (math.isfinite(x) and math.isfinite(y)):
        return False
    if mask is None:
        return box is not None and box[0] <= x < box[2] and box[1] <= y < box[3]
    import numpy as np  # here, not at the top: the math child process loads this file and needs neither

    column, row = math.floor(x), math.floor(y)
    if isinstance(mask, dict):
        from pycocotools import mask as mask_utils

        height, width = (int(v) for v in mask["size"])
        if not (0 <= column < width and 0 <= row < height):
            return False
        counts = mask["counts"]
        rle = {"size": [height, width], "counts": counts.encode() if isinstance(counts, str) else counts}
        pixel = mask_utils.frPyObjects(np.array([[column, row, 1, 1]], dtype=np.float64), height, width)[0]
        return int(mask_utils.area(mask_utils.merge([rle, pixel], intersect=True))) > 0
    array = np.asarray(mask)
    return 0 <= row < array.shape[0] and 0 <= column < array.shape[1] and bool(array[row, column])


def point_in_mask_reward(completion: str, mask: object = None, box: Sequence[float] | None = None) -> float:
    """1.0 if the point of the answer (`parse_box_point`) lies on the ground-truth `mask`, or inside the
    ground-truth `box` when there is no mask (`point_inside`), else 0.0; range {0, 1}; 0.0 with no valid answer."""
    answer = extract_answer(completion)
    parsed = None if answer is None else parse_box_point(answer)
    return 0.0 if parsed is None else float(point_inside(parsed[1], mask, box))
