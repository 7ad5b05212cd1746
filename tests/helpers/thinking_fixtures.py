"""Fixtures of the thinking-with-images benchmarks in their published layouts, built on the fly: V* Bench
(`test_questions.jsonl` + image folders, and lmms-eval's parquet copy), HR-Bench (tsv with base64 images, some
rows naming another row's image by its index, and parquet) and DeepEyes-47k (parquet). Each image is large
(640 x 480) and its target small (a 12-pixel square), as in the benchmarks: the detail needs a crop."""

from __future__ import annotations

import base64
import io
import json

import datasets
from PIL import Image, ImageDraw

SIZE = (640, 480)
COLOURS = {"red": (210, 40, 40), "blue": (40, 70, 220), "green": (40, 160, 60), "yellow": (230, 190, 30)}
V_STAR_LINE = "Answer with the option's letter from the given choices directly."


def picture(colour: str, at: tuple[int, int] = (400, 300), second: str | None = None) -> Image.Image:
    """A grey 640 x 480 image with a 12-pixel square of `colour` at `at` (and one of `second` 200 px left of it)."""
    image = Image.new("RGB", SIZE, (128, 128, 128))
    draw = ImageDraw.Draw(image)
    x, y = at
    draw.rectangle((x, y, x + 12, y + 12), fill=COLOURS[colour])
    if second:
        draw.rectangle((x - 200, y, x - 188, y + 12), fill=COLOURS[second])
    return image


def jpeg(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=95)
    return buffer.getvalue()


# ---------------------------------------------------------------- V* Bench
# (category, question, options, file); the label is always A, as published
VSTAR_ROWS = [
    ("direct_attributes", "What is the color of the square?", ["red", "blue", "green", "yellow"], "sa_1.jpg"),
    ("direct_attributes", "What is the color of the small square?", ["blue", "red", "green", "yellow"], "sa_2.jpg"),
    ("direct_attributes", "What is the color of the tiny square?", ["green", "blue", "red", "yellow"], "sa_3.jpg"),
    ("relative_position", "Is the red square on the left or right side of the blue square?", ["right", "left"],
     "sa_4.jpg"),
    ("relative_position", "Is the blue square on the left or right side of the red square?", ["left", "right"],
     "sa_5.jpg"),
]


def vstar_text(question: str, options: list[str]) -> str:
    lines = [f"({'ABCD'[i]}) {option}" for i, option in enumerate(options)]
    return "\n".join([question, *lines, V_STAR_LINE])


def vstar_image(index: int) -> Image.Image:
    category, _, options, _ = VSTAR_ROWS[index]
    if category == "relative_position":
        return picture("red", second="blue")  # the blue square 200 px left of the red one
    return picture(options[0])


def vstar_folder(path):
    """craigwu/vstar_bench's layout: test_questions.jsonl and the category folders of images."""
    lines = []
    for index, (category, question, options, name) in enumerate(VSTAR_ROWS):
        (path / category).mkdir(parents=True, exist_ok=True)
        vstar_image(index).save(path / category / name)
        question_id = index if index % 2 else str(index)  # int on some rows, str on others, as published
        lines.append(json.dumps({"image": f"{category}/{name}", "text": vstar_text(question, options),
                                 "category": category, "question_id": question_id, "label": "A"}))
    (path / "test_questions.jsonl").write_text("\n".join(lines) + "\n")
    return path


def vstar_parquet(path):
    """lmms-eval's copy: image, text, label, category, question_id in one parquet file."""
    features = datasets.Features({"image": datasets.Image(), "text": datasets.Value("string"),
                                  "label": datasets.Value("string"), "category": datasets.Value("string"),
                                  "question_id": datasets.Value("string")})
    columns = {name: [] for name in features}
    for index, (category, question, options, _) in enumerate(VSTAR_ROWS):
        columns["image"].append(vstar_image(index))
        columns["text"].append(vstar_text(question, options))
        columns["label"].append("A")
        columns["category"].append(category)
        columns["question_id"].append(str(index))
    datasets.Dataset.from_dict(columns, features=features).to_parquet(str(path))
    return path


