"""The GUI grounding rewards against their authors' formulas: hand-worked cases, and a REFERENCE re-implementation
(in this file, written from reading the authors' code, not copied) of GUI-R1's `r1gui.py` (click accuracy and
`0.8 * accuracy + 0.2 * format`) and of GUI-G²'s `gaussian_grpo.py` (`gaussian_point_reward`,
`gaussian_plane_reward`, `format_reward`, numpy as it computes them); how answers are read in every form, and how
a family's frame is moved into pixels before scoring."""

from __future__ import annotations

import json
import math
import random
import re

import numpy as np
import pytest

from gpg_vl.data.task import get_task
from gpg_vl.errors import UserError
from gpg_vl.reward.gui import (
    GUI_REWARDS,
    Click,
    bhattacharyya,
    gaussian_coverage,
    gaussian_point,
    read_click,
    strictly_inside,
)

# ---------------------------------------------------------------------------------------------
# REFERENCE: GUI-R1's r1gui.py (click rows), re-implemented from its text
# ---------------------------------------------------------------------------------------------


def ref_r1gui_format(predict: str) -> float:
    if not re.fullmatch(re.compile(r"<think>.*?</think>\s*<answer>.*?</answer>", re.DOTALL), predict):
        return 0.0
    content = re.search(r"<answer>(.*?)</answer>", predict, re.DOTALL).group(1).strip()
    try:
        actions = eval(content)  # noqa: S307 - GUI-R1 evaluates its answer; these are the test's own strings
    except Exception:
        return 0.0
    if not isinstance(actions, list):
        return 0.0
    for action in actions:
        if not isinstance(action, dict) or {"action", "point", "input_text"} - set(action):
            return 0.0
        if not (isinstance(action["point"][0], int) and isinstance(action["point"][1], int)):
            return 0.0
    return 1.0


def ref_r1gui_accuracy(predict: str, ground_truth: str) -> float:
    truth = json.loads(ground_truth)
    found = re.search(r"<answer>(.*?)</answer>", predict, re.DOTALL)
    if not found:
        return 0.0
    content = found.group(1).strip()
    action = re.search(r"'action':\s*'(\w+)'", content)
    coord = re.search(r"\{.*\[(\d+),\s*(\d+)]\s*.*\}", content)
    if not action or action.group(1).lower() != truth["action"] or not coord:
        return 0.0
    x, y = int(coord.group(1)), int(coord.group(2))
    x1, y1, x2, y2 = truth["gt_bbox"]
    return 1.0 if (x1 < x < x2) and (y1 < y < y2) else 0.0


# ---------------------------------------------------------------------------------------------
# REFERENCE: GUI-G²'s gaussian_grpo.py, re-implemented from its text (numpy, as it computes)
# ---------------------------------------------------------------------------------------------
G2_BOX = r"\[(\s*-?\d*\.?\d+\s*),\s*(\s*-?\d*\.?\d+\s*),\s*(\s*-?\d*\.?\d+\s*),\s*(\s*-?\d*\.?\d+\s*)\]"


def ref_g2_point(pred, gt):
    alpha = 0.5
    pcx, pcy = (pred[0] + pred[2]) / 2, (pred[1] + pred[3]) / 2
    gcx, gcy = (gt[0] + gt[2]) / 2, (gt[1] + gt[3]) / 2
    sx, sy = alpha * (gt[2] - gt[0]), alpha * (gt[3] - gt[1])
    return round(math.exp(-0.5 * ((pcx - gcx) ** 2 / sx ** 2 + (pcy - gcy) ** 2 / sy ** 2)), 3)


def ref_g2_plane(pred, gt):
    alpha, eps = 0.5, 1e-8
    pred_mu = np.array([(pred[0] + pred[2]) / 2, (pred[1] + pred[3]) / 2])
    gt_mu = np.array([(gt[0] + gt[2]) / 2, (gt[1] + gt[3]) / 2])
    pred_cov = np.array([[((pred[2] - pred[0]) * alpha) ** 2, 0], [0, ((pred[3] - pred[1]) * alpha) ** 2]])
    gt_cov = np.array([[((gt[2] - gt[0]) * alpha) ** 2, 0], [0, ((gt[3] - gt[1]) * alpha) ** 2]])
    sigma = (pred_cov + gt_cov) / 2
    diff = pred_mu - gt_mu
    term1 = (1 / 8) * np.dot(diff.T, np.dot(np.linalg.inv(sigma + eps * np.eye(2)), diff))
    term2 = 0.5 * np.log(np.linalg.det(sigma) / np.sqrt(np.linalg.det(pred_cov) * np.linalg.det(gt_cov) + eps))
    return round(np.exp(-(term1 + term2)), 3)


