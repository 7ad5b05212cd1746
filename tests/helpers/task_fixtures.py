"""Rows in the published schemas of the paper's tasks (SAT / CV-Bench, GeoQA, ReasonSeg), written as fixtures by
the task tests (test_task_cvbench_geoqa.py, test_task_classification_lisa.py) and the paper-mix test."""

import datasets
import numpy as np
from PIL import Image

COLOURS = [(200, 40, 40), (40, 160, 60), (40, 70, 220), (230, 190, 30), (120, 40, 160), (30, 170, 170)]


def picture(index, size=(56, 56)):
    return Image.new("RGB", size, COLOURS[index % len(COLOURS)])


SAT_FEATURES = datasets.Features({
    "image_bytes": datasets.List(datasets.Image()), "question": datasets.Value("string"),
    "answers": datasets.List(datasets.Value("string")), "question_type": datasets.Value("string"),
    "correct_answer": datasets.Value("string"),
})
# (images, question, options, question type, right option's text); the two-image row is skipped.
SAT_ROWS = [
    (1, "Is the chair left or right of the table?", ["left", "right"], "obj_rel", "right"),
    (2, "Did the camera move forward or backward?", ["forward", "backward"], "ego_movement", "forward"),
    (1, "Which object is closer to the camera?", ["lamp", "sofa", "door"], "obj_depth", "sofa"),
    (1, "How many steps to the door?", ["2", "3"], "goal_aim", "3"),
]


def sat_parquet(path):
    columns = {name: [] for name in SAT_FEATURES}
    for i, (count, question, options, qtype, right) in enumerate(SAT_ROWS):
        columns["image_bytes"].append([picture(i + k) for k in range(count)])
        columns["question"].append(question)
        columns["answers"].append(options)
        columns["question_type"].append(qtype)
        columns["correct_answer"].append(right)
    datasets.Dataset.from_dict(columns, features=SAT_FEATURES).to_parquet(str(path))
    return path


GEO_TRAIN = [("In the figure, AB = 3 and BC = 4; find AC.", "<answer>5</answer>"),
             ("Find the angle ABC.", "<answer>140°</answer>"),
             ("Find the area.", "12")]  # a bare solution is its own answer


# ReasonSeg-like rows: a 64 x 48 image whose object is the rectangle of rows 8..19 and columns 10..29.
WIDTH, HEIGHT = 64, 48
BOX = (10.0, 8.0, 30.0, 20.0)  # by hand: columns 10..29 -> x 10 to 30 (exclusive), rows 8..19 -> y 8 to 20


def scene(box=BOX):
    image = Image.new("RGB", (WIDTH, HEIGHT), (250, 250, 250))
    if box is not None:
        image.paste((200, 40, 40), tuple(int(v) for v in box))
    return image


def array_mask(box=BOX):
    mask = np.zeros((HEIGHT, WIDTH), dtype=bool)
    if box is not None:
        x1, y1, x2, y2 = (int(v) for v in box)
        mask[y1:y2, x1:x2] = True
    return mask


def reasonseg(masks, boxes, features=None):
    count = len(masks)
    return datasets.Dataset.from_dict({
        "image": [scene(box) for box in boxes],
        "text": [f"the thing a cook would stir with, {i}" for i in range(count)],
        "mask": masks,
        "image_id": [f"img{i}" for i in range(count)],
        "ann_id": list(range(count)),
        "img_height": [HEIGHT] * count,
        "img_width": [WIDTH] * count,
    }, features=features)
