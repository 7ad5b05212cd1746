"""`zoom`: the `shapes` of thinking with images, generated from seeds, no download.

A large white image (1024 px by default) is cut by a faint grid into `grid` x `grid` cells; one cell holds a
small coloured shape (circle, square or triangle). The question names the cell ("row 2, column 3") and asks for
the shape. At the tiny model's pixel budget (model.max_pixels = 224 * 224) the whole image is shrunk about
4.6 times: the symbol is 4.5 to 9 pixels across, less than one 14-pixel vision patch, and its size is drawn so
that its area does not give the shape away. A `zoom_in` on the named cell returns it at nearly full resolution
(a 256-pixel cell is shown at 224 px), where the symbol is 20 to 36 pixels across, as large as `shapes`' own.

The prompt describes the tool itself (`describe_tools = False`: a short line, as DeepEyes' data does, rather
than the chat template's long tool list), so the same prompt serves `rollout.max_turns=1` (no tool) and
multi-turn runs. Rewards: accuracy (the `<answer>` is the shape) and format (the completion ends in one
`<answer>...</answer>` and every tool call it opened is closed). No tool bonus: whether calling the tool pays
is what the demonstration measures, through accuracy alone.
"""

from __future__ import annotations

import random
from functools import partial

from PIL import Image, ImageDraw

from gpg_vl.data.task import Task, image_question, register_task
from gpg_vl.errors import UserError
from gpg_vl.reward.primitives import exact_match_reward, extract_answer

from .shapes import LazySplit

COLORS = {"red": (220, 40, 40), "green": (30, 170, 60), "blue": (40, 80, 225), "yellow": (235, 200, 30)}
SHAPES = ("circle", "square", "triangle")
SPLIT_SEEDS = {"train": 0, "test": 1_000_003, "validation": 2_000_003}
# the symbol's half-side r, as a fraction of the cell, per shape: chosen so that the areas overlap (a triangle
# 2r^2, a circle pi r^2, a square 4r^2), so the amount of colour does not tell the shape
RADIUS = {"circle": (0.045, 0.07), "square": (0.04, 0.06), "triangle": (0.05, 0.08)}
INSTRUCTION = (" To look closer, call zoom_in with a box [x1, y1, x2, y2] in the image's pixels: "
               "<tool_call>{\"name\": \"zoom_in\", \"arguments\": {\"bbox_2d\": [x1, y1, x2, y2]}}</tool_call>. "
               "Give the final answer in <answer> </answer> tags.")


def draw_symbol(draw: ImageDraw.ImageDraw, shape: str, x: float, y: float, r: float, fill) -> None:
    if shape == "circle":
        draw.ellipse((x - r, y - r, x + r, y + r), fill=fill)
    elif shape == "square":
        draw.rectangle((x - r, y - r, x + r, y + r), fill=fill)
    else:
        draw.polygon([(x, y - r), (x - r, y + r), (x + r, y + r)], fill=fill)


def make_row(seed: int, index: int, image_size: int = 1024, grid: int = 4) -> dict:
    """Row `index` of the split seeded by `seed`; the same arguments always give the same row. `cell` is the
    named cell's box in original pixels (x1, y1, x2, y2): the box a good zoom asks for."""
    rng = random.Random(seed * 1_000_003 + index)
    cell = image_size // grid
    row_i, col_i = rng.randrange(grid), rng.randrange(grid)
    shape, color = rng.choice(SHAPES), rng.choice(list(COLORS))
    low, high = RADIUS[shape]
    r = rng.uniform(low, high) * cell
    margin = r + cell * 0.08
    x = col_i * cell + rng.uniform(margin, cell - margin)
    y = row_i * cell + rng.uniform(margin, cell - margin)
    image = Image.new("RGB", (image_size, image_size), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    for k in range(1, grid):
        draw.line((k * cell, 0, k * cell, image_size), fill=(200, 200, 200), width=max(1, image_size // 256))
        draw.line((0, k * cell, image_size, k * cell), fill=(200, 200, 200), width=max(1, image_size // 256))
    draw_symbol(draw, shape, x, y, r, COLORS[color])
    box = (col_i * cell, row_i * cell, (col_i + 1) * cell, (row_i + 1) * cell)
    return {
        "id": f"zoom-{seed}-{index}",
        "image": image,
        "question": f"What shape is in row {row_i + 1}, column {col_i + 1}?",
        "answer": shape,
        "shape": shape,
        "color": color,
        "cell": box,
        "symbol": {"x": x, "y": y, "r": r},
    }


def zoom_format_reward(completion: str) -> float:
    """1.0 when the completion ends in its only `<answer>...</answer>` and every `<tool_call>` is closed."""
    text = completion.strip()
    if not text.endswith("</answer>") or text.count("<answer>") != 1 or extract_answer(text) is None:
        return 0.0
    return 1.0 if text.count("<tool_call>") == text.count("</tool_call>") else 0.0


def called_tool(completion: str) -> bool:
    """Whether a completion (a whole trajectory's text) holds a tool call."""
    return "<tool_call>" in completion


@register_task
class Zoom(Task):
    """A small shape in a named cell of a large image: readable only through zoom_in; accuracy + format."""

    name = "zoom"
    group_columns = ("shape",)
    tools = ("zoom_in",)
    describe_tools = False

    def __init__(self, train_size: int = 20_000, test_size: int = 200, image_size: int = 1024,
                 grid: int = 4) -> None:
        super().__init__()
        if grid < 1 or image_size // grid < 32:
            raise UserError(f"task zoom: image_size={image_size} and grid={grid} give cells under 32 pixels; "
                            "use a larger image_size or a smaller grid.")
        self.sizes = {"train": train_size, "test": test_size, "validation": test_size}
        self.image_size, self.grid = image_size, grid
        self.reward_functions = {
            "accuracy": lambda completion, row: exact_match_reward(completion, row["answer"]),
            "format": lambda completion, row: zoom_format_reward(completion),
        }
        self.reward_weights = {"accuracy": 1.0, "format": 0.5}

    def load(self, split: str) -> LazySplit:
        if split not in SPLIT_SEEDS:
            raise UserError(f"task zoom has no split {split!r}; use one of {sorted(SPLIT_SEEDS)}.")
        return LazySplit(self.sizes[split], partial(make_row, SPLIT_SEEDS[split], image_size=self.image_size,
                                                    grid=self.grid))

    def messages(self, row: dict) -> list[dict]:
        return image_question(row["image"], row["question"] + INSTRUCTION)

    def metrics(self, rows, completions, scores=None) -> dict[str, float]:
        """The default metrics, plus the tool-call rate and the accuracy with and without a call."""
        result = super().metrics(rows, completions, scores)
        if not completions:
            return result
        calls = [called_tool(c) for c in completions]
        result["tool_call_rate"] = sum(calls) / len(calls)
        for used, label in ((True, "with_tool"), (False, "without_tool")):
            pairs = [(r, c) for r, c, u in zip(rows, completions, calls, strict=True) if u == used]
            if pairs:
                result[f"accuracy/{label}"] = sum(exact_match_reward(c, r["answer"]) for r, c in pairs) / len(pairs)
        return result
