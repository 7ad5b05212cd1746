"""Predicted boxes to masks, and the ReasonSeg mask metrics (gIoU, cIoU).

The paper scores reasoning grounding as masks: a box-prompted segmenter turns each predicted box into a mask,
which is compared with the ground-truth mask. Masks are COCO RLEs (pycocotools) throughout.

Segmenters (`segmenter=` on the eval command line) map images and one box per image (original pixels, or None
for a completion without a box) to one RLE per image:
- `box`: the filled box, rasterised by pycocotools (edges rounded to the nearest pixel edge); no model, no image;
- `sam`: transformers' `SamModel` prompted with the box (`facebook/sam-vit-huge` by default, as in the paper);
- `sam2`: transformers' `Sam2Model` prompted with the box (`facebook/sam2.1-hiera-large` by default).
SAM models run batched over images (one box each), with `multimask_output=False` (one mask per box).
No box gives an empty mask, whatever the segmenter.

Metrics (ReasonSeg's convention, from LISA's evaluation code): per row, I = |pred & gt| and U = |pred | gt|;
the row's IoU is I / U, or 1 when both masks are empty (U = 0, "no-object target"); gIoU is the mean of the
rows' IoUs and cIoU = sum(I) / sum(U) (0 when every union is empty). A row without a predicted box has an
empty mask: its IoU is 0 and its union (the ground truth's area) still counts in cIoU.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import numpy as np
from pycocotools import mask as mask_utils

from gpg_vl.data.answers import Box
from gpg_vl.errors import UserError

SEGMENTERS = ("box", "sam", "sam2")
DEFAULT_MODELS = {"sam": "facebook/sam-vit-huge", "sam2": "facebook/sam2.1-hiera-large"}


# ---------------------------------------------------------------- masks and metrics (pure)

def clip_box(box: Sequence[float] | None, width: int, height: int) -> Box | None:
    """`box` clipped to the image [0, width] x [0, height]; None when nothing of it is left (or no box)."""
    if box is None:
        return None
    x1, y1, x2, y2 = (float(v) for v in box)
    if not all(math.isfinite(v) for v in (x1, y1, x2, y2)):
        return None
    x1, x2 = min(max(x1, 0.0), width), min(max(x2, 0.0), width)
    y1, y2 = min(max(y1, 0.0), height), min(max(y2, 0.0), height)
    return (x1, y1, x2, y2) if x2 > x1 and y2 > y1 else None


def empty_rle(height: int, width: int) -> dict:
    return mask_utils.encode(np.zeros((int(height), int(width)), dtype=np.uint8, order="F"))


def box_rle(box: Sequence[float] | None, height: int, width: int) -> dict:
    """The filled box as an RLE of an image `height` x `width`: pixels whose centre lies inside the box
    (pycocotools' rasterisation: (10, 8, 30, 20) covers columns 10-29 and rows 8-19)."""
    box = clip_box(box, width, height)
    if box is None:
        return empty_rle(height, width)
    x1, y1, x2, y2 = box
    return mask_utils.frPyObjects(np.array([[x1, y1, x2 - x1, y2 - y1]], dtype=np.float64), height, width)[0]


def array_rle(mask: np.ndarray) -> dict:
    """A 2-D boolean (or 0/1) array as an RLE."""
    return mask_utils.encode(np.asfortranarray(np.asarray(mask) != 0, dtype=np.uint8))


def intersection_union(pred: dict, gt: dict) -> tuple[int, int]:
    """(|pred & gt|, |pred | gt|) in pixels for two RLEs of the same size."""
    if list(pred["size"]) != list(gt["size"]):
        raise UserError(f"a predicted mask is {pred['size'][1]}x{pred['size'][0]} but its ground truth is "
                        f"{gt['size'][1]}x{gt['size'][0]}; the image and its mask must have the same size.")
    inter = int(mask_utils.area(mask_utils.merge([pred, gt], intersect=True)))
    union = int(mask_utils.area(mask_utils.merge([pred, gt], intersect=False)))
    return inter, union


def mask_metrics(counts: Sequence[tuple[int, int]]) -> dict[str, float]:
    """`giou` (mean per-row IoU, 1 for a row whose union is empty) and `ciou` (sum of intersections over sum of
    unions, 0 when that sum is 0) from per-row (intersection, union) pixel counts; both 0.0 with no rows."""
    if not counts:
        return {"giou": 0.0, "ciou": 0.0}
    ious = [inter / union if union > 0 else 1.0 for inter, union in counts]
    total_union = sum(union for _, union in counts)
    return {"giou": sum(ious) / len(ious),
            "ciou": sum(inter for inter, _ in counts) / total_union if total_union > 0 else 0.0}


# ---------------------------------------------------------------- segmenters

class Segmenter(Protocol):
    name: str
    needs_images: bool

    def segment(self, images: Sequence, sizes: Sequence[tuple[int, int]], boxes: Sequence[Box | None]) -> list[dict]:
        """One RLE per image, of size `sizes[i]` = (height, width), from its box (None: an empty mask)."""
        ...


class BoxSegmenter:
    """The mask is the filled box; needs no model and no image (the metric can be checked by hand)."""

    name = "box"
    needs_images = False

    def segment(self, images: Sequence, sizes: Sequence[tuple[int, int]], boxes: Sequence[Box | None]) -> list[dict]:
        return [box_rle(box, height, width) for (height, width), box in zip(sizes, boxes, strict=True)]


class SamSegmenter:
    """A box-prompted SAM (`SamModel`) or SAM 2 (`Sam2Model`) from transformers, batched over images.

    `model` and `processor` are the loaded transformers objects (see `load_segmenter`); each forward pass
    takes up to `batch_size` images with one box each.
    """

    needs_images = True

    def __init__(self, name: str, model, processor, *, batch_size: int = 8) -> None:
        if batch_size < 1:
            raise UserError(f"segmenter_batch_size must be at least 1 (got {batch_size}); set segmenter_batch_size=8.")
        self.name, self.model, self.processor, self.batch_size = name, model.eval(), processor, batch_size

    def segment(self, images: Sequence, sizes: Sequence[tuple[int, int]], boxes: Sequence[Box | None]) -> list[dict]:
        import torch

        masks = [empty_rle(height, width) for height, width in sizes]
        todo = []  # rows with a box left after clipping
        for i, ((height, width), box) in enumerate(zip(sizes, boxes, strict=True)):
            box = clip_box(box, width, height)
            if box is None:
                continue
            if images[i] is None or tuple(images[i].size) != (width, height):
                got = "no image" if images[i] is None else f"an image of {images[i].size[0]}x{images[i].size[1]}"
                raise UserError(f"segmenter {self.name} got {got} for a mask of {width}x{height}; the image and "
                                "its mask must have the same size.")
            todo.append((i, box))
        device = self.model.device
        for start in range(0, len(todo), self.batch_size):
            chunk = todo[start:start + self.batch_size]
            inputs = self.processor(images=[images[i].convert("RGB") for i, _ in chunk],
                                    input_boxes=[[list(box)] for _, box in chunk], return_tensors="pt")
            pixel_values = inputs["pixel_values"].to(device, self.model.dtype)  # [b, 3, S, S]
            with torch.no_grad():
                output = self.model(pixel_values=pixel_values, input_boxes=inputs["input_boxes"].to(device),
                                    multimask_output=False)
            low_res = output.pred_masks.float().cpu()  # [b, 1 box, 1 mask, s, s] logits
            if self.name == "sam2":
                full = self.processor.post_process_masks(low_res, inputs["original_sizes"])
            else:
                full = self.processor.image_processor.post_process_masks(
                    low_res, inputs["original_sizes"], inputs["reshaped_input_sizes"])
            for (i, _), mask in zip(chunk, full, strict=True):  # mask: [1 box, 1 mask, H, W] bool
                masks[i] = array_rle(mask[0, 0].numpy())
        return masks


def load_segmenter(name: str, model_id: str | None = None, *, batch_size: int = 8,
                   device: str = "cpu") -> Segmenter:
    """The segmenter called `name` (see SEGMENTERS); `model_id` (a hub id or a local directory) overrides the
    default checkpoint of `sam` / `sam2`. A checkpoint that cannot be loaded is one sentence naming it."""
    if name not in SEGMENTERS:
        raise UserError(f"unknown segmenter {name!r}; set segmenter= to one of {', '.join(SEGMENTERS)}.")
    if name == "box":
        return BoxSegmenter()
    import torch
    from transformers import Sam2Model, Sam2Processor, SamModel, SamProcessor

    model_class, processor_class = (SamModel, SamProcessor) if name == "sam" else (Sam2Model, Sam2Processor)
    path = str(model_id or DEFAULT_MODELS[name])
    try:
        processor = processor_class.from_pretrained(path)
        model = model_class.from_pretrained(path, dtype=torch.float32)  # box coordinates stay exact
    except (OSError, ValueError) as error:
        where = "local directory" if Path(path).exists() else "Hugging Face Hub id"
        cause = (str(error).strip().splitlines() or [type(error).__name__])[0].split(". ")[0][:160]
        raise UserError(
            f"could not load the {name} segmenter {path!r} as a {where} ({cause}); "
            f"without network access, download it elsewhere and pass segmenter_model=/path/to/local/copy "
            "(or segmenter=box, which needs no model)."
        ) from None
    return SamSegmenter(name, model.to(device), processor, batch_size=batch_size)
