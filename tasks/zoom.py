"""`zoom`: the `shapes` of thinking with images, generated from seeds, no download.

A large white image (1024 px by default) is cut by a faint grid into `grid` x `grid` cells, and every cell holds
a small symbol (a circle, square or triangle) of one of four colours. The question names a cell ("row 2,
column 3") and asks for its symbol's colour; the other fifteen symbols are distractors of random colours, so the
answer is not in the image's colours as a whole, and the answers cycle through the four colours row by row, so
no constant answer scores above 1/4 on a split whose size is a multiple of 4. At the zoom experiment's pixel budget
(model.max_pixels = 112 * 112) the whole image is shrunk about 9 times: each symbol is 2 to 3 pixels across, a
few hundredths of one 14-pixel vision patch, and finding the named one means reading a position too. A `zoom_in`
on the named cell returns it 4 times larger (a 256-pixel cell shown at 112 px): one symbol 9 to 12 pixels across,
most of a patch, and nothing else.

The prompt describes the tool itself (`describe_tools = False`: a short line, as DeepEyes' data does, rather
than the chat template's long tool list), so the same prompt serves `rollout.max_turns=1` (no tool) and
multi-turn runs. Rewards: accuracy (the `<answer>` is the colour) and format (the completion ends in one
`<answer>...</answer>` and every tool call it opened is closed). No tool bonus: whether calling the tool pays
is what the demonstration measures, through accuracy alone.
"""

from __future__ import annotations

import random
import re
from functools import partial

from PIL import Image, ImageDraw

from gpg_vl.data.task import Task, image_question, register_task
from gpg_vl.errors import UserError
from gpg_vl.reward.primitives import box_iou, exact_match_reward, extract_answer

from .shapes import LazySplit

COLORS = {"red": (220, 40, 40), "green": (30, 170, 60), "blue": (40, 80, 225), "yellow": (235, 200, 30)}
SHAPES = ("circle", "square", "triangle")
SPLIT_SEEDS = {"train": 0, "test": 1_000_003, "validation": 2_000_003}
RADIUS = (0.04, 0.055)  # a symbol's half-side, as a fraction of its cell: 20 to 28 px across in a 256 px cell
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


def place_symbol(rng: random.Random, row_i: int, col_i: int, cell: int) -> dict:
    """A symbol at a random place inside cell (row_i, col_i), clear of the grid lines."""
    r = rng.uniform(*RADIUS) * cell
    margin = r + cell * 0.08
    x, y = col_i * cell + rng.uniform(margin, cell - margin), row_i * cell + rng.uniform(margin, cell - margin)
    return {"x": x, "y": y, "r": r, "shape": rng.choice(SHAPES), "color": rng.choice(list(COLORS))}


def make_row(seed: int, index: int, image_size: int = 1024, grid: int = 4) -> dict:
    """Row `index` of the split seeded by `seed`; the same arguments always give the same row. `cell` is the
    named cell's box in original pixels (x1, y1, x2, y2): the box a good zoom asks for; `symbol` is its symbol."""
    rng = random.Random(seed * 1_000_003 + index)
    cell = image_size // grid
    row_i, col_i = rng.randrange(grid), rng.randrange(grid)
    symbols = [[place_symbol(rng, i, j, cell) for j in range(grid)] for i in range(grid)]
    symbols[row_i][col_i]["color"] = list(COLORS)[index % len(COLORS)]  # balanced: a constant answer scores 1/4
    image = Image.new("RGB", (image_size, image_size), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    for k in range(1, grid):
        draw.line((k * cell, 0, k * cell, image_size), fill=(200, 200, 200), width=max(1, image_size // 256))
        draw.line((0, k * cell, image_size, k * cell), fill=(200, 200, 200), width=max(1, image_size // 256))
    for line in symbols:
        for s in line:
            draw_symbol(draw, s["shape"], s["x"], s["y"], s["r"], COLORS[s["color"]])
    target = symbols[row_i][col_i]
    return {
        "id": f"zoom-{seed}-{index}",
        "image": image,
        "question": f"What colour is the symbol in row {row_i + 1}, column {col_i + 1}?",
        "answer": target["color"],
        "color": target["color"],
        "cell": (col_i * cell, row_i * cell, (col_i + 1) * cell, (row_i + 1) * cell),
        "symbol": target,
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


_FIRST_BOX = re.compile(r'<tool_call>[^<]*?"bbox_2d"\s*:\s*\[([^\]]*)\]')


def zoomed_on_cell(completion: str, row: dict) -> bool:
    """Whether the trajectory's first call asks for a box (in original pixels, as the task scores it) that covers
    the named cell: intersection over union at least 0.5."""
    found = _FIRST_BOX.search(completion)
    try:
        box = [float(v) for v in found.group(1).split(",")] if found else []
    except ValueError:
        return False
    return len(box) == 4 and box_iou(box, row["cell"]) >= 0.5


@register_task
class Zoom(Task):
    """The colour of a small symbol in a named cell of a large image: a speck in the full view, plain in a
    zoom_in crop; accuracy + format."""

    name = "zoom"
    group_columns = ("color",)
    tools = ("zoom_in",)
    describe_tools = False
    uses_boxes = True  # the calls' boxes reach rewards and metrics in original pixels (zoomed_on_cell)

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
        """The default metrics, plus the tool-call rate, the share of trajectories whose call covers the named cell,
        and the accuracy with and without a call."""
        result = super().metrics(rows, completions, scores)
        if not completions:
            return result
        calls = [called_tool(c) for c in completions]
        result["tool_call_rate"] = sum(calls) / len(calls)
        result["zoom_on_cell_rate"] = sum(zoomed_on_cell(c, r) for r, c in zip(rows, completions, strict=True)) / len(
            completions)
        for used, label in ((True, "with_tool"), (False, "without_tool")):
            pairs = [(r, c) for r, c, u in zip(rows, completions, calls, strict=True) if u == used]
            if pairs:
                result[f"accuracy/{label}"] = sum(exact_match_reward(c, r["answer"]) for r, c in pairs) / len(pairs)
        return result
