"""`lisa`: reasoning grounding on ReasonSeg (LISA), the paper's fourth experiment: a query -> one box.

Rows have ReasonSeg's published columns `image`, `text` (the query) and `mask`, plus optionally `image_id`,
`ann_id`, `img_height`, `img_width`. The target is the box of the ground-truth mask, so a row's mask may come as
- a 2-D array (nested lists of bool or 0/1, or a numpy array), as in the Hub copies;
- COCO RLE: a dict with `size` [height, width] and `counts` (compressed string/bytes or a list of run lengths);
- polygons: a list of flat [x1, y1, x2, y2, ...] lists (or one flat list), which needs `img_height`/`img_width`;
- a PIL image (non-zero pixels are the object).
All are turned into one COCO RLE with pycocotools; its `toBbox` (x, y, w, h) gives the target box
(x, y, x + w, y + h) in original-image pixels: x2 and y2 are exclusive, the pixel edges, so a one-pixel mask at
(3, 4) has the box (3, 4, 4, 5). A mask of several parts gives the box around all of them.

A row whose mask is empty has no target box (`box` None): every completion scores 0 for accuracy (the group
then gives no accuracy signal), its target reads "none", and `miou` leaves the row out.

Splits: `validation` (or `val`) and `test` load the Hub copies `Ricky06662/ReasonSeg_val` and
`Ricky06662/ReasonSeg_test` (both publish their rows as their split "test"); ReasonSeg train (239 images) has
no published Hub copy, so `train` needs `data.path=`. With `data.path=` every split comes from there.

Boxes: `uses_boxes` is set, so the model family rewrites a completion's boxes (and Seg-Zero points) from the
model's frame into original pixels before the rewards see it; rewards and targets here are in original pixels.

Answers (option `answer`):
- "box" (the paper's): the Visual-RFT prompt, `<answer>(x1,y1),(x2,y2)</answer>`; rewards `accuracy` (IoU of
  the answer's box with the target box, or GIoU + 1 with `reward="giou"`) and `format` (think/answer tags);
- "box_points" (Seg-Zero's): `<answer>[{"bbox_2d": [x1,y1,x2,y2], "point_2d": [x,y]}]</answer>`; rewards
  `accuracy` (as above, on bbox_2d), `point` (1 when point_2d lies on the ground-truth mask) and `format` (the
  tags and that JSON).

Metrics: the reward means; `miou`, the box mIoU over rows with a target box; and, when a segmenter is set
(`segmenter=` of scripts/eval.py, see gpg_vl/reward/segment.py), `mask_giou` and `mask_ciou` over every row, ReasonSeg's
gIoU and cIoU of the segmenter's masks of the predicted boxes. Predicted boxes are clipped to the image for the
metrics; a completion without a box has an empty mask.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from PIL import Image
from pycocotools import mask as mask_utils

from gpg_vl.data.sources import RowView, load_rows
from gpg_vl.data.task import Task, image_question, register_task, require_text, row_name
from gpg_vl.errors import BadRow, UserError
from gpg_vl.reward.primitives import (
    Box,
    box_iou,
    box_point_format_reward,
    extract_answer,
    format_reward,
    giou_reward,
    iou_reward,
    parse_box,
    point_in_mask_reward,
)
from gpg_vl.reward.segment import Segmenter, clip_box, intersection_union, mask_metrics

# split -> (Hub id, the split name there)
HUB_SPLITS = {
    "validation": ("Ricky06662/ReasonSeg_val", "test"),
    "val": ("Ricky06662/ReasonSeg_val", "test"),
    "test": ("Ricky06662/ReasonSeg_test", "test"),
}
COLUMNS = ("image", "text", "mask")
MASK_COLUMNS = ("mask", "img_height", "img_width")  # what `mask_box` reads
REWARDS = ("iou", "giou")
# The paper's grounding prompt (Visual-RFT's LISA prompt).
PROMPT = (
    "Output the bounding box in the image corresponding to the instruction: {query} Output the thinking process "
    'in <think> </think> and your grounding box. Following "<think> thinking process </think>\n'
    '<answer>(x1,y1),(x2,y2)</answer>" format.'
)
# Seg-Zero's answer: one box and one point inside the object, as JSON (its prompt, reworded).
POINTS_PROMPT = (
    "Please find \"{query}\" with a bbox and a point. Compare the difference between objects and find the most "
    "closely matched one. Output the thinking process in <think> </think> and the final answer in <answer> "
    "</answer> tags. Output the one bbox and one point inside the object in JSON format, i.e., "
    '<think> thinking process here </think><answer>[{{"bbox_2d": [10,100,200,210], "point_2d": [30,110]}}]</answer>'
)
PROMPTS = {"box": PROMPT, "box_points": POINTS_PROMPT}


def mask_rle(mask: Any, height: int | None = None, width: int | None = None) -> dict:
    """One COCO RLE for a mask given as a 2-D array, an RLE dict, polygons or a PIL image (see the module doc).

    A 2-D array is told from polygons by its dtype (bool), by holding only 0/1, or by its shape matching
    (height, width); anything else 2-D, 1-D or ragged is read as polygons (which need height and width).
    A mask that cannot be read raises `BadRow` ("bad mask"; "missing column" for a null mask), as do an array
    with NaN or infinite values, and polygon coordinates that are not finite or lie far outside the image
    (pycocotools would rasterise them without bound: a NaN coordinate exhausts memory).
    """
    if mask is None:
        raise BadRow("missing column", "a row has no mask (null); check the mask column.")
    if isinstance(mask, Image.Image):
        mask = np.asarray(mask) if mask.mode == "F" else np.asarray(mask.convert("L")) > 0  # "F": checked below
    if isinstance(mask, dict):
        if "size" not in mask or "counts" not in mask:
            raise BadRow("bad mask", f"an RLE mask needs 'size' and 'counts' (it has {sorted(mask)}); check the mask "
                                     "column.")
        h, w = (int(v) for v in mask["size"])
        counts = mask["counts"]
        if isinstance(counts, (str, bytes)):
            return {"size": [h, w], "counts": counts.encode() if isinstance(counts, str) else counts}
        counts = [int(c) for c in counts]
        if min(counts, default=0) < 0 or sum(counts) != h * w:  # pycocotools would hang or overrun on these
            raise UserError(f"an uncompressed RLE mask's run lengths add up to {sum(counts)}, not its "
                            f"{h} x {w} = {h * w} pixels (or one is negative); check the mask column.")
        return mask_utils.frPyObjects({"size": [h, w], "counts": counts}, h, w)
    try:
        array = np.asarray(mask)
    except ValueError:  # ragged nested lists: polygons of different lengths
        array = None
    if array is not None and array.dtype.kind in "fc" and not np.isfinite(array).all():
        # NaN != 0 would make every NaN pixel part of the object (a whole-image box for NaN outside it)
        raise BadRow("bad mask", "a mask holds values that are not finite (NaN or infinite); fix the mask column.")
    if array is not None and array.dtype != object and array.ndim == 2 and (
        array.dtype == bool or array.shape == (height, width) or np.isin(array, (0, 1)).all()
    ):
        return mask_utils.encode(np.asfortranarray(array != 0, dtype=np.uint8))
    if height is None or width is None:
        raise BadRow("bad mask", "a mask that is not a bool or 0/1 array (nor an array of the image's size) is read "
                                 "as polygons, which need the row's img_height and img_width columns; add them.")
    polygons = mask if array is None or array.ndim != 1 else [mask]
    try:
        polygons = [[float(v) for v in polygon] for polygon in polygons]
    except (TypeError, ValueError):
        raise BadRow("bad mask", f"cannot read a mask of type {type(mask).__name__}; give a 2-D array, COCO RLE "
                                 "({'size', 'counts'}) or polygons ([[x1, y1, x2, y2, ...], ...]).") from None
    side = max(int(height), int(width))
    if min(int(height), int(width)) < 1 or int(height) * int(width) > 4 * (Image.MAX_IMAGE_PIXELS or 1 << 30):
        raise BadRow("bad mask", f"polygon masks need a positive, sane image size; got {height}x{width}.")
    if not all(math.isfinite(v) and -side <= v <= 2 * side for polygon in polygons for v in polygon):
        raise BadRow("bad mask", f"a polygon mask has coordinates that are not finite or lie far outside its "
                                 f"{width}x{height} image; fix the mask column.")
    polygons = [p for p in polygons if len(p) >= 6 and len(p) % 2 == 0]  # pycocotools reads 4 values as a box
    if not polygons:
        return mask_utils.encode(np.zeros((int(height), int(width)), dtype=np.uint8, order="F"))
    return mask_utils.merge(mask_utils.frPyObjects(polygons, int(height), int(width)))


def mask_box(mask: Any, height: int | None = None, width: int | None = None) -> Box | None:
    """The box (x1, y1, x2, y2) around a mask, x2/y2 exclusive (x + w, y + h), in pixels; None when it is empty."""
    return rle_box(mask_rle(mask, height, width))


def rle_box(rle: dict) -> Box | None:
    """The box around a COCO RLE (see `mask_box`); None when it is empty."""
    if int(mask_utils.area(rle)) == 0:
        return None
    x, y, w, h = (float(v) for v in mask_utils.toBbox(rle))
    return x, y, x + w, y + h


def answer_box(completion: str) -> Box | None:
    """The box of a completion's answer (`parse_box`), None when there is none."""
    answer = extract_answer(completion)
    return None if answer is None else parse_box(answer)


