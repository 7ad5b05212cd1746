"""Seg-Zero's box + point answer: parsing, its format reward and the point-in-mask reward; right, wrong, malformed,
out-of-range and adversarial answers, and their ranges."""

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pycocotools import mask as mask_utils

from gpg_vl.reward.primitives import box_point_format_reward, parse_box_point, point_in_mask_reward, point_inside

# A 10 x 8 (width x height) L-shaped mask: rows 2-5 of columns 2-7, minus the corner rows 4-5 of columns 5-7.
MASK = np.zeros((8, 10), dtype=bool)
MASK[2:6, 2:8] = True
MASK[4:6, 5:8] = False
RLE = mask_utils.encode(np.asfortranarray(MASK.astype(np.uint8)))  # counts: bytes
RLE_STR = {"size": RLE["size"], "counts": RLE["counts"].decode()}  # counts: str, as read back from JSON
BOX = (2.0, 2.0, 8.0, 6.0)  # the mask's box, far edges exclusive
HUGE = ["<answer>" + "9" * 1_000_000 + "</answer>", "<think>" * 200_000, "<answer>[" * 100_000,
        "<think></think><answer>" + "[" * 100_000 + "</answer>"]


def seg_zero(box, point, extra="") -> str:
    return f'<think>ok</think><answer>[{{"bbox_2d": {json.dumps(box)}, "point_2d": {json.dumps(point)}{extra}}}]' \
           "</answer>"


def scores(completion: str) -> list[float]:
    return [box_point_format_reward(completion), point_in_mask_reward(completion, RLE, BOX),
            point_in_mask_reward(completion, RLE_STR), point_in_mask_reward(completion, MASK),
            point_in_mask_reward(completion, None, BOX)]


@pytest.mark.parametrize("text,expected", [
    ('[{"bbox_2d": [1, 2, 30, 40], "point_2d": [5, 6]}]', ((1.0, 2.0, 30.0, 40.0), (5.0, 6.0))),
    ('{"bbox_2d": [1, 2, 30, 40], "point_2d": [5.5, 6.25]}', ((1.0, 2.0, 30.0, 40.0), (5.5, 6.25))),
    ('```json\n[{"bbox_2d": [1, 2, 30, 40], "point_2d": [5, 6], "label": "cup"}]\n```',
     ((1.0, 2.0, 30.0, 40.0), (5.0, 6.0))),
    ('[{"point_2d": [-5, 60], "bbox_2d": [-1.5, 2, 30, 40]}]', ((-1.5, 2.0, 30.0, 40.0), (-5.0, 60.0))),
])
def test_parse_box_point_reads_seg_zeros_answer(text, expected):
    assert parse_box_point(text) == expected


@pytest.mark.parametrize("text", [
    "", "[1, 2, 30, 40]", '[{"bbox_2d": [1, 2, 30, 40]}]', '[{"point_2d": [5, 6]}]',  # a key missing
    '[{"bbox_2d": [1, 2, 30, 40], "point_2d": [5, 6]}, {"bbox_2d": [1, 2, 3, 4], "point_2d": [2, 3]}]',  # two
    '[{"bbox_2d": [30, 40, 1, 2], "point_2d": [5, 6]}]',  # inverted box
    '[{"bbox_2d": [1, 2, 30], "point_2d": [5, 6]}]', '[{"bbox_2d": [1, 2, 30, 40], "point_2d": [5, 6, 7]}]',
    '[{"bbox_2d": ["1", 2, 30, 40], "point_2d": [5, 6]}]', '[{"bbox_2d": [1, 2, 30, 40], "point_2d": ["5", 6]}]',
    '[{"bbox_2d": [1, 2, 30, 40], "point_2d": [true, 6]}]', '[{"bbox_2d": [1, 2, 30, 40], "point_2d": [NaN, 6]}]',
    '[{"bbox_2d": [1, 2, 30, 40], "point_2d": [Infinity, 6]}]', '[{"bbox_2d": [1, 2, 30, 40], "point_2d": 5}]',
    '[{"bbox_2d": [1, 2, 30, 40], "point_2d": [1' + "0" * 400 + ', 6]}]',  # an int no float holds
    '[{"bbox_2d": [1, 2, 30, 40], "point_2d": [5, 6]}', '[{"bbox_2d": [1, 2, 30, 40] "point_2d": [5, 6]}]',
    'the box is [{"bbox_2d": [1, 2, 30, 40], "point_2d": [5, 6]}]', "[" * 100_000, '"text"', "null",
])
def test_parse_box_point_rejects_broken_json_and_wrong_shapes(text):
    assert parse_box_point(text) is None


