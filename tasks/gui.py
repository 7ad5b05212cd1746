"""`gui`: GUI grounding, point at the element an instruction names on a screenshot; and `GuiTask`, the base of the
ScreenSpot evaluations (tasks/screenspot.py, tasks/screenspot_pro.py).

Rows have a screenshot (`img_filename`, a path under data.image_root, or `image`), an `instruction` and the target
element's `bbox` in pixels of the screenshot, as `[x1, y1, x2, y2]` (`box_format="xyxy"`, GUI-R1's and GUI-G²'s
training data, ScreenSpot-Pro) or `[x, y, w, h]` (`"xywh"`, ScreenSpot and ScreenSpot-v2); optionally `img_size`
[W, H] (ScreenSpot-Pro's), `data_type` / `ui_type` (text or icon) and `gt_type` (ScreenSpot-Pro's "negative":
the element is not there, and only a refusal is right). data.path is a json or jsonl file of such rows, or a
folder holding them (`<split>.json[l]`, else every json / jsonl file in it). Without data.path, `gui` draws its
own screens (`make_screen`): a window with buttons, icons and text fields of four colours at random places.

The model answers with a click in its family's frame, which the family moves into original pixels before the
rewards read it (`uses_points`: pixels of the resized image for Qwen2.5-VL, 0-1000 for Qwen2-VL and Qwen3-VL;
models/points.py reads `(x, y)`, `[x, y]`, `<point>x y</point>`, UI-TARS' `click(start_box='(x,y)')`, GUI-R1's
`'point': [x, y]`, and a box `[x1, y1, x2, y2]` as its centre). Answers (`answer`): "point", GUI-R1's shape,
`<think>...</think><answer>(x, y)</answer>`; or "box", GUI-G²'s prompt and bare `[x1,y1,x2,y2]`.

Rewards: the names in `rewards` (gpg_vl/reward/gui.py's `GUI_REWARDS`: `point_in_box`, `gaussian_point`,
`gaussian_coverage`, each at its default weight unless `weights` names it), and `format` (`format_weight`; 1 when
the completion has the answer's shape and a readable click on the image). An answer without a readable click, or
whose click lies off the image, scores 0 on every reward and counts as wrong format (`wrong_format`). `accuracy`
(weight 0: reported, not trained on) is the benchmarks' hit: the click inside the box, edges included, compared
after dividing both by the image size (`normalized_hit`).

Broken data fails in one sentence before any model loads (`check_data`): a missing image file, a box that is not
four numbers, of negative or zero size, or not inside its image.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from functools import partial
from pathlib import Path

from PIL import Image, ImageDraw

from gpg_vl.data.sources import RowView, data_file, data_image_root
from gpg_vl.data.task import Task, column_text, image_question, register_task, row_name
from gpg_vl.errors import BadRow, UserError
from gpg_vl.reward.gui import GUI_REWARDS, Click, inside_image, normalized_hit, read_click
from gpg_vl.reward.primitives import extract_answer, format_reward

from .shapes import COLORS, LazySplit

BOX_FORMATS = ("xyxy", "xywh")
PROMPTS = {
    "point": ("{instruction}\nFind the element on the screenshot. Think in <think> </think>, then give the point to "
              "click as <answer>(x, y)</answer>."),
    # GUI-G²'s prompt (gaussian_grpo.py and its README's inference example)
    "box": "Outline the position corresponding to the instruction: {instruction}. The output should be only "
           "[x1,y1,x2,y2].",
}
REFUSE = {"point": " If the element is not on the screenshot, answer <answer>not found</answer>.",
          "box": " If the element is not on the screenshot, output only: not found."}
_BARE_BOX = re.compile(r"\[\s*-?\d+(?:\.\d+)?\s*(?:,\s*-?\d+(?:\.\d+)?\s*){3}\]")
DATA_SUFFIXES = (".json", ".jsonl")
IMAGE_COLUMNS = ("image", "img_filename", "image_path")  # image_path: GUI-G²'s training rows
BOX_COLUMNS = ("bbox", "abs_box", "gt_bbox")  # abs_box: GUI-G²'s rows; gt_bbox: GUI-R1's (xyxy both)
SPLIT_SEEDS = {"train": 0, "test": 1_000_003, "validation": 2_000_003}


# ---------------------------------------------------------------------------------------------
# rows: boxes, sizes, files
# ---------------------------------------------------------------------------------------------
def row_box(row: dict, box_format: str) -> tuple[float, float, float, float]:
    """The row's `bbox` (or `abs_box`, `gt_bbox`) as (x1, y1, x2, y2) pixels; `BadRow` when it is not four finite
    numbers, or has a negative or zero width or height."""
    values = next((row[column] for column in BOX_COLUMNS if row.get(column) is not None), None)
    try:
        numbers = [float(v) for v in values] if not isinstance(values, (str, bytes)) else []
    except (TypeError, ValueError):
        numbers = []
    if len(numbers) != 4 or not all(abs(v) < float("inf") for v in numbers):
        raise BadRow("bad box", f"{row_name(row)} has the bbox {values!r}: not four finite numbers; fix or drop it.")
    x, y, third, fourth = numbers
    x2, y2 = (x + third, y + fourth) if box_format == "xywh" else (third, fourth)
    shown = f"{values!r} ({box_format})"
    if x2 < x or y2 < y:
        raise BadRow("negative box", f"{row_name(row)} has the bbox {shown}, of negative width or height; fix its "
                                     "corners (or task.options.box_format) or drop the row.")
    if x2 == x or y2 == y:
        raise BadRow("zero-size box", f"{row_name(row)} has the bbox {shown}, of zero width or height; drop the row.")
    return x, y, x2, y2


def check_inside(box: Sequence[float], size: Sequence[int], row: dict) -> None:
    """`BadRow` ("box outside its image") unless the box lies within the image (W, H), edges included."""
    if box[0] < 0 or box[1] < 0 or box[2] > size[0] or box[3] > size[1]:
        shown = [round(v, 2) for v in box]
        raise BadRow("box outside its image", f"{row_name(row)} has the box {shown} outside its {size[0]}x{size[1]} "
                                              "image; fix the box (or its format) or drop the row.")


def read_records(path: Path) -> list[dict]:
    """The rows of one json file (a list of objects) or jsonl file (one object a line); each gets `source` (the
    file's stem) and `number` (its position in the file)."""
    import json

    try:
        text = path.read_text()
        rows = json.loads(text) if path.suffix == ".json" else [json.loads(line) for line in text.splitlines()
                                                                 if line.strip()]
    except (OSError, ValueError) as error:
        raise UserError(f"could not read {str(path)!r} as {path.suffix[1:]} ({str(error)[:200]}); point data.path= "
                        "at the benchmark's annotation files.") from None
    if not isinstance(rows, list) or not all(isinstance(row, dict) for row in rows):
        raise UserError(f"{str(path)!r} does not hold a list of rows (objects); point data.path= at the annotation "
                        "files (a json list, or jsonl).")
    return [{**row, "source": path.stem, "number": number} for number, row in enumerate(rows)]


def data_files(path: Path, split: str | None) -> list[Path]:
    """The json / jsonl files of `split` under data.path: the file itself; in a folder, `<split>.json[l]` when there
    is one, else every json / jsonl file in it (a benchmark's annotation folder), in name order; `split` None: all."""
    if not path.exists():
        raise UserError(f"data.path {str(path)!r} does not exist; pass the annotation file or folder.")
    if path.is_file():
        if path.suffix not in DATA_SUFFIXES:
            raise UserError(f"data.path {str(path)!r} is not a json or jsonl file; GUI grounding reads the benchmarks' "
                            "annotation files (json lists, or jsonl).")
        return [path]
    files = sorted(file for file in path.iterdir() if file.is_file() and file.suffix in DATA_SUFFIXES)
    named = [file for file in files if file.stem == split]
    if not files:
        raise UserError(f"data.path {str(path)!r} holds no json or jsonl file; pass the annotation file or folder.")
    return named or files


def image_size(value, root: str | None, allow_outside: bool, row: dict) -> tuple[int, int]:
    """(W, H) of a row's image: a PIL image's, else read from the file's header (the pixels are not decoded)."""
    if isinstance(value, Image.Image):
        return value.size
    if not isinstance(value, (str, Path)):
        raise BadRow("missing image", f"{row_name(row)} has no image path (img_filename or image); check the data.")
    file = data_file(value, root, allow_outside, "image")
    try:
        with Image.open(file) as image:
            return image.size
    except (OSError, ValueError, SyntaxError) as error:
        raise BadRow("corrupt image", f"could not read the image {str(file)!r} of {row_name(row)} ({error}); replace "
                                      "it or drop the row.") from None


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def accuracy_counts(results: Sequence[dict]) -> dict[str, float]:
    """ScreenSpot-Pro's `calc_metric_for_result_list` (SeeClick reports the same five numbers): of `results`, each
    {"correctness": "correct" | "wrong" | "wrong_format", "ui_type": "text" | "icon", ...}, the counts and the
    accuracies overall and per element type (0 where there is no row)."""
    total = len(results)
    correct = sum(r["correctness"] == "correct" for r in results)
    kinds = {kind: [r["correctness"] == "correct" for r in results if r.get("ui_type") == kind]
             for kind in ("text", "icon")}
    return {"num_correct_action": correct, "num_total": total,
            "wrong_format_num": sum(r["correctness"] == "wrong_format" for r in results),
            "action_acc": correct / total if total else 0, "text_acc": mean(kinds["text"]),
            "icon_acc": mean(kinds["icon"])}


# ---------------------------------------------------------------------------------------------
# the base of the GUI grounding tasks
# ---------------------------------------------------------------------------------------------
class GuiTask(Task):
    """GUI grounding: the shared reading, rewards, checks and pages of `gui`, `screenspot` and `screenspot_pro`
    (see the module doc). Subclasses set `name`, `box_format` and `load`."""

    uses_boxes = True  # the target box in original pixels (pages, rollout log)
    uses_points = True  # the family moves the answer's points and boxes into original pixels
    box_format = "xyxy"
    prediction_rule = "right: the click lies inside the target box, edges included (ScreenSpot's check)"

    def __init__(self, rewards: str | Sequence[str] = ("point_in_box",), answer: str = "point",
                 format_weight: float = 0.2, weights: dict | None = None) -> None:
        super().__init__()
        names = [rewards] if isinstance(rewards, str) else list(rewards)
        if not names:
            raise UserError(f"task {self.name} needs at least one reward in task.options.rewards; valid: "
                            f"{', '.join(GUI_REWARDS.names())}.")
        functions = {name: GUI_REWARDS.get(str(name)) for name in names}  # an unknown name: one sentence
        if answer not in PROMPTS:
            raise UserError(f"task {self.name} has no answer {answer!r}; set task.options.answer to one of "
                            f"{', '.join(PROMPTS)}.")
        weights = dict(weights or {})
        unknown = sorted(set(weights) - set(functions))
        if unknown:
            raise UserError(f"task.options.weights names {unknown}, not among task.options.rewards "
                            f"{list(functions)}; weigh only the rewards the task uses (format: format_weight).")
        self.answer = answer
        self.reward_functions = {name: partial(self.click_reward, fn) for name, fn in functions.items()}
        self.reward_functions["format"] = self.format_score
        self.reward_functions["accuracy"] = lambda completion, row: float(self.verdict(completion, row) == "correct")
        self.reward_weights = {name: float(weights.get(name, fn.weight)) for name, fn in functions.items()}
        self.reward_weights.update(format=float(format_weight), accuracy=0.0)

    # ---- data -------------------------------------------------------------------------------------
    def root(self) -> str | None:
        return data_image_root(self.image_root, self.data_path)

    def image_value(self, row: dict):
        """The row's image: `image`, or a path in `img_filename` (ScreenSpot) or `image_path` (GUI-G²'s rows)."""
        return next((row[column] for column in IMAGE_COLUMNS if row.get(column) is not None), None)

    def prepare_targets(self, row: dict) -> dict:
        """`box` (x1, y1, x2, y2 pixels), `image_size` (W, H: the row's `img_size` when it has one, as ScreenSpot-Pro
        normalises by it, else the image's) and `negative` (ScreenSpot-Pro's gt_type "negative"); `BadRow` for a
        box that is not usable or not inside its image."""
        if row.get("image_size") is not None:
            size = tuple(int(v) for v in row["image_size"])
        elif row.get("img_size") is not None:
            size = tuple(int(v) for v in row["img_size"])
        else:
            size = image_size(self.image_value(row), self.root(), self.allow_outside_paths, row)
        box = row_box(row, self.box_format) if row.get("box") is None else tuple(row["box"])
        check_inside(box, size, row)
        return {"box": box, "image_size": size, "negative": str(row.get("gt_type", "positive")) == "negative"}

    def check_row(self, row: dict) -> None:
        column_text(row, "instruction", "instruction")
        self.scoring_row(row)  # BadRow for a bad box

    def check_data(self) -> None:
        """Every row of data.path's files: an instruction, a usable box inside its image, an image file that exists
        (its header read for the size; it must be the row's `img_size` where it has one). The first problem ends here
        in one sentence, with the count of bad rows."""
        if self.data_path is None:
            return
        problems, first = 0, None
        for file in data_files(Path(self.data_path).expanduser(), None):
            for record in read_records(file):
                row = {**record, "id": record.get("id", f"{record['source']}-{record['number']}")}
                try:
                    self.check_row(row)
                    size = image_size(self.image_value(row), self.root(), self.allow_outside_paths, row)
                    if size != self.scoring_row(row)["image_size"]:
                        raise BadRow("image size mismatch", f"{row_name(row)} gives img_size {row['img_size']} for a "
                                                            f"{size[0]}x{size[1]} image; fix img_size or the image.")
                except BadRow as error:
                    problems += 1
                    first = first or f"{file.name}, row {record['number']}: {error}"
        if first:
            raise UserError(f"{first.rstrip('.')} ({problems} bad row(s) in {self.data_path!r}, checked before the "
                            "model loads).")

    def load_records(self, split: str) -> RowView:
        """The rows of data.path for `split` (`data_files`), each with an `id` and its targets."""
        records = [r for file in data_files(Path(self.data_path).expanduser(), split) for r in read_records(file)]
        return RowView(records, lambda index, row: self.prepared(row))

    def prepared(self, row: dict) -> dict:
        row.setdefault("id", f"{row.get('source', self.name)}-{row.get('number', 0)}")
        return {**row, **self.prepare_targets(row)}

    def messages(self, row: dict) -> list[dict]:
        row = self.scoring_row(row)
        image = self.open_image(self.image_value(row), row=row["id"])
        if image.size != tuple(row["image_size"]):
            raise BadRow("image size mismatch", f"{row_name(row)} gives img_size {list(row['image_size'])} for a "
                                                f"{image.width}x{image.height} image; fix img_size or the image.")
        text = PROMPTS[self.answer].format(instruction=column_text(row, "instruction", "instruction"))
        return image_question(image, text + (REFUSE[self.answer] if row["negative"] else ""))

    def target(self, row: dict) -> str:
        row = self.scoring_row(row)
        box = "[" + ", ".join(f"{v:g}" for v in row["box"]) + "]"
        return f"not on the screen (the instruction's element is elsewhere: {box})" if row["negative"] else box

    # ---- reading and scoring ------------------------------------------------------------------------
    def answer_text(self, completion: str) -> str | None:
        """What the click is read from: the `<answer>` (answer "point"), or the whole completion ("box")."""
        return extract_answer(completion) if self.answer == "point" else completion

    def click(self, completion: str, row: dict) -> Click | None:
        """The completion's click, in original pixels; None when it has none readable or its point lies off the
        image (`row` prepared: its `image_size`). A refusal is a click without a point."""
        found = read_click(self.answer_text(completion))
        if found is None or (found.point is not None and not inside_image(found.point, row["image_size"])):
            return None
        return found

    def click_reward(self, reward, completion: str, row: dict) -> float:
        """A GUI reward of the completion: 0 without a readable click on the image; on a negative row 1 for a
        refusal, else `reward(click, box)`."""
        found = self.click(completion, row)
        if found is None:
            return 0.0
        if row["negative"]:
            return float(found.refused)
        return 0.0 if found.point is None else float(reward(found, row["box"]))

    def format_score(self, completion: str, row: dict) -> float:
        """1.0 when the completion has the answer's shape (GUI-R1's `<think>...</think><answer>...</answer>`, matched
        as written; or GUI-G²'s bare `[x1,y1,x2,y2]`) and a readable click on the image (or a refusal), else 0.0."""
        if self.answer == "point":
            shaped = format_reward(completion, strip=False) == 1.0
        else:
            shaped = bool(_BARE_BOX.fullmatch(completion.strip())) or read_click(completion) == Click(None, None, True)
        return float(shaped and self.click(completion, row) is not None)

    def verdict(self, completion: str, row: dict) -> str:
        """"correct", "wrong" or "wrong_format", as ScreenSpot-Pro's `eval_screenspot_pro.py` (and SeeClick's
        `screenspot_test.py` for positive rows) decide: a positive row without a point is wrong format, else correct
        when `normalized_hit`; a negative row is correct on a refusal, wrong on a click, else wrong format."""
        row = self.scoring_row(row)
        found = read_click(self.answer_text(completion))
        if row["negative"]:
            if found is not None and found.refused:
                return "correct"
            return "wrong" if found is not None and found.point is not None else "wrong_format"
        if found is None or found.point is None:
            return "wrong_format"
        return "correct" if normalized_hit(found.point, row["box"], row["image_size"]) else "wrong"

    def results(self, rows: Sequence[dict], completions: Sequence[str], fields: Sequence[str]) -> list[dict]:
        """One benchmark result per completion: the row's `fields`, `ui_type` and the `correctness` (`verdict`)."""
        out = []
        for row, completion in zip(rows, completions, strict=True):
            row = self.scoring_row(row)
            kind = row.get("ui_type", row.get("data_type"))
            out.append({**{field: row.get(field) for field in fields}, "ui_type": kind,
                        "correctness": self.verdict(completion, row)})
        return out

    def metrics(self, rows: Sequence[dict], completions: Sequence[str],
                scores: Sequence[dict] | None = None) -> dict[str, float]:
        """The reward means, `accuracy` (the benchmarks' hit), `wrong_format` (the share of completions without a
        readable click on the image) and the accuracy per value of each `group_columns` column."""
        rows = [self.scoring_row(row) for row in rows]
        result = super().metrics(rows, completions, scores)
        result["wrong_format"] = mean([self.click(c, r) is None for r, c in zip(rows, completions, strict=True)])
        for column in self.group_columns:
            values = sorted({str(row.get(column)) for row in rows if row.get(column) is not None})
            for value in values:
                pairs = [(r, c) for r, c in zip(rows, completions, strict=True) if str(r.get(column)) == value]
                result[f"accuracy/{value}"] = mean([self.verdict(c, r) == "correct" for r, c in pairs])
        return result

    # ---- pages (gpg_vl/observe/viewer.py, rollout_log.py) ---------------------------------------------
    def answer_point(self, completion: str) -> list[float] | None:
        """The click the pages draw (original pixels), None without one."""
        found = read_click(self.answer_text(completion))
        return None if found is None or found.point is None else [float(v) for v in found.point]

    def answer_region(self, completion: str) -> list[float] | None:
        """The box the answer gave, when it gave one (GUI-G²'s answers), drawn with its centre."""
        found = read_click(self.answer_text(completion))
        return None if found is None or found.box is None else [float(v) for v in found.box]

    def prediction_right(self, completion: str, row: dict) -> bool:
        return self.verdict(completion, row) == "correct"


# ---------------------------------------------------------------------------------------------
# synthetic screens
# ---------------------------------------------------------------------------------------------
KINDS = ("button", "icon", "field")
LABELS = ("OK", "Save", "Open", "Send", "Next", "Done", "Edit", "Help")
ICON_SHAPES = ("circle", "square", "triangle")
DESKTOP, TITLE, BODY, FIELD_TEXT = (196, 204, 218), (60, 64, 72), (244, 244, 246), (150, 150, 150)


def element_size(rng: random.Random, kind: str, scale: float) -> tuple[int, int]:
    """A kind's width and height at `scale` (1 for a 448 x 336 screen)."""
    if kind == "button":
        return round(rng.uniform(112, 160) * scale), round(rng.uniform(52, 72) * scale)
    if kind == "icon":
        side = round(rng.uniform(60, 76) * scale)
        return side, side
    return round(rng.uniform(150, 200) * scale), round(rng.uniform(50, 60) * scale)


def place(rng: random.Random, size: tuple[int, int], area: tuple[int, int, int, int], taken: list, gap: int):
    """A box of `size` at a random place inside `area` clear of the `taken` boxes (None after 200 tries)."""
    width, height = size
    for _ in range(200):
        x1 = rng.randint(area[0], area[2] - width)
        y1 = rng.randint(area[1], area[3] - height)
        box = (x1, y1, x1 + width, y1 + height)
        if all(box[2] + gap <= t[0] or t[2] + gap <= box[0] or box[3] + gap <= t[1] or t[3] + gap <= box[1]
               for t in taken):
            return box
    return None


def draw_element(draw: ImageDraw.ImageDraw, element: dict) -> None:
    x1, y1, x2, y2 = element["bbox"]
    fill = COLORS[element["color"]]
    if element["kind"] == "button":
        draw.rounded_rectangle((x1, y1, x2 - 1, y2 - 1), radius=(y2 - y1) // 4, fill=fill)
        draw.text(((x1 + x2) / 2, (y1 + y2) / 2), element["label"], fill=(255, 255, 255), anchor="mm")
    elif element["kind"] == "icon":
        inset = (x2 - x1) // 6
        draw.rounded_rectangle((x1, y1, x2 - 1, y2 - 1), radius=inset, fill=(228, 230, 236))
        box = (x1 + inset, y1 + inset, x2 - 1 - inset, y2 - 1 - inset)
        if element["shape"] == "circle":
            draw.ellipse(box, fill=fill)
        elif element["shape"] == "square":
            draw.rectangle(box, fill=fill)
        else:
            draw.polygon([((box[0] + box[2]) / 2, box[1]), (box[0], box[3]), (box[2], box[3])], fill=fill)
    else:
        border = max(2, (y2 - y1) // 8)
        draw.rectangle((x1, y1, x2 - 1, y2 - 1), fill=fill)
        draw.rectangle((x1 + border, y1 + border, x2 - 1 - border, y2 - 1 - border), fill=(255, 255, 255))
        draw.text((x1 + 2 * border, (y1 + y2) / 2), "Search...", fill=FIELD_TEXT, anchor="lm")


def make_screen(seed: int, index: int, width: int = 448, height: int = 336, elements: int = 4) -> dict:
    """Row `index` of the split seeded by `seed` (the same arguments give the same row): a desktop holding one
    window with `elements` elements (buttons, icons, text fields), each of its own colour, at random places; the
    instruction names one by its colour and kind. `bbox` is its box (x1, y1, x2, y2; x2, y2 the far pixel edges)."""
    rng = random.Random(seed * 1_000_003 + index)
    scale = min(width / 448, height / 336)
    image = Image.new("RGB", (width, height), DESKTOP)
    draw = ImageDraw.Draw(image)
    draw.rectangle((0, height - round(20 * scale), width, height), fill=TITLE)  # a task bar
    left, top = rng.randint(0, round(40 * scale)), rng.randint(0, round(24 * scale))
    right = width - rng.randint(0, round(40 * scale))
    bottom = height - round(20 * scale) - rng.randint(0, round(16 * scale))
    bar = round(24 * scale)
    draw.rectangle((left, top, right - 1, bottom - 1), fill=BODY, outline=TITLE)
    draw.rectangle((left, top, right - 1, top + bar), fill=TITLE)
    for k, colour in enumerate(((236, 95, 90), (245, 190, 80), (98, 197, 84))):
        cx, cy, r = left + bar * (0.6 + 0.8 * k), top + bar / 2, bar / 5
        draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=colour)
    area = (left + round(8 * scale), top + bar + round(8 * scale), right - round(8 * scale), bottom - round(8 * scale))
    colors = rng.sample(list(COLORS), min(elements, len(COLORS)))
    placed = []
    for colour in colors:
        kind = rng.choice(KINDS)
        box = place(rng, element_size(rng, kind, scale), area, [e["bbox"] for e in placed], round(8 * scale))
        if box is not None:
            placed.append({"kind": kind, "color": colour, "bbox": box, "label": rng.choice(LABELS),
                           "shape": rng.choice(ICON_SHAPES)})
    for element in placed:
        draw_element(draw, element)
    target = placed[index % len(placed)]
    names = {"button": f"the {target['color']} '{target['label']}' button",
             "field": f"the {target['color']} text field", "icon": f"the {target['color']} {target['shape']} icon"}
    return {"id": f"gui-{seed}-{index}", "image": image, "image_size": (width, height), "negative": False,
            "instruction": f"Click {names[target['kind']]}.", "bbox": list(target["bbox"]), "box": target["bbox"],
            "data_type": "icon" if target["kind"] == "icon" else "text", "kind": target["kind"],
            "color": target["color"], "elements": placed}


@register_task
class Gui(GuiTask):
    """GUI grounding on synthetic screens (no data.path) or on rows in ScreenSpot's shape (data.path, boxes
    `box_format`); rewards picked by name."""

    name = "gui"
    group_columns = ("data_type",)

    def __init__(self, rewards: str | Sequence[str] = ("point_in_box",), answer: str = "point",
                 format_weight: float = 0.2, weights: dict | None = None, box_format: str = "xyxy",
                 train_size: int = 20_000, test_size: int = 200, width: int = 448, height: int = 336,
                 elements: int = 4, instruction_first: bool = False) -> None:
        super().__init__(rewards=rewards, answer=answer, format_weight=format_weight, weights=weights)
        self.instruction_first = bool(instruction_first)
        if box_format not in BOX_FORMATS:
            raise UserError(f"task gui has no box_format {box_format!r}; set task.options.box_format to one of "
                            f"{', '.join(BOX_FORMATS)}.")
        if min(width, height) < 112 or not 1 <= elements <= len(COLORS):
            raise UserError(f"task gui draws screens of at least 112 pixels a side with 1 to {len(COLORS)} elements; "
                            f"got {width}x{height} with {elements}.")
        self.box_format = box_format
        self.sizes = {"train": train_size, "test": test_size, "validation": test_size}
        self.screen = {"width": int(width), "height": int(height), "elements": int(elements)}

    def messages(self, row: dict) -> list[dict]:
        """The screenshot then the question; `instruction_first`: the question, then the screenshot (so that, read
        left to right, each image token can already know which element is named)."""
        messages = super().messages(row)
        if self.instruction_first:
            messages[0]["content"] = messages[0]["content"][::-1]
        return messages

    def load(self, split: str):
        if self.data_path is not None:
            return self.load_records(split)
        if split not in SPLIT_SEEDS:
            raise UserError(f"task gui has no split {split!r}; use one of {sorted(SPLIT_SEEDS)}.")
        return LazySplit(self.sizes[split], partial(make_screen, SPLIT_SEEDS[split], **self.screen))
