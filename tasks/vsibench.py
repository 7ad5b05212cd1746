"""`vsibench`: VSI-Bench (visual-spatial intelligence over indoor scan videos), an evaluation benchmark of Video-R1.

Rows have VSI-Bench's published columns (`nyu-visionx/VSI-Bench`, split `test`, parquet): `id`, `dataset`
("arkitscenes", "scannet", "scannetpp"), `scene_name`, `question_type`, `question`, `options` (["A. ...", ...] for
multiple-choice questions, null for numerical ones) and `ground_truth` (a letter, or a number). The video of a row
is `<dataset>/<scene_name>.mp4` under data.image_root (by default the data file's folder), as VSI-Bench's own
evaluation finds it; the videos come as zip archives on the Hub, so point data.image_root= at the unzipped folder.

Prompt: Video-R1's (think, answer in tags). Scores as VSI-Bench's: a multiple-choice question (MCA) scores 1 when the
answer's first word is the right letter; a numerical one (NA) scores its mean relative accuracy, the fraction of
the thresholds 0.50, 0.55, ..., 0.95 with |answer - truth| / truth <= 1 - threshold, the answer's first word read
by Python's `float` alone as VSI-Bench reads it ('1,000' is no number and scores 0). Metrics: `accuracy/<type>` per
question type, `accuracy/object_rel_direction` (the mean of its easy, medium and hard parts, as VSI-Bench reports it)
and `overall`, VSI-Bench's mean over the question types.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from gpg_vl.data.sources import RowView, load_rows
from gpg_vl.data.task import Task, column_text, register_task, require_text, row_name
from gpg_vl.errors import BadRow
from gpg_vl.reward.primitives import first_answer, format_reward

from .videor1 import MAX_PIXELS, NFRAMES, group_accuracy, media_file, number, question_text

HUB_ID = "nyu-visionx/VSI-Bench"
COLUMNS = ("dataset", "scene_name", "question_type", "question", "options", "ground_truth")
MCA_TYPES = ("object_rel_direction_easy", "object_rel_direction_medium", "object_rel_direction_hard",
             "object_rel_distance", "route_planning", "obj_appearance_order")
NA_TYPES = ("object_abs_distance", "object_counting", "object_size_estimation", "room_size_estimation")
DIRECTION_PARTS = ("object_rel_direction_easy", "object_rel_direction_medium", "object_rel_direction_hard")
# VSI-Bench's thresholds: numpy.linspace(0.5, 0.95, int((0.95 - 0.5) / 0.05 + 2)), which is 10 points
THRESHOLDS = np.linspace(0.5, 0.95, int((0.95 - 0.5) / 0.05 + 2))


def first_word(text: str) -> str:
    """VSI-Bench's reading of an answer: its first space-separated word, without a trailing '.'."""
    return text.split(" ")[0].rstrip(".").strip()


def mean_relative_accuracy(value: float, truth: float) -> float:
    """The fraction of `THRESHOLDS` t with |value - truth| / truth <= 1 - t (VSI-Bench's MRA); range [0, 1]."""
    relative = abs(value - truth) / abs(truth)
    return float(np.mean(relative <= 1 - THRESHOLDS))


def mca_reward(completion: str, truth: str) -> float:
    """1.0 if the answer's first word is the right letter (case-insensitive, as VSI-Bench), else 0.0."""
    answer = first_answer(completion)
    return 1.0 if answer is not None and first_word(answer).lower() == truth.strip().lower() else 0.0


def to_float(text: str) -> float | None:
    """VSI-Bench's reading of a number: Python's `float(text)`, None when it fails. Nothing is removed first, so
    '1,000' is no number (VSI-Bench scores it 0), while what `float` itself takes ('1_000', '1e3', ' 7 ') is one."""
    try:
        return float(text)
    except (ValueError, TypeError):
        return None


def na_reward(completion: str, truth: str) -> float:
    """The mean relative accuracy of the answer's first word read by `to_float`; 0.0 when it is no number (or
    not finite: VSI-Bench's comparison is then false at every threshold)."""
    answer = first_answer(completion)
    value, expected = (None, None) if answer is None else (to_float(first_word(answer)), to_float(truth))
    if value is None or not expected or not math.isfinite(value):
        return 0.0
    return mean_relative_accuracy(value, expected)


