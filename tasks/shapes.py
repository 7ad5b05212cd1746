"""`shapes`: synthetic visual reasoning, generated from seeds, no download.

Each image holds one to three coloured shapes (distinct colours) in a row. A question asks for a
shape's colour, its shape, the number of shapes, or whether one shape is left or right of another.
The reference completion states the finding inside <think> and answers in <answer>; the accuracy
reward is an exact match of the answer.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from functools import partial

from PIL import Image, ImageDraw

from gpg_vl.data.task import Task, image_question, register_task
from gpg_vl.reward.primitives import exact_match_reward, format_reward

COLORS = {"red": (220, 40, 40), "green": (30, 170, 60), "blue": (40, 80, 225), "yellow": (235, 200, 30)}
SHAPES = ("circle", "square", "triangle")
QUESTION_TYPES = ("color", "shape", "count", "relation")
SPLIT_SEEDS = {"train": 0, "test": 1_000_003, "validation": 2_000_003}
INSTRUCTION = " Output the thinking process in <think> </think> and final answer in <answer> </answer> tags."


def draw_scene(objects: list[dict], size: int) -> Image.Image:
    """Render objects ({"color", "shape", "x", "y", "r"}) on a white square canvas."""
    image = Image.new("RGB", (size, size), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    for obj in objects:
        x, y, r, fill = obj["x"], obj["y"], obj["r"], COLORS[obj["color"]]
        if obj["shape"] == "circle":
            draw.ellipse((x - r, y - r, x + r, y + r), fill=fill)
        elif obj["shape"] == "square":
            draw.rectangle((x - r, y - r, x + r, y + r), fill=fill)
        else:
            draw.polygon([(x, y - r), (x - r, y + r), (x + r, y + r)], fill=fill)
    return image


def make_row(seed: int, index: int, image_size: int = 112) -> dict:
    """Row `index` of the split seeded by `seed`; the same arguments always give the same row.

    Colour and shape questions show one shape, count questions one to three, relation questions two.
    """
    rng = random.Random(seed * 1_000_003 + index)
    qtype = QUESTION_TYPES[rng.randrange(len(QUESTION_TYPES))]
    count = {"color": 1, "shape": 1, "count": rng.randint(1, 3), "relation": 2}[qtype]
    colors = rng.sample(list(COLORS), count)
    slot = image_size // count
    objects = []
    for i, color in enumerate(colors):
        r = rng.randint(image_size // 9, max(image_size // 9, min(image_size // 4, slot // 2 - 2)))
        x = rng.randint(i * slot + r, (i + 1) * slot - r) if slot > 2 * r else i * slot + slot // 2
        y = rng.randint(r + 2, image_size - r - 2)
        objects.append({"color": color, "shape": rng.choice(SHAPES), "x": x, "y": y, "r": r})
    if qtype == "color":
        question, answer = "What color is the shape?", objects[0]["color"]
        thought = f"the shape is {answer}"
    elif qtype == "shape":
        question, answer = "What shape is this?", objects[0]["shape"]
        thought = f"this is a {answer}"
    elif qtype == "count":
        question, answer = "How many shapes are there?", str(count)
        thought = f"there are {answer} shapes"
    else:
        first, second = rng.sample(range(count), 2)
        question = f"Is the {colors[first]} shape left or right of the {colors[second]} shape?"
        answer = "left" if first < second else "right"
        thought = f"the {colors[first]} shape is {answer} of the {colors[second]} shape"
    return {
        "id": f"shapes-{seed}-{index}",
        "image": draw_scene(objects, image_size),
        "question": question,
        "answer": answer,
        "question_type": qtype,
        "objects": objects,
        "solution": f"<think> {thought} </think>\n<answer> {answer} </answer>",
    }


class LazySplit(Sequence):
    """A split whose rows are made on access by `make(index)` (a picklable callable): any size costs no memory."""

    def __init__(self, size: int, make: Callable[[int], dict]) -> None:
        self.size, self.make = size, make

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self.size))]
        if not -self.size <= index < self.size:
            raise IndexError(index)
        return self.make(index % self.size)


@register_task
class Shapes(Task):
    """Coloured shapes: color, shape, count and left/right questions; accuracy + format rewards."""

    name = "shapes"
    group_columns = ("question_type",)

    def __init__(self, train_size: int = 20_000, test_size: int = 300, image_size: int = 112) -> None:
        super().__init__()
        self.sizes = {"train": train_size, "test": test_size, "validation": test_size}
        self.image_size = image_size
        self.reward_functions = {
            "accuracy": lambda completion, row: exact_match_reward(completion, row["answer"]),
            "format": lambda completion, row: format_reward(completion),
        }
        self.reward_weights = {"accuracy": 1.0, "format": 1.0}

    def load(self, split: str) -> LazySplit:
        if split not in SPLIT_SEEDS:
            from gpg_vl.errors import UserError

            raise UserError(f"task shapes has no split {split!r}; use one of {sorted(SPLIT_SEEDS)}.")
        return LazySplit(self.sizes[split], partial(make_row, SPLIT_SEEDS[split], image_size=self.image_size))

    def messages(self, row: dict) -> list[dict]:
        return image_question(row["image"], row["question"] + INSTRUCTION)

    def metrics(self, rows, completions, scores=None) -> dict[str, float]:
        result = super().metrics(rows, completions, scores)
        for qtype in QUESTION_TYPES:
            pairs = [(r, c) for r, c in zip(rows, completions, strict=True) if r["question_type"] == qtype]
            if pairs:
                result[f"accuracy/{qtype}"] = sum(
                    exact_match_reward(c, r["answer"]) for r, c in pairs
                ) / len(pairs)
        return result