# ---------------------------------------------------------------- HR-Bench
# (category, question, options in cycle 1 with the right one first); each appears in 4 rotations
HR_QUESTIONS = [
    ("single", "What color is the small square?", ["red", "blue", "green", "yellow"]),
    ("cross", "Which two colors appear in the image?", ["red and blue", "green and red", "blue and yellow",
                                                       "yellow and green"]),
]


def hrbench_rows() -> list[dict]:
    """8 rows: each question in its 4 cycles, the options rotated one step per cycle; the first row of each
    question holds the base64 image, the others the index of that row (VLMEvalKit's tsv)."""
    rows = []
    for category, question, options in HR_QUESTIONS:
        image = picture("red", second="blue" if category == "cross" else None)
        first = len(rows)
        for cycle in range(4):
            rotated = options[cycle:] + options[:cycle]
            rows.append({"index": len(rows), "question": question, "answer": "ABCD"[rotated.index(options[0])],
                         "category": category, **dict(zip("ABCD", rotated, strict=True)),
                         "cycle_category": f"cycle{cycle + 1}",
                         "image": base64.b64encode(jpeg(image)).decode() if cycle == 0 else str(first)})
    return rows


def hrbench_tsv(path):
    columns = ["index", "question", "answer", "category", "A", "B", "C", "D", "cycle_category", "image"]
    lines = ["\t".join(columns)] + ["\t".join(str(row[c]) for c in columns) for row in hrbench_rows()]
    path.write_text("\n".join(lines) + "\n")
    return path


def hrbench_parquet(path):
    rows = hrbench_rows()
    for row in rows:  # the parquet copy holds every row's image
        if row["image"].isdigit():
            row["image"] = rows[int(row["image"])]["image"]
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    return path


# ---------------------------------------------------------------- DeepEyes-47k
DEEPEYES_SYSTEM = (
    "You are a helpful assistant.\n\n# Tools\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    '{"type":"function","function":{"name":"image_zoom_in_tool","description":"Zoom in on a specific region of an '
    'image by cropping it based on a bounding box (bbox) and an optional object label.","parameters":{"type":'
    '"object","properties":{"bbox_2d":{"type":"array","items":{"type":"number"},"minItems":4,"maxItems":4},'
    '"label":{"type":"string"}},"required":["bbox_2d"]}}}\n</tools>\n\n# How to call a tool\nReturn a json object '
    "with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')
DEEPEYES_SUFFIX = ("\n\nThink first, call **image_zoom_in_tool** if needed, then answer. Format strictly as:  "
                   "<think>...</think>  <tool_call>...</tool_call> (if tools needed)  <answer>...</answer> ")
# (question, ground truth, colour of the square); a letter, a short answer, a number, a sentence (needs a judge)
DEEPEYES_ROWS = [
    ("What is the color of the square?\n(A) blue\n(B) red", "B", "red"),
    ("What is the color of the square?", "green", "green"),
    ("How many squares are in the image?", "1", "yellow"),
    ("What is the color of the square?", "The square is blue.", "blue"),
]


def deepeyes_parquet(path):
    rows = []
    for index, (question, truth, colour) in enumerate(DEEPEYES_ROWS):
        rows.append({
            "data_source": "vstar" if index != 2 else "thinklite",
            "prompt": [{"role": "system", "content": DEEPEYES_SYSTEM},
                       {"role": "user", "content": f"<image>\n{question}{DEEPEYES_SUFFIX}"}],
            "images": [{"bytes": jpeg(picture(colour)), "path": f"img_{index}.jpg"}],
            "ability": "vl_chart" if index == 2 else "vqa", "env_name": "visual_toolbox_v2",
            "reward_model": {"ground_truth": truth, "style": "model"},
            "extra_info": {"answer": truth, "question": question, "index": str(index), "split": "train"},
        })
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    return path