def _number(value: float) -> str:
    return f"{value:g}"


def mask_targets(row: dict) -> dict:
    """A row's targets from its mask: `mask_rle` (the ground-truth mask as a compressed COCO RLE, a few KB), `box`
    (`rle_box`: None for an empty mask) and `mask_size` (height, width). Reads the published `mask` (with
    `img_height` / `img_width` for polygons), or the `mask_rle` of a row already prepared (by `LisaRows` or
    `Task.scoring_row`), which is read in its place."""
    mask = row["mask_rle"] if row.get("mask_rle") is not None else row.get("mask")
    rle = mask_rle(mask, _size(row.get("img_height")), _size(row.get("img_width")))
    return {"box": rle_box(rle), "mask_rle": rle, "mask_size": (int(rle["size"][0]), int(rle["size"][1]))}


class LisaRows(RowView):
    """ReasonSeg rows without their `mask` column (heavy: a full-size array), plus `id`, `query` and the targets
    of `mask_targets` (`box`, `mask_rle`, `mask_size`).

    Each row's mask is read once and its targets cached; later reads skip the mask column.
    """

    def __init__(self, rows: Any) -> None:
        present = [c for c in MASK_COLUMNS if c in rows.column_names]
        self.masks = rows.select_columns(present)
        self.targets: dict[int, dict] = {}
        super().__init__(rows.remove_columns("mask"), self._complete)

    def _complete(self, index: int, row: dict) -> dict:
        if index not in self.targets:
            self.targets[index] = mask_targets(self.masks[index])
        if row.get("image_id") is not None and row.get("ann_id") is not None:
            row_id = f"{row['image_id']}:{row['ann_id']}"
        else:
            row_id = str(row["id"]) if row.get("id") is not None else str(index)
        query = "" if row.get("text") is None else str(row["text"]).strip()
        return {**row, "id": row_id, "query": query, **self.targets[index]}