def test_format_needs_the_tags_and_the_json():
    assert box_point_format_reward(seg_zero([2, 2, 8, 6], [3, 3])) == 1.0
    assert box_point_format_reward(seg_zero([2, 2, 8, 6], [300, -3])) == 1.0  # format only: any point
    assert box_point_format_reward('<answer>[{"bbox_2d": [2, 2, 8, 6], "point_2d": [3, 3]}]</answer>') == 0.0
    assert box_point_format_reward("<think>ok</think><answer>(2,2),(8,6)</answer>") == 0.0  # the box-only answer
    assert box_point_format_reward(seg_zero([2, 2, 8, 6], [3, 3]).replace("]}]", "]}")) == 0.0  # broken JSON


@pytest.mark.parametrize("point,on_mask,in_box", [
    ([3, 3], 1.0, 1.0), ([2, 2], 1.0, 1.0),  # inside; the mask's first pixel
    ([7.9, 3.5], 1.0, 1.0),  # pixel (7, 3): the upper arm
    ([6, 5], 0.0, 1.0),  # in the box but on the cut-away corner: the mask decides
    ([8, 3], 0.0, 0.0),  # x = 8 is the box's far edge: outside
    ([1.99, 3], 0.0, 0.0), ([-1, 3], 0.0, 0.0), ([3, -0.5], 0.0, 0.0),  # left of, above the image
    ([10, 3], 0.0, 0.0), ([3, 8], 0.0, 0.0), ([1e300, 1e300], 0.0, 0.0),  # past the image
])
def test_point_reward_hand_cases(point, on_mask, in_box):
    completion = seg_zero([2, 2, 8, 6], point)
    assert point_in_mask_reward(completion, RLE, BOX) == on_mask
    assert point_in_mask_reward(completion, RLE_STR) == on_mask  # str counts, as read back from JSON
    assert point_in_mask_reward(completion, MASK) == on_mask  # a 2-D array
    assert point_in_mask_reward(completion, None, BOX) == in_box  # no mask: the box


def test_point_reward_without_a_target_or_a_valid_answer_is_zero():
    assert point_in_mask_reward(seg_zero([2, 2, 8, 6], [3, 3])) == 0.0  # neither mask nor box
    empty = mask_utils.encode(np.zeros((8, 10), dtype=np.uint8, order="F"))
    assert point_in_mask_reward(seg_zero([2, 2, 8, 6], [3, 3]), empty, BOX) == 0.0  # an empty mask wins
    assert point_in_mask_reward(seg_zero([8, 6, 2, 2], [3, 3]), RLE) == 0.0  # inverted box: no valid answer
    assert point_in_mask_reward("<answer>[3, 3]</answer>", RLE) == 0.0
    assert not point_inside((float("nan"), 3.0), MASK) and not point_inside((3.0, float("inf")), None, BOX)
    # the last answer counts
    two = seg_zero([2, 2, 8, 6], [0, 0]) + '<answer>[{"bbox_2d": [2, 2, 8, 6], "point_2d": [3, 3]}]</answer>'
    assert point_in_mask_reward(two, RLE) == 1.0


@pytest.mark.parametrize("completion", ["", "<answer></answer>", "<answer>[{}]</answer>", *HUGE,
                                        "<answer>\u0000\ud7ff\U0001f600</answer>", "<answer>{\"a\": 1e999}</answer>"])
def test_malformed_and_adversarial_completions_score_zero(completion):
    assert scores(completion) == [0.0] * 5


@settings(max_examples=200, deadline=None)
@given(st.one_of(st.text(), st.builds(seg_zero, st.lists(st.integers(-20, 20), min_size=4, max_size=4),
                                      st.lists(st.floats(allow_nan=True), min_size=0, max_size=3))))
def test_box_point_rewards_never_raise_and_stay_in_range(completion):
    assert all(isinstance(s, float) and s in (0.0, 1.0) for s in scores(completion))
