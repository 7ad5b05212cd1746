"""`cvbench`: spatial multiple-choice VQA, trained on SAT and evaluated on CV-Bench (the paper's first experiment).

Train rows come from `array/SAT` (the first `train_limit` single-image rows, as in the paper), test rows from
`nyu-visionx/CV-Bench`. Both become one image plus the question with lettered options ("(A) ..."); the accuracy
reward accepts the right letter or the right option's text, and naming two options is wrong. Metrics follow the
paper (accuracy per CV-Bench task and their plain mean, `total`) and CV-Bench's own `official` score.
"""

from __future__ import annotations

from collections.abc import Sequence

import pyarrow.compute as pc

from gpg_vl.data.sources import RowView, load_rows
from gpg_vl.data.task import Task, image_question, register_task, require_text, row_name
from gpg_vl.errors import BadRow
from gpg_vl.reward.primitives import choice_letter, choice_reward, format_reward

SAT_HUB_ID = "array/SAT"
SAT_COLUMNS = ("image_bytes", "question", "answers", "correct_answer")
CV_BENCH_HUB_ID = "nyu-visionx/CV-Bench"
CV_BENCH_COLUMNS = ("image", "prompt", "choices", "answer", "task", "type", "source")
CV_BENCH_TASKS = ("Count", "Relation", "Depth", "Distance")  # the paper's "Total" is their plain mean
GROUP_COLUMNS = ("task", "type", "source", "question_type")  # accuracy is reported per value of each
LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
INSTRUCTION = "Output the thinking process in <think> </think> and final answer in <answer> </answer> tags."


def sat_prompt(question: str, options: Sequence[str]) -> str:
    """A SAT question in CV-Bench's `prompt` style: 'Q? Select from the following choices.\\n(A) x\\n(B) y'."""
    lines = [f"({LETTERS[i]}) {option}" for i, option in enumerate(options)]
    return "\n".join([f"{question} Select from the following choices.", *lines])


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


@register_task
class CVBench(Task):
    """SAT -> CV-Bench spatial multiple choice; accuracy (letter or option text) + format rewards."""

    name = "cvbench"
    group_columns = GROUP_COLUMNS

    def __init__(self, train_limit: int | None = 15_000) -> None:
        super().__init__()
        self.train_limit = train_limit  # first N single-image SAT rows (None = all of them)
        self.reward_functions = {
            "accuracy": lambda completion, row: choice_reward(completion, row["choices"], row["answer"]),
            "format": lambda completion, row: format_reward(completion),
        }
        self.reward_weights = {"accuracy": 1.0, "format": 1.0}

    def load(self, split: str) -> RowView:
        if split == self.eval_split:
            rows = load_rows(CV_BENCH_HUB_ID, split, path=self.data_path, required_columns=CV_BENCH_COLUMNS)
            return RowView(rows, self._cv_bench_row)
        rows = load_rows(SAT_HUB_ID, split, path=self.data_path, required_columns=SAT_COLUMNS)
        # Counting list lengths in Arrow decodes no image; the kept indices stay in memory, not in the data folder.
        single = rows.with_format("arrow").filter(
            lambda table: pc.fill_null(pc.equal(pc.list_value_length(table["image_bytes"]), 1), False),
            batched=True, keep_in_memory=True,
        ).with_format(None)
        if self.train_limit is not None and self.train_limit < len(single):
            single = single.select(range(self.train_limit), keep_in_memory=True)
        return RowView(single, self._sat_row)

    def _cv_bench_row(self, index: int, row: dict) -> dict:
        image = self.open_image(row["image"], row=index)
        return {**row, "id": f"cvbench-{row.get('idx', index)}", "image": image}

    def _sat_row(self, index: int, row: dict) -> dict:
        image = self.open_image(row["image_bytes"][0], row=index)
        prompt = sat_prompt(row["question"], row["answers"] or [])
        return {**row, "id": f"sat-{index}", "image": image, "prompt": prompt, **self.prepare_targets(row)}

    def prepare_targets(self, row: dict) -> dict:
        """SAT rows (`answers`, `correct_answer`) as CV-Bench's columns: `choices` (the options) and `answer` (the
        right option's text); CV-Bench rows already hold `choices` and `answer` ("(A)")."""
        if "answers" in row and "correct_answer" in row:
            return {"choices": list(row["answers"] or []), "answer": row["correct_answer"]}
        return {}

    def check_row(self, row: dict) -> None:
        """A question (SAT's `question`, CV-Bench's `prompt`), options and an answer."""
        require_text(row, question="question" if str(row["id"]).startswith("sat-") else "prompt", answer="answer")
        if not row.get("choices"):
            raise BadRow("no options", f"{row_name(row)} has no answer options; check its choices/answers column.")

    def messages(self, row: dict) -> list[dict]:
        return image_question(row["image"], f"{row['prompt']}\n{INSTRUCTION}")

    def target(self, row: dict) -> str:
        row = self.scoring_row(row)
        letter = choice_letter(row["answer"], row["choices"])
        if letter is None:
            return str(row["answer"])
        return f"({letter}) {row['choices'][LETTERS.index(letter)]}"

    def metrics(self, rows: Sequence[dict], completions: Sequence[str],
                scores: Sequence[dict] | None = None) -> dict[str, float]:
        """The default metrics, accuracy per CV-Bench task, type and source (per question type on SAT rows),
        `total` (mean of the per-task accuracies) and `official` (((ADE20K + COCO) / 2 + Omni3D) / 2)."""
        # One pass over the rows (each access decodes an image), keeping only what scoring and grouping read.
        rows = [{key: scored.get(key) for key in ("choices", "answer", *GROUP_COLUMNS)}
                for scored in map(self.scoring_row, rows)]
        scores = self.scored(rows, completions, scores)
        result = super().metrics(rows, completions, scores)
        groups: dict[str, list[float]] = {}
        for row, components in zip(rows, scores, strict=True):
            score = components["accuracy"]
            for column in GROUP_COLUMNS:
                if row.get(column) is not None:
                    groups.setdefault(str(row[column]), []).append(score)
        accuracy = {group: mean(scores) for group, scores in groups.items()}
        result.update({f"accuracy/{group.lower()}": value for group, value in sorted(accuracy.items())})
        per_task = [accuracy[task] for task in CV_BENCH_TASKS if task in accuracy]
        if per_task:
            result["total"] = mean(per_task)
        parts = [mean(found) for found in ([accuracy[s] for s in ("ADE20K", "COCO") if s in accuracy],
                                           [accuracy[s] for s in ("Omni3D",) if s in accuracy]) if found]
        if parts:  # a source missing from the rows (a limited eval) drops out of its half
            result["official"] = mean(parts)
        return result