def ref_g2_rewards(content: str, solution):
    match = re.search(G2_BOX, content.strip(), re.DOTALL)
    box = [float(match.group(i)) for i in range(1, 5)] if match else None
    fmt = 1.0 if re.fullmatch(r"\[\s*\d+\s*,\s*\d+\s*,\s*\d+\s*,\s*\d+\s*\]", content, re.DOTALL) else 0.0
    return (0.0 if box is None else ref_g2_point(box, solution), 0.0 if box is None else ref_g2_plane(box, solution),
            fmt)


# ---------------------------------------------------------------------------------------------
# hand-worked cases
# ---------------------------------------------------------------------------------------------
def test_gaussian_rewards_equal_the_hand_worked_values():
    target = (0.0, 0.0, 20.0, 10.0)  # centre (10, 5); sigma (10, 5)
    assert gaussian_point((10, 5), target) == 1.0
    assert gaussian_point((20, 5), target) == 0.607  # exp(-0.5 * 100 / 100)
    assert gaussian_point((10, 10), target) == 0.607  # exp(-0.5 * 25 / 25)
    assert gaussian_point((30, 5), target) == 0.135  # exp(-0.5 * 400 / 100)
    assert gaussian_coverage(target, target) == 1.0
    assert gaussian_coverage((10, 0, 30, 10), target) == 0.882  # D = (10^2 / 100) / 8 = 0.125
    # twice as wide, same left edge: D = 100 / 250 / 8 + ln(6250 / sqrt(400 * 25 * 100 * 25)) / 2 = 0.05 + 0.1116
    assert bhattacharyya((0, 0, 40, 10), target) == pytest.approx(0.05 + 0.5 * math.log(1.25), abs=1e-9)
    assert gaussian_coverage((0, 0, 40, 10), target) == 0.851
    # a point is a box of no size: D = ln(625 / sqrt(1e-8)) / 2 = 7.82, exp(-D) rounds to 0
    assert gaussian_coverage((10, 5, 10, 5), target) == 0.0
    assert GUI_REWARDS.get("gaussian_coverage")(Click((10, 5)), target) == 0.0
    assert GUI_REWARDS.get("gaussian_point")(Click((20, 5), (15, 0, 25, 10)), target) == 0.607  # a box: its centre


def test_point_in_box_is_gui_r1s_strict_check_and_weighs_0_8():
    box = (10.0, 10.0, 20.0, 20.0)
    assert strictly_inside((15, 15), box) and not strictly_inside((10, 15), box) and not strictly_inside((15, 20), box)
    reward = GUI_REWARDS.get("point_in_box")
    assert reward(Click((15, 15)), box) == 1.0 and reward(Click((20, 15)), box) == 0.0
    assert reward.weight == 0.8 and GUI_REWARDS.get("gaussian_point").weight == 1.0


def test_rewards_equal_gui_r1s_and_gui_g2s_own_functions_on_their_answers():
    task = get_task("gui")
    rng = random.Random(0)
    for _ in range(60):
        row = task.load("test")[rng.randrange(50)]
        x1, y1, x2, y2 = row["bbox"]
        x, y = rng.randint(x1 - 20, x2 + 20), rng.randint(y1 - 20, y2 + 20)
        if rng.random() < 0.2:
            x = x1  # an edge: GUI-R1 counts it out
        completion = f"<think> the element </think><answer>[{{'action': 'click', 'point': [{x}, {y}], " \
                     "'input_text': 'no input text'}]</answer>"
        truth = json.dumps({"action": "click", "gt_bbox": list(row["bbox"]), "input_text": "no input text"})
        ours = task.reward_components(completion, row)
        assert ours["point_in_box"] == ref_r1gui_accuracy(completion, truth)
        assert ours["format"] == ref_r1gui_format(completion) == 1.0
        expected = 0.8 * ref_r1gui_accuracy(completion, truth) + 0.2 * ref_r1gui_format(completion)
        assert task.reward(completion, row) == pytest.approx(expected)

    g2 = get_task("gui", rewards=["gaussian_point", "gaussian_coverage"], answer="box", format_weight=1.0)
    for _ in range(60):
        row = g2.load("test")[rng.randrange(50)]
        x1, y1, x2, y2 = row["bbox"]
        a, b = rng.randint(0, 440), rng.randint(0, 330)
        predicted = [a, b, min(448, a + rng.randint(1, 120)), min(336, b + rng.randint(1, 90))]
        if rng.random() < 0.3:
            predicted = [x1 + rng.randint(-8, 8), y1 + rng.randint(-8, 8), x2 + rng.randint(-8, 8), y2]
        content = "[" + ",".join(map(str, predicted)) + "]"
        point, plane, fmt = ref_g2_rewards(content, row["bbox"])
        ours = g2.reward_components(content, row)
        assert (ours["gaussian_point"], ours["gaussian_coverage"], ours["format"]) == (point, plane, fmt), content


