"""Multimodal rotary positions: the 3-D (time, height, width) position of every token of a Qwen-VL-style sequence.

A family's `position_ids` (models/family.py) is the one place that decides a sequence's positions; scoring, the HF
engine's decode loop and `generate`, prompt-once, packing, multi-turn prefill and the teacher all ask it. Families
whose vision runs transformers places as vLLM does call the model's own `get_rope_index` (`model_rope_index`);
the others compute them here (`mrope_positions`), as vLLM and the original models do.

The rule (vLLM 0.32 `get_mrope_input_positions`, vllm/model_executor/models/qwen2_vl.py and qwen2_5_vl.py): text
counts up by one per token; a vision run of merged grid (t, h, w) takes `start + (floor(i * interval), j, k)` for
its time index i, row j and column k, where `start` is where it begins and `interval` is a video's temporal step
(`tokens_per_second * second_per_grid_t` for Qwen2.5-VL, 1 otherwise); whatever follows a run (text or another
run) starts at the run's largest position plus one. Padding (attention mask 0) gets position 0, as transformers
gives it.

The difference from transformers (5.3 and later, up to 5.25 at least): its `get_rope_index` moves the start after
a vision run by `max(h, w)` only, which is the largest position plus one for an image (t = 1) but not for a video
whose temporal positions `(t - 1) * interval` reach past its height and width: then the text after the video
overlaps the video's last moments in transformers and not in vLLM. The original Qwen2.5-VL code placed it as
vLLM does (transformers PR 35569's docstring: "the text start position_ids as the max vision position_ids plus 1";
its example: temporal 0, 50, 100 for three patches, text from 101). docs/models.md#positions has the measured gaps.
"""

from __future__ import annotations

import inspect
from itertools import groupby

import torch
from torch import Tensor

from gpg_vl.models.batch import unwrap

TEXT, IMAGE, VIDEO = 0, 1, 2  # transformers' `mm_token_type_ids`


def runs(token_types: list[int]) -> list[tuple[int, int, int]]:
    """(type, first, end) of each run of equal token types, in order: [0, 0, 1, 1, 0] -> (0, 0, 2), (1, 2, 4),
    (0, 4, 5)."""
    out, at = [], 0
    for kind, group in groupby(token_types):
        length = len(list(group))
        out.append((kind, at, at + length))
        at += length
    return out


def vision_block(grid: tuple[int, int, int], start: int, interval: float = 1.0) -> Tensor:
    """Positions [3, t * h * w] of one vision run of merged grid (t, h, w) starting at `start`: time, row, column,
    in the token order of the run (time slowest); the time index scaled by `interval` and floored (vLLM's float64
    product, truncated)."""
    t, h, w = grid
    time = torch.arange(t, dtype=torch.long)  # [t]
    if interval != 1.0:
        time = (torch.arange(t, dtype=torch.float64) * interval).long()  # [t]
    block = torch.stack(torch.meshgrid(time, torch.arange(h), torch.arange(w), indexing="ij"))  # [3, t, h, w]
    return block.reshape(3, -1) + start  # [3, t * h * w]


def sequence_positions(token_types: list[int], grids: list[tuple[int, int, int]],
                       intervals: list[float]) -> Tensor:
    """Positions [3, L] of one unpadded sequence: `token_types` [L] (0 text, 1 image, 2 video), and for each of its
    vision runs in order, its merged grid and its temporal interval. Each run starts at the largest position before
    it plus one."""
    pieces, start, item = [], 0, 0
    for kind, first, end in runs(token_types):
        if kind == TEXT:
            piece = torch.arange(end - first).expand(3, -1) + start  # [3, n]
        else:
            grid = grids[item]
            if grid[0] * grid[1] * grid[2] != end - first:
                raise ValueError(f"a vision run of {end - first} tokens at {first} does not match its merged grid "
                                 f"{tuple(grid)}: the token types and the grids disagree.")
            piece = vision_block(grid, start, intervals[item])
            item += 1
        pieces.append(piece)
        start = int(piece.max()) + 1
    if item != len(grids):
        raise ValueError(f"the sequence holds {item} vision runs but {len(grids)} grids were given.")
    return torch.cat(pieces, dim=1) if pieces else torch.zeros(3, 0, dtype=torch.long)  # [3, L]


def mrope_positions(token_types: Tensor, attention_mask: Tensor, image_grids: Tensor | None,
                    video_grids: Tensor | None, video_intervals: list[float] | None = None) -> Tensor:
    """Positions [3, N, L] of a left-padded batch by the rule above.

    token_types [N, L] (0 text, 1 image, 2 video); attention_mask [N, L]; image_grids [I, 3] and video_grids
    [V, 3]: the merged grids (t, h, w) of the batch's images and videos in order, row after row; video_intervals
    [V]: each video's temporal step (None: 1 each)."""
    images = iter(image_grids.tolist() if image_grids is not None else [])
    videos = iter(video_grids.tolist() if video_grids is not None else [])
    steps = iter(video_intervals if video_intervals is not None else [])
    positions = torch.zeros(3, *token_types.shape, dtype=torch.long)  # [3, N, L]
    for row in range(token_types.shape[0]):
        kept = attention_mask[row].bool().cpu()  # [L]
        kinds = token_types[row].cpu()[kept].tolist()
        grids, intervals = [], []
        for kind, _, _ in runs(kinds):
            if kind == IMAGE:
                grids.append(tuple(next(images)))
                intervals.append(1.0)
            elif kind == VIDEO:
                grids.append(tuple(next(videos)))
                intervals.append(float(next(steps, 1.0)))
        positions[:, row, kept] = sequence_positions(kinds, grids, intervals)
    return positions.to(token_types.device)


def qwen_positions(config, inputs: dict[str, Tensor]) -> Tensor:
    """Positions [3, N, L] of a Qwen2-VL / Qwen2.5-VL batch (processor outputs) by vLLM's rule: each video's
    temporal step is `tokens_per_second * second_per_grid_ts` (Qwen2.5-VL), 1 where either is absent (Qwen2-VL)."""
    vision = getattr(config, "vision_config", config)
    merge = vision.spatial_merge_size
    per_second = getattr(vision, "tokens_per_second", None)
    videos = inputs.get("video_grid_thw")
    seconds = inputs.get("second_per_grid_ts")
    intervals = None
    if videos is not None and per_second is not None and seconds is not None:
        intervals = [float(second) * per_second for second in seconds.tolist()]  # float64, as vLLM's .item()

    def merged(grids: Tensor | None) -> Tensor | None:
        if grids is None:
            return None
        return torch.stack([grids[:, 0], grids[:, 1] // merge, grids[:, 2] // merge], dim=1)  # [n, 3]

    return mrope_positions(inputs["mm_token_type_ids"], inputs["attention_mask"], merged(inputs.get("image_grid_thw")),
                           merged(videos), intervals)


def model_rope_index(model, inputs: dict[str, Tensor]) -> Tensor:
    """The model's own `get_rope_index` positions [3, N, L], given whichever of the batch's inputs it takes."""
    rope_index = unwrap(model).model.get_rope_index
    accepted = inspect.signature(rope_index).parameters
    positions, _ = rope_index(**{key: value for key, value in inputs.items() if key in accepted})
    return positions


def text_positions(attention_mask: Tensor) -> Tensor:
    """Positions [N, L] of a left-padded text batch: the attention mask's count (0 on the padding)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # [N, L]
