"""`measure`: code as a tool on CPU, generated from seeds, no download: which colour covers the largest (or the
smallest) area?

A white image (448 px by default) is cut into a 14 x 14 grid of 32 px cells, and every cell holds one square of a
random side (6 to 26 px) and one of four colours. The question asks which colour covers the largest area, or the
smallest: the answer is a sum over some two hundred squares, each colour on a quarter of them, and the answer's
sum differs from the next one's by at most 5%. At the
experiment's pixel budget (model.max_pixels = 112 x 112) each square is 1 to 6 pixels across: the view cannot
tell; a few lines of Python on the image's own pixels can (`image_1.getcolors()`: the squares are drawn in exact
colours, the background is the most common one). The answer colour cycles with the row index and the question
kind with every fourth row, so any constant answer scores exactly 1/4 on a split whose size is a multiple of 8.

The prompt describes the tool itself (`describe_tools = False`), in the fenced form DeepEyesV2 and Thyme use
(`<code> ```python ... ``` </code>`, read by the python tool's text call), so the same prompt serves the no-tool
arm (`rollout.max_turns=1`). Rewards: accuracy (the `<answer>` is the colour) and format (one final `<answer>`,
every `<code>` closed). No tool bonus: whether running code pays shows in accuracy alone.
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
KINDS = ("largest", "smallest")
SPLIT_SEEDS = {"train": 0, "test": 1_000_003, "validation": 2_000_003}
CELL, SIDES = 32, (6, 26)  # a cell's side, and the range of a square's side, in pixels
GAP = 0.05  # the answer's area differs from the next one's by at most this share of it
INSTRUCTION = (" To measure, run Python on the image (image_1, a PIL image): <code>```python ... ```</code>. "
               "Give the final answer in <answer> </answer> tags.")
# what a demonstration runs (scripts/build_tiny.py --code): the colours by area, background last
CODE = {"largest": "c = sorted(image_1.getcolors())\nprint(c[-2][1])", "smallest": "c = sorted(image_1.getcolors())\n"
        "print(c[0][1])"}


def make_row(seed: int, index: int, image_size: int = 448) -> dict:
    """Row `index` of the split seeded by `seed`; the same arguments always give the same row. `areas`: each
    colour's pixels; the answer's is strictly the largest (or smallest) of the four."""
    rng = random.Random(seed * 1_000_003 + index)
    kind = KINDS[(index // len(COLORS)) % len(KINDS)]
    answer = list(COLORS)[index % len(COLORS)]
    grid = image_size // CELL
    while True:  # every colour on as many squares (give or take one), the answer's area within GAP of the next
        colours = [k % len(COLORS) for k in range(grid * grid)]
        rng.shuffle(colours)
        squares = []
        for row_i in range(grid):
            for col_i in range(grid):
                side = rng.randint(*SIDES)
                x, y = col_i * CELL + rng.randint(0, CELL - side), row_i * CELL + rng.randint(0, CELL - side)
                squares.append((x, y, side, colours[row_i * grid + col_i]))
        totals = [sum(side * side for _, _, side, colour in squares if colour == k) for k in range(len(COLORS))]
        order = sorted(range(len(COLORS)), key=totals.__getitem__)  # colour slots, smallest area first
        target, runner_up = (order[-1], order[-2]) if kind == "largest" else (order[0], order[1])
        if 0 < abs(totals[target] - totals[runner_up]) <= GAP * totals[target]:
            break
    others = [name for name in COLORS if name != answer]
    rng.shuffle(others)
    names = {target: answer, **{slot: others.pop() for slot in order if slot != target}}
    image = Image.new("RGB", (image_size, image_size), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    for x, y, side, colour in squares:
        draw.rectangle((x, y, x + side - 1, y + side - 1), fill=COLORS[names[colour]])
    return {
        "id": f"measure-{seed}-{index}",
        "image": image,
        "question": f"Which colour covers the {kind} area: red, green, blue or yellow?",
        "answer": answer,
        "kind": kind,
        "areas": {names[k]: totals[k] for k in range(len(COLORS))},
    }


def code_format_reward(completion: str) -> float:
    """1.0 when the completion ends in its only `<answer>...</answer>` and every `<code>` is closed."""
    text = completion.strip()
    if not text.endswith("</answer>") or text.count("<answer>") != 1 or extract_answer(text) is None:
        return 0.0
    return 1.0 if text.count("<code>") == text.count("</code>") else 0.0


def ran_code(completion: str) -> bool:
    """Whether a completion (a whole trajectory's text) holds a code call."""
    return "<code>" in completion


@register_task
class Measure(Task):
    """The colour that covers the largest or smallest area among some two hundred small squares: invisible at the
    model's pixel budget, one line of Python on the image's pixels; accuracy + format."""

    name = "measure"
    group_columns = ("kind",)
    tools = ("python",)
    describe_tools = False

    def __init__(self, train_size: int = 20_000, test_size: int = 200, image_size: int = 448) -> None:
        super().__init__()
        if image_size < 4 * CELL:
            raise UserError(f"task measure: image_size={image_size} holds fewer than 4 x 4 cells of {CELL} px; use "
                            f"image_size >= {4 * CELL}.")
        self.sizes = {"train": train_size, "test": test_size, "validation": test_size}
        self.image_size = image_size
        self.reward_functions = {
            "accuracy": lambda completion, row: exact_match_reward(completion, row["answer"]),
            "format": lambda completion, row: code_format_reward(completion),
        }
        self.reward_weights = {"accuracy": 1.0, "format": 0.5}

    def load(self, split: str) -> LazySplit:
        if split not in SPLIT_SEEDS:
            raise UserError(f"task measure has no split {split!r}; use one of {sorted(SPLIT_SEEDS)}.")
        return LazySplit(self.sizes[split], partial(make_row, SPLIT_SEEDS[split], image_size=self.image_size))

    def messages(self, row: dict) -> list[dict]:
        return image_question(row["image"], row["question"] + INSTRUCTION)

    def metrics(self, rows, completions, scores=None) -> dict[str, float]:
        """The default metrics, plus the share of trajectories that ran code and the accuracy with and without."""
        result = super().metrics(rows, completions, scores)
        if not completions:
            return result
        calls = [ran_code(c) for c in completions]
        result["tool_call_rate"] = sum(calls) / len(calls)
        for used, label in ((True, "with_tool"), (False, "without_tool")):
            pairs = [(r, c) for r, c, u in zip(rows, completions, calls, strict=True) if u == used]
            if pairs:
                result[f"accuracy/{label}"] = sum(exact_match_reward(c, r["answer"]) for r, c in pairs) / len(pairs)
        return result