@register_task
class VSIBench(Task):
    """VSI-Bench: multiple-choice and numerical questions on indoor videos; VSI-Bench's scores + format."""

    name = "vsibench"
    inputs = ("image", "video")
    group_columns = ("question_type", "dataset")

    def __init__(self, nframes: int = NFRAMES, max_pixels: int = MAX_PIXELS) -> None:
        super().__init__()
        self.nframes, self.max_pixels = int(nframes), int(max_pixels)
        self.reward_functions = {
            "accuracy": lambda completion, row: (mca_reward if row["question_type"] in MCA_TYPES else na_reward)(
                completion, row["answer"]),
            "format": lambda completion, row: format_reward(completion),
        }
        self.reward_weights = {"accuracy": 1.0, "format": 1.0}

    def load(self, split: str) -> RowView:
        rows = load_rows(HUB_ID, split, path=self.data_path, required_columns=COLUMNS)
        return RowView(rows, lambda index, row: {**row, "id": str(row.get("id", index)), **self.prepare_targets(row)})

    def prepare_targets(self, row: dict) -> dict:
        """`answer`: the ground truth as text; `BadRow` for an unknown question type, a numerical truth that is no
        non-zero number, a multiple-choice row without options or whose answer is not one of their letters."""
        kind = row.get("question_type")
        if kind not in MCA_TYPES and kind not in NA_TYPES:
            raise BadRow("unknown question type", f"{row_name(row)} has the question_type {kind!r}, not one of "
                                                  "VSI-Bench's; check the data.")
        answer = column_text(row, "ground_truth")
        if kind in NA_TYPES and not number(answer):
            raise BadRow("bad answer", f"{row_name(row)} has the numerical ground truth {answer!r}, not a non-zero "
                                       "number; fix or drop the row.")
        if kind in MCA_TYPES and not row.get("options"):
            raise BadRow("no options", f"{row_name(row)} is multiple choice but has no options; check the data.")
        if kind in MCA_TYPES:
            letters = [first_word(str(option)).upper() for option in row["options"]]  # "A. left" -> "A"
            if first_word(answer).upper() not in letters:
                raise BadRow("bad label", f"{row_name(row)} has the answer {answer!r}, not the letter of one of its "
                                          f"{len(letters)} options ({', '.join(letters)}); fix or drop the row.")
        return {"answer": answer}

    def check_row(self, row: dict) -> None:
        require_text(row, question="question", dataset="dataset", scene="scene_name")
        super().check_row(row)

    def messages(self, row: dict) -> list[dict]:
        row = self.scoring_row(row)
        video = media_file(self, f"{row['dataset']}/{row['scene_name']}.mp4", row)
        kind = "multiple choice" if row["question_type"] in MCA_TYPES else "numerical"
        text = question_text(row["question"] + ("\n" if kind == "multiple choice" else ""), kind,
                             list(row.get("options") or []))
        part = {"type": "video", "video": video, "nframes": self.nframes, "max_pixels": self.max_pixels}
        return [{"role": "user", "content": [part, {"type": "text", "text": text}]}]

    @staticmethod
    def parsed_answer(completion: str) -> str | None:
        """The answer maj@k votes with: the first `<answer>`, as the rewards read it."""
        return first_answer(completion)

    def metrics(self, rows: Sequence[dict], completions: Sequence[str],
                scores: Sequence[dict] | None = None) -> dict[str, float]:
        """The default metrics, `accuracy/<value>` per question type and source dataset, the relative direction's
        three parts merged into `accuracy/object_rel_direction`, and `overall` (VSI-Bench's mean over types)."""
        rows = [self.scoring_row(row) for row in rows]
        scores = self.scored(rows, completions, scores)
        result = super().metrics(rows, completions, scores)
        per_type = group_accuracy(rows, scores, ("question_type",))
        parts = [per_type.pop(f"accuracy/{part}") for part in DIRECTION_PARTS if f"accuracy/{part}" in per_type]
        result.update(group_accuracy(rows, scores, ("question_type", "dataset")))
        if parts:
            per_type["accuracy/object_rel_direction"] = sum(parts) / len(parts)
            result["accuracy/object_rel_direction"] = per_type["accuracy/object_rel_direction"]
        if per_type:
            result["overall"] = sum(per_type.values()) / len(per_type)
        return result
