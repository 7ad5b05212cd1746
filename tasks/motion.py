"""`motion`: synthetic video reasoning, generated from seeds, no download (the video counterpart of `shapes`).

Each row is a short clip (a list of frames, `frames` of them, `frame_size` pixels square) in which one coloured
dot moves in a straight line, left, right, up or down, at an even pace, across the middle of the frame. The
question names the axis and asks which way along it the dot moves ("Is the red dot moving left or right?",
"... up or down?"), in the words of `shapes`' left/right questions, which the tiny model was warm-started on.
The reference completion states the finding inside <think> and answers in <answer>; the accuracy reward is an
exact match of the answer. Frames are small (four of 56 pixels by default, the dot standing two frames at each
of its two positions) so that the tiny embedded model reads a clip on CPU in a few tokens.

`question=first_colour` asks instead which colour appears first: the clip's first moment (its first half of frames,
one temporal patch of two frames by default) shows a disc of one colour, its second moment a disc of another
(both from `colours`, every colour first equally often, in turn), and the answer is the first
colour's name. The tiny model reads colour best: with the format reward off (`format_weight=0`) this is the
question it learns (docs/results/motion.md).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from functools import partial

from PIL import Image, ImageDraw

from gpg_vl.data.task import Task, register_task
from gpg_vl.errors import UserError

from .shapes import COLORS, INSTRUCTION, SPLIT_SEEDS, LazySplit, Shapes
from .videor1 import group_accuracy

DIRECTIONS = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}
AXES = {"left": "left or right", "right": "left or right", "up": "up or down", "down": "up or down"}
FPS = 2.0  # the clip's frame rate: frames are half a second apart


def dot_path(rng: random.Random, direction: str, positions: int, size: int) -> tuple[int, list[tuple[int, int]]]:
    """(radius, the dot's centre at each of `positions` stops): a straight move along `direction` at an even pace
    from a random start in the first half of the frame (counted in the moving direction) to a random end in the
    second half, so the dot always crosses the middle, at a random place across."""
    radius = max(2, size // 12)
    low, high, middle = radius + 1, size - radius - 2, size // 2  # where a centre may lie, and the midline
    start, end = rng.randint(low, middle - radius - 1), rng.randint(middle + radius, high)
    dx, dy = DIRECTIONS[direction]
    across = rng.randint(low, high)
    points = []
    for k in range(positions):
        position = round(start + (end - start) * k / (positions - 1))
        moving = position if (dx + dy) > 0 else size - 1 - position
        points.append((moving, across) if dx else (across, moving))
    return radius, points


def draw_frames(points: Sequence[tuple[int, int]], radius: int, color: str, size: int) -> list[Image.Image]:
    """One white frame per centre, the dot drawn at it."""
    frames = []
    for x, y in points:
        frame = Image.new("RGB", (size, size), (255, 255, 255))
        ImageDraw.Draw(frame).ellipse((x - radius, y - radius, x + radius, y + radius), fill=COLORS[color])
        frames.append(frame)
    return frames


def make_clip(seed: int, index: int, frames: int = 4, frame_size: int = 56,
              directions: Sequence[str] = tuple(DIRECTIONS), hold: int = 2) -> dict:
    """Row `index` of the split seeded by `seed`; the same arguments always give the same row. The dot stands
    `hold` frames at each of its frames // hold positions."""
    rng = random.Random(seed * 1_000_003 + index)
    direction = rng.choice(sorted(directions))
    color = rng.choice(sorted(COLORS))
    radius, stops = dot_path(rng, direction, frames // hold, frame_size)
    points = [point for point in stops for _ in range(hold)]
    return {
        "id": f"motion-{seed}-{index}",
        "frames": draw_frames(points, radius, color, frame_size),
        "question": f"Is the {color} dot moving {AXES[direction]}?",
        "answer": direction,
        "direction": direction,
        "points": points,
        "solution": f"<think> the {color} dot moves {direction} </think>\n<answer> {direction} </answer>",
    }


def make_colour_clip(seed: int, index: int, frames: int = 4, frame_size: int = 56,
                     colours: Sequence[str] = ("blue", "red")) -> dict:
    """Row `index` of a `first_colour` split: frames 0 .. frames/2 - 1 show a disc of colour `first`, the rest a
    disc of colour `then` (another of `colours`), each at its own random place and size."""
    rng = random.Random(seed * 1_000_003 + index)
    palette = sorted(colours)
    first = palette[index % len(palette)]  # each colour first equally often: a constant answer scores 1 / len
    then = rng.choice([colour for colour in palette if colour != first])
    clip = []
    for colour in (first, then):
        radius = rng.randint(frame_size // 8, frame_size // 4)
        centre = (rng.randint(radius + 1, frame_size - radius - 2), rng.randint(radius + 1, frame_size - radius - 2))
        clip += draw_frames([centre] * (frames // 2), radius, colour, frame_size)
    return {
        "id": f"motion-{seed}-{index}",
        "frames": clip,
        "question": "What color is the shape?",  # shapes' colour question, word for word: the tiny model answers it
        "answer": first,
        "first": first,
        "colours": [first, then],
        "solution": f"<think> the shape is {first} first, then {then} </think>\n<answer> {first} </answer>",
    }


# the questions a clip can ask: the column its metrics group by, and how a task makes row `index` of seed `seed`
QUESTIONS: dict[str, tuple[str, Callable[[Motion, int, int], dict]]] = {
    "direction": ("direction", lambda task, seed, index: make_clip(seed, index, task.frames, task.frame_size,
                                                                    task.directions, task.hold)),
    "first_colour": ("first", lambda task, seed, index: make_colour_clip(seed, index, task.frames, task.frame_size,
                                                                         task.colours)),
}


@register_task
class Motion(Shapes):
    """Which way does the dot move (left or right, up or down), or which colour appears first? Clips as frame lists;
    `shapes`' rewards (exact match + format) and splits."""

    name = "motion"
    inputs = ("image", "video")

    def __init__(self, train_size: int = 20_000, test_size: int = 200, frames: int = 4, frame_size: int = 56,
                 directions: Sequence[str] = tuple(DIRECTIONS), hold: int = 2, question: str = "direction",
                 colours: Sequence[str] = ("blue", "red"), format_weight: float = 1.0) -> None:
        super().__init__(train_size=train_size, test_size=test_size)
        self.check_question(question, colours)
        if not 0 <= format_weight <= 1:
            raise UserError(f"task motion's format_weight weighs the format reward against the answer's (1), so it "
                            f"lies in 0 .. 1; got {format_weight}, set task.options.format_weight=0.")
        self.reward_weights = {**self.reward_weights, "format": float(format_weight)}
        self.question, self.colours = question, tuple(sorted(set(colours)))
        self.group_columns = (QUESTIONS[question][0],)
        if frames < 2 or frames % 2:
            raise UserError(f"task motion takes an even number of frames, 2 or more (frames pair up); got {frames}, "
                            "set task.options.frames=4.")
        if hold < 1 or frames % hold or frames // hold < 2:
            raise UserError(f"task motion holds the dot `hold` frames at each position, so frames must be a multiple "
                            f"of hold with two positions at least; got frames={frames}, hold={hold}: set "
                            "task.options.hold=1.")
        unknown = sorted(set(directions) - set(DIRECTIONS))
        if unknown or not directions:
            raise UserError(f"task motion moves the dot {', '.join(DIRECTIONS)}; got directions {list(directions)}, "
                            "set task.options.directions to some of those.")
        self.directions, self.hold = tuple(sorted(set(directions))), hold
        if frame_size < 28 or frame_size % 28:
            raise UserError(f"task motion takes a frame_size that is a multiple of 28 (whole merged patches); got "
                            f"{frame_size}, set task.options.frame_size=56.")
        self.frames, self.frame_size = frames, frame_size

    @staticmethod
    def check_question(question: str, colours: Sequence[str]) -> None:
        if question not in QUESTIONS:
            raise UserError(f"task motion asks one of the questions {', '.join(QUESTIONS)}; got {question!r}, set "
                            "task.options.question=first_colour.")
        unknown = sorted(set(colours) - set(COLORS))
        if unknown or len(set(colours)) < 2:
            raise UserError(f"task motion's first_colour clips show two or more of the colours {', '.join(COLORS)}; "
                            f"got colours {list(colours)}, set task.options.colours=[blue,red].")

    def load(self, split: str) -> LazySplit:
        if split not in SPLIT_SEEDS:
            raise UserError(f"task motion has no split {split!r}; use one of {sorted(SPLIT_SEEDS)}.")
        seed = SPLIT_SEEDS[split]
        make = QUESTIONS[self.question][1]
        return LazySplit(self.sizes[split], partial(make, self, seed))

    def messages(self, row: dict) -> list[dict]:
        pixels = self.frame_size * self.frame_size  # keep the frames at their size (no up-scaling to a video minimum)
        video = {"type": "video", "video": row["frames"], "fps": FPS, "min_pixels": pixels, "max_pixels": pixels}
        return [{"role": "user", "content": [video, {"type": "text", "text": row["question"] + INSTRUCTION}]}]

    def metrics(self, rows, completions, scores=None) -> dict[str, float]:
        """The default metrics and `accuracy/<direction>` (or `accuracy/<first colour>`)."""
        scores = self.scored(rows, completions, scores)
        return {**Task.metrics(self, rows, completions, scores), **group_accuracy(rows, scores, self.group_columns)}