# ---------------------------------------------------------------------------------------------
# reading answers; wrong formats
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, point, box", [
    ("(120, 45)", (120, 45), None),
    ("[120.5, 45]", (120.5, 45), None),
    ("click(start_box='(120,45)')", (120, 45), None),  # UI-TARS
    ("<point>120 45</point>", (120, 45), None),
    ("[{'action': 'click', 'point': [120, 45], 'input_text': 'no input text'}]", (120, 45), None),  # GUI-R1
    ('{"action": "left_click", "coordinate": [120, 45]}', (120, 45), None),  # a computer-use call
    ("[100, 40, 140, 50]", (120, 45), (100, 40, 140, 50)),  # GUI-G²'s box: its centre
    ("(100, 40), (140, 50)", (120, 45), (100, 40, 140, 50)),
])
def test_every_answer_form_reads_as_one_click(text, point, box):
    found = read_click(text)
    assert found.point == pytest.approx(point) and found.box == box and not found.refused


@pytest.mark.parametrize("text", ["the search button", "(1, 2) or (3, 4)", "[140, 50, 100, 40]", "", None,
                                  "(1, 2)" * 500])
def test_answers_without_exactly_one_click_read_as_none(text):
    assert read_click(text) is None


def test_refusals_and_points_off_the_image_score_zero_and_count_as_wrong_format():
    task = get_task("gui")
    row = task.load("test")[0]
    assert read_click("Not found.") == Click(None, refused=True)
    for answer in ("(-3, 10)", "(449, 10)", "(10, 336.5)", "nothing"):
        completion = f"<think> x </think><answer>{answer}</answer>"
        assert task.reward_components(completion, row) == {"point_in_box": 0.0, "format": 0.0, "accuracy": 0.0}
        assert task.metrics([row], [completion])["wrong_format"] == 1.0
    inside = "<think> x </think><answer>(448, 336)</answer>"  # the image's far corner is on it
    assert task.reward_components(inside, row)["format"] == 1.0
    assert task.reward_components(" " + inside, row)["format"] == 0.0  # GUI-R1 matches the completion as written


def test_rewards_are_picked_by_name_and_an_unknown_one_is_one_sentence():
    task = get_task("gui", rewards=["gaussian_point", "point_in_box"], weights={"gaussian_point": 2.0})
    assert task.reward_weights == {"gaussian_point": 2.0, "point_in_box": 0.8, "format": 0.2, "accuracy": 0.0}
    with pytest.raises(UserError, match="unknown task.options.rewards 'iou'; valid options: gaussian_coverage, "
                                        "gaussian_point, point_in_box"):
        get_task("gui", rewards=["iou"])
    with pytest.raises(UserError, match="weights names"):
        get_task("gui", weights={"format": 1.0})
    with pytest.raises(UserError, match="answer"):
        get_task("screenspot", answer="bbox")


# ---------------------------------------------------------------------------------------------
# the family's frame, moved into pixels before the rewards read it
# ---------------------------------------------------------------------------------------------
def test_families_move_every_click_form_into_original_pixels_once():
    from gpg_vl.models.qwen import Qwen2VLFamily, Qwen3VLFamily, QwenVLFamily

    size = (448, 336, 224, 168)  # original W, H; the resized image the model saw
    qwen25 = object.__new__(QwenVLFamily)  # the frame maths needs no processor
    for text, expected in (("<answer>(112, 84)</answer>", "<answer>(224, 168)</answer>"),
                           ("click(start_box='(10,20)')", "click(start_box='(20,40)')"),
                           ("<point>10 20</point>", "<point>20 40</point>"),
                           ("[1, 2, 3, 4]", "[2, 4, 6, 8]"),
                           ("(1, 2), (3, 4)", "(2, 4), (6, 8)"),  # one box, not two points: each number once
                           ("[{'action': 'click', 'point': [5, 6]}]", "[{'action': 'click', 'point': [10, 12]}]")):
        assert qwen25.completion_to_original(text, [size], points=True) == expected
    assert qwen25.completion_to_original("(112, 84)", [size]) == "(112, 84)"  # a box task leaves lone points
    for family_class in (Qwen2VLFamily, Qwen3VLFamily):  # the 0-1000 grid
        family = object.__new__(family_class)
        assert family.completion_to_original("<answer>(500, 250)</answer>", [size], points=True) == \
            "<answer>(224, 84)</answer>"
