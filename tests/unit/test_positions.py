"""models/positions.py: the multimodal rotary positions vLLM gives a Qwen-VL sequence, as a pure function.

- hand-worked: the Qwen2.5-VL docstring's video (three temporal patches 50 apart: temporal 0, 50, 100, text from
  101); text, an image, text (the image's start, then its largest position plus one);
- a slow reference (one token at a time) on random batches of text, images and videos with left padding;
- edges: a fractional temporal step is floored per patch; a sequence that is only a video; a row of padding only;
  grids that do not match the token types fail in one sentence;
- docs/models.md's script prints what the page says (transformers' placement here; tests/integration/
  test_positions_vllm.py runs it in the vLLM environment, where it prints vLLM's too).
(tests/integration/test_positions_vllm.py compares the families' positions with vLLM's own function.)
"""

from __future__ import annotations

import contextlib
import io
import math
import random

import pytest
import torch
import transformers
from helpers.positions_cases import docs_script

from gpg_vl.models.positions import mrope_positions, sequence_positions, vision_block


def test_the_qwen2_5_vl_docstring_video_runs_0_50_100_and_the_text_starts_at_101():
    # 3 temporal patches of 2 x 2 merged tokens; fps 1, 25 tokens per second, 2 frames a patch: a step of 50
    positions = sequence_positions([2] * 12 + [0] * 3, [(3, 2, 2)], [50.0])  # [3, 15]
    assert positions[0].tolist() == [0] * 4 + [50] * 4 + [100] * 4 + [101, 102, 103]
    assert positions[1].tolist() == [0, 0, 1, 1] * 3 + [101, 102, 103]
    assert positions[2].tolist() == [0, 1, 0, 1] * 3 + [101, 102, 103]


def test_text_an_image_and_text_by_hand():
    # "ab", an image of 2 x 3 merged tokens from position 2, then "c" at its largest position (2 + 2) plus one
    positions = sequence_positions([0, 0, 1, 1, 1, 1, 1, 1, 0], [(1, 2, 3)], [1.0])  # [3, 9]
    assert positions.tolist() == [[0, 1, 2, 2, 2, 2, 2, 2, 5],
                                  [0, 1, 2, 2, 2, 3, 3, 3, 5],
                                  [0, 1, 2, 3, 4, 2, 3, 4, 5]]


def slow_positions(kinds: list[int], grids: list[tuple], intervals: list[float]) -> list[list[int]]:
    """One token at a time: a vision token's (time, row, column) from its index in its run; every run starts after
    the largest position so far."""
    out, largest, item, at = [], -1, -1, 0
    while at < len(kinds):
        if kinds[at] == 0:
            largest += 1
            out.append([largest] * 3)
            at += 1
            continue
        item += 1
        (t, h, w), start = grids[item], largest + 1
        for index in range(t * h * w):
            time, rest = divmod(index, h * w)
            row, column = divmod(rest, w)
            out.append([start + math.floor(time * intervals[item]), start + row, start + column])
        largest = max(max(p) for p in out)
        at += t * h * w
    return [list(axis) for axis in zip(*out, strict=True)] if out else [[], [], []]


def random_row(rng: random.Random) -> tuple[list[int], list[tuple], list[float]]:
    kinds, grids, intervals = [], [], []
    for _ in range(rng.randint(1, 4)):
        kinds += [0] * rng.randint(1, 4)
        if rng.random() < 0.7:
            video = rng.random() < 0.5
            grid = (rng.randint(1, 5) if video else 1, rng.randint(1, 3), rng.randint(1, 3))
            kinds += [2 if video else 1] * (grid[0] * grid[1] * grid[2])
            grids.append(grid)
            intervals.append(rng.choice([1.0, 2.0, 8.0, 4 * 2 / 3, 0.5]) if video else 1.0)
    return kinds, grids, intervals


def test_a_random_left_padded_batch_equals_the_slow_reference():
    rng = random.Random(0)
    rows = [random_row(rng) for _ in range(12)]
    width = max(len(kinds) for kinds, _, _ in rows) + 2
    types = torch.zeros(len(rows), width, dtype=torch.long)  # [N, L]
    mask = torch.zeros(len(rows), width, dtype=torch.long)  # [N, L]
    images, videos, steps = [], [], []
    for n, (kinds, grids, intervals) in enumerate(rows):
        types[n, width - len(kinds):] = torch.tensor(kinds)
        mask[n, width - len(kinds):] = 1
        kinds_of_runs = [k for i, k in enumerate(kinds) if k and (i == 0 or kinds[i - 1] != k)]
        for kind, grid, interval in zip(kinds_of_runs, grids, intervals, strict=True):
            (videos if kind == 2 else images).append(grid)
            if kind == 2:
                steps.append(interval)
    positions = mrope_positions(types, mask, torch.tensor(images) if images else None,
                                torch.tensor(videos) if videos else None, steps)  # [3, N, L]
    for n, (kinds, grids, intervals) in enumerate(rows):
        assert positions[:, n, width - len(kinds):].tolist() == slow_positions(kinds, grids, intervals)
        assert positions[:, n, :width - len(kinds)].eq(0).all()  # padding at 0, as transformers leaves it


def test_a_fractional_step_is_floored_per_patch_and_a_lone_video_needs_no_text():
    # 3 fps, 2 frames a patch, 4 tokens per second: 8/3 positions a patch -> 0, 2, 5, 8 (floored, not rounded)
    block = vision_block((4, 1, 1), start=10, interval=4 * 2 / 3)  # [3, 4]
    assert block[0].tolist() == [10, 12, 15, 18] and block[1:].eq(10).all()
    assert sequence_positions([2, 2, 2, 2], [(4, 1, 1)], [4 * 2 / 3])[0].tolist() == [0, 2, 5, 8]


def test_a_row_of_padding_only_is_all_zero():
    types, mask = torch.zeros(2, 3, dtype=torch.long), torch.tensor([[0, 0, 0], [0, 1, 1]])
    positions = mrope_positions(types, mask, None, None)  # [3, 2, 3]
    assert positions[:, 0].eq(0).all() and positions[:, 1].tolist() == [[0, 0, 1]] * 3


def test_grids_that_do_not_match_the_token_types_fail_in_one_sentence():
    with pytest.raises(ValueError, match=r"a vision run of 3 tokens at 1 does not match its merged grid \(1, 2, 2\)"):
        sequence_positions([0, 1, 1, 1, 0], [(1, 2, 2)], [1.0])
    with pytest.raises(ValueError, match="holds 1 vision runs but 2 grids were given"):
        sequence_positions([0, 1, 0], [(1, 1, 1), (1, 1, 1)], [1.0, 1.0])


def test_the_docs_script_prints_what_the_page_says_here():
    """Here (no vLLM) it prints transformers' placement, as the page shows it, and says where vLLM's comes from."""
    script, printed = docs_script()
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit, match="vLLM: not installed here"):
        exec(compile(script, "docs/models.md", "exec"), {"__name__": "__main__"})  # noqa: S102
    (line,) = out.getvalue().splitlines()
    assert line.startswith(f"transformers {transformers.__version__}: ") and line in printed.splitlines()
