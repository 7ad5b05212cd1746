"""A tool's context on a synthetic image (a gradient, so crops are told apart) and a stub family with the box frame
asked: shared by the tool and tool-call tests."""

from __future__ import annotations

from PIL import Image

from gpg_vl.models.family import Family
from gpg_vl.rollout.multiturn.tools import ToolContext
from gpg_vl.rollout.multiturn.trajectory import MultiTurnSettings


def gradient(width: int, height: int) -> Image.Image:
    """An image whose pixel (x, y) is (x % 256, y % 256, 0): a crop says where it was cut from."""
    image = Image.new("RGB", (width, height))
    image.putdata([(x % 256, y % 256, 0) for y in range(height) for x in range(width)])
    return image


class StubFamily:
    """The family protocol's box conversions on a chosen frame; `fit_image` halves each side (a visible resize)."""

    name = "stub"
    box_scale, to_original_frame = Family.box_scale, Family.to_original_frame

    def __init__(self, frame: str) -> None:
        self.box_frame = frame

    def fit_image(self, image):
        return image.resize((max(1, image.width // 2), max(1, image.height // 2)))


def context(frame="relative-1000", size=(1000, 500), resized=None, **settings) -> ToolContext:
    image = gradient(*size)
    resized = resized or size
    return ToolContext.for_prompt([image], [(*size, *resized)], StubFamily(frame), MultiTurnSettings(**settings))