def _size(value: Any) -> int | None:
    return None if value is None else int(value)


@register_task
class Lisa(Task):
    """ReasonSeg reasoning grounding: answer one box for a query; IoU (or GIoU + 1) + format rewards; box mIoU,
    and mask gIoU / cIoU when a segmenter is set.

    Option `reward`: "iou" (IoU in [0, 1], the default) or "giou" (GIoU + 1 in [0, 2], the paper's option).
    Option `answer`: "box" (the paper's prompt, the default) or "box_points" (Seg-Zero's box + point JSON, with
    a point-in-mask reward).
    `segmenter` (a gpg_vl.reward.segment segmenter, None by default; scripts/eval.py sets it from `segmenter=`) turns
    predicted boxes into masks for the mask metrics.
    """

    name = "lisa"
    eval_split = "test"
    uses_boxes = True

    def __init__(self, reward: str = "iou", answer: str = "box") -> None:
        super().__init__()
        if reward not in REWARDS:
            raise UserError(f"task lisa has no reward {reward!r}; set task.options.reward to one of "
                            f"{', '.join(REWARDS)}.")
        if answer not in PROMPTS:
            raise UserError(f"task lisa has no answer {answer!r}; set task.options.answer to one of "
                            f"{', '.join(PROMPTS)}.")
        self.reward_kind, self.answer = reward, answer
        self.segmenter: Segmenter | None = None
        box_reward = iou_reward if reward == "iou" else giou_reward
        self.reward_functions = {
            "accuracy": lambda completion, row: 0.0 if row["box"] is None else box_reward(completion, row["box"]),
            "format": lambda completion, row: format_reward(completion),
        }
        if answer == "box_points":
            self.reward_functions["point"] = lambda completion, row: point_in_mask_reward(
                completion, row.get("mask_rle"), row["box"])
            self.reward_functions["format"] = lambda completion, row: box_point_format_reward(completion)
        self.reward_weights = {name: 1.0 for name in self.reward_functions}

    def load(self, split: str) -> LisaRows:
        if self.data_path is not None:
            rows = load_rows(None, split, path=self.data_path, required_columns=COLUMNS)
        elif split in HUB_SPLITS:
            hub_id, hub_split = HUB_SPLITS[split]
            rows = load_rows(hub_id, hub_split, required_columns=COLUMNS)
        else:
            raise UserError(f"ReasonSeg's {split!r} split has no Hub copy, so pass data.path=/path/to/reasonseg "
                            f"(a copy with columns {', '.join(COLUMNS)}; Hub splits: {', '.join(HUB_SPLITS)}).")
        return LisaRows(rows)

    def prepare_targets(self, row: dict) -> dict:
        """`box`, `mask_rle` and `mask_size` from the row's mask (`mask_targets`); a published row's mask is
        decoded once however many completions are scored (`scoring_row`)."""
        return mask_targets(row)

    def check_row(self, row: dict) -> None:
        require_text(row, question="query" if "query" in row else "text")
        super().check_row(row)

    def _image(self, row: dict):
        return self.open_image(row["image"], row=row["id"])

    def messages(self, row: dict) -> list[dict]:
        image = self._image(row)
        if row.get("mask_size") is not None and tuple(row["mask_size"]) != (image.height, image.width):
            height, width = row["mask_size"]
            raise BadRow("mask size mismatch", f"{row_name(row)} has a {width}x{height} mask for a "
                                               f"{image.width}x{image.height} image; fix its mask or image.")
        return image_question(image, PROMPTS[self.answer].format(query=row["query"]))

    def target(self, row: dict) -> str:
        box = self.scoring_row(row)["box"]
        return "none" if box is None else "[" + ", ".join(_number(v) for v in box) + "]"

    def predicted_box(self, completion: str, row: dict) -> Box | None:
        """The completion's box clipped to the image (the size of the row's mask); None without one."""
        height, width = self.scoring_row(row)["mask_rle"]["size"]
        return clip_box(answer_box(completion), width, height)

    def prediction_fields(self, rows: Sequence[dict], completions: Sequence[str]) -> list[dict]:
        """What evaluation adds to each (image-free) row before scoring: `pred_mask`, the segmenter's RLE mask of
        the predicted box (nothing without a segmenter). `rows` still hold their images here."""
        if self.segmenter is None:
            return [{} for _ in rows]
        images = [self._image(row) if self.segmenter.needs_images else None for row in rows]
        masks = self.segmenter.segment(images, [tuple(self.scoring_row(row)["mask_rle"]["size"]) for row in rows],
                                       [self.predicted_box(c, row) for row, c in zip(rows, completions, strict=True)])
        return [{"pred_mask": mask} for mask in masks]

    def metrics(self, rows: Sequence[dict], completions: Sequence[str],
                scores: Sequence[dict] | None = None) -> dict[str, float]:
        """The default reward means, plus `miou`: the mean box IoU over rows with a target box (0 for a
        completion without a parsable box), and with a segmenter `mask_giou` / `mask_ciou` over every row
        (gpg_vl.reward.segment.mask_metrics: ReasonSeg's gIoU and cIoU)."""
        rows = [self.scoring_row(row) for row in rows]  # each row's mask read once
        result = super().metrics(rows, completions, scores)
        ious = []
        for row, completion in zip(rows, completions, strict=True):
            if row["box"] is not None:
                box = self.predicted_box(completion, row)
                ious.append(0.0 if box is None else box_iou(box, row["box"]))
        result["miou"] = sum(ious) / len(ious) if ious else 0.0
        masks = [row.get("pred_mask") for row in rows]
        if None in masks and self.segmenter is not None and not self.segmenter.needs_images:
            masks = [fields["pred_mask"] for fields in self.prediction_fields(rows, completions)]
        if rows and None not in masks:
            pairs = zip(masks, rows, strict=True)
            scores = mask_metrics([intersection_union(mask, row["mask_rle"]) for mask, row in pairs])
            result["mask_giou"], result["mask_ciou"] = scores["giou"], scores["ciou"]
        return result
