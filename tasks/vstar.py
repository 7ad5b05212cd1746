"""`vstar`: V* Bench, multiple choice about small details of large images, answered with the `zoom_in` tool.

Published as `craigwu/vstar_bench`: `test_questions.jsonl`, one row per question, `{"image":
"direct_attributes/sa_X.jpg", "text": question + "\\n(A) ...\\n(B) ..." + "\\nAnswer with the option's letter from
the given choices directly.", "category": "direct_attributes" | "relative_position", "question_id", "label":
"A"}`, the images beside it (pass the jsonl, or the folder holding it, as data.path). lmms-eval's parquet copy
`lmms-lab-encoder/vstar-bench` (the Hub default) holds the same columns with the image inside. In both the right
option is always listed first, so the options are shuffled (`shuffle_options`, seeded by `seed` and the question
id, the label remapped); evaluations that never shuffle (early DeepEyes runs) reward always answering A.

The accuracy reward reads the option the `<answer>` names: its letter (`X`, `(X)`, `X.`) or its text. The other
rewards are a named set (`rewards`): DeepEyes' accuracy + format + tool bonus, weighted by the task's options, or
Mini-o3's accuracy alone. Metrics: accuracy overall and per category.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Sequence
from pathlib import Path

from gpg_vl.data.sources import RowView, load_rows
from gpg_vl.data.task import Task, column_text, image_question, register_task, row_name
from gpg_vl.errors import BadRow, UserError
from gpg_vl.reward.primitives import choice_letter, choice_reward
from gpg_vl.reward.tooluse import LETTERS, TOOL_REWARDS, lettered_options, options_text, shuffled

HUB_ID = "lmms-lab-encoder/vstar-bench"  # lmms-eval's parquet copy; craigwu/vstar_bench's jsonl via data.path
QUESTIONS_FILE = "test_questions.jsonl"
COLUMNS = ("image", "text", "label", "category")
CATEGORIES = ("direct_attributes", "relative_position")
LETTER_ONLY = "Answer with the option's letter from the given choices directly."  # V*'s last line, replaced
INSTRUCTION = ("Think in <think> </think>. If a detail is too small to see, call the zoom_in tool on its region "
               "first. Give the option's letter in <answer> </answer>.")


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def read_jsonl(path: Path) -> list[dict]:
    """The rows of a jsonl file, read line by line (V*'s `question_id` is an int on some rows and a str on
    others, which an Arrow table cannot hold in one column)."""
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as error:
                raise UserError(f"line {number} of {str(path)!r} is not JSON ({error}); fix or remove it.") from None
    if not rows:
        raise UserError(f"{str(path)!r} holds no rows; point data.path= at V*'s {QUESTIONS_FILE}.")
    return rows


class ToolTask(Task):
    """A task answered with tools at hand: its rewards are a named set (gpg_vl/reward/tooluse.py: `deepeyes`,
    accuracy + format + tool bonus, or `accuracy`, Mini-o3's) built on the task's `accuracy(completion, row)`,
    weighted by the options (DeepEyes' 0.8 / 0.2 / 1.2 by default)."""

    tools = ("zoom_in",)

    def __init__(self, rewards: str = "deepeyes", accuracy_weight: float = 0.8, format_weight: float = 0.2,
                 tool_weight: float = 1.2, **unknown) -> None:
        if unknown:  # a subclass passes its reward options on as **keywords: get_task cannot check them
            names = [*inspect.signature(type(self).__init__).parameters,
                     *inspect.signature(ToolTask.__init__).parameters]
            valid = [name for name in dict.fromkeys(names) if name not in ("self", "options", "unknown")]
            raise UserError(f"task {self.name!r} has no option {', '.join(sorted(unknown))}; its options are: "
                            f"{', '.join(valid)} (set them as task.options.<name>=...).")
        super().__init__()
        weights = {"accuracy": accuracy_weight, "format": format_weight, "tool": tool_weight}
        self.reward_functions, self.reward_weights = TOOL_REWARDS.get(rewards)(self.accuracy, weights)

    def accuracy(self, completion: str, row: dict) -> float:
        raise NotImplementedError

    def metrics(self, rows: Sequence[dict], completions: Sequence[str],
                scores: Sequence[dict] | None = None) -> dict[str, float]:
        """The default metrics and the accuracy per value of each `group_columns` column (`accuracy/<value>`)."""
        rows = list(map(self.scoring_row, rows))
        scores = self.scored(rows, completions, scores)
        result = super().metrics(rows, completions, scores)
        groups: dict[str, list[float]] = {}
        for row, components in zip(rows, scores, strict=True):
            for column in self.group_columns:
                if row.get(column) is not None:
                    groups.setdefault(str(row[column]), []).append(components["accuracy"])
        result.update({f"accuracy/{name}": mean(values) for name, values in sorted(groups.items())})
        return result


class ToolChoice(ToolTask):
    """A multiple-choice question about a large image, answered with the `zoom_in` tool at hand. Rows hold
    `image`, `question`, `choices` (the options' texts) and `answer` (the right letter)."""

    group_columns = ("category",)

    def accuracy(self, completion: str, row: dict) -> float:
        """1.0 when the `<answer>` names the right option, and only it (its letter or its text), else 0.0."""
        return choice_reward(completion, row["choices"], row["answer"])

    def messages(self, row: dict) -> list[dict]:
        row = self.scoring_row(row)
        return image_question(row["image"], f"{row['question']}\n{options_text(row['choices'])}\n{INSTRUCTION}")

    def target(self, row: dict) -> str:
        row = self.scoring_row(row)
        return f"({row['answer']}) {row['choices'][LETTERS.index(row['answer'])]}"

    def check_row(self, row: dict) -> None:
        row = self.scoring_row(row)  # BadRow when the options or the label cannot be read
        if choice_letter(row["answer"], row["choices"]) != row["answer"]:
            raise BadRow("bad label", f"{row_name(row)} has the label {row['answer']!r}, not the letter of one of "
                                      f"its {len(row['choices'])} options; fix or drop the row.")


@register_task
class VStar(ToolChoice):
    """V* Bench (191 questions): direct attributes (4 options) and relative positions (2 options)."""

    name = "vstar"
    train_split = "test"  # V* has one split
    eval_split = "test"

    def __init__(self, shuffle_options: bool = True, seed: int = 0, **options) -> None:
        super().__init__(**options)
        self.shuffle_options, self.seed = bool(shuffle_options), int(seed)

    def load(self, split: str) -> RowView:
        path = None if self.data_path is None else Path(self.data_path).expanduser()
        if path is not None and path.is_dir() and (path / QUESTIONS_FILE).is_file():
            path = path / QUESTIONS_FILE
        if path is not None and path.suffix == ".jsonl" and path.is_file():
            rows = read_jsonl(path)
        else:
            rows = load_rows(HUB_ID, split, path=path, required_columns=COLUMNS)
        return RowView(rows, self._row)

    def _row(self, index: int, row: dict) -> dict:
        row["id"] = f"vstar-{row.get('question_id', index)}"
        targets = self.prepare_targets(row)  # before the image: a row without options is not decoded
        return {**row, "image": self.open_image(row["image"], row=index), **targets}

    def prepare_targets(self, row: dict) -> dict:
        """`question` and `choices` read from `text` (V*'s last line dropped), `answer` the label's letter; with
        `shuffle_options`, the options in the order drawn from the seed and the question id, the label following
        its option. `BadRow` for a row without options or label."""
        text = column_text(row, "text", "question")
        label = column_text(row, "label")
        question, options = lettered_options(text.replace(LETTER_ONLY, "").rstrip())
        if not options:
            raise BadRow("no options", f"{row_name(row)} lists no options '(A) ...' in its text; fix or drop it.")
        answer = choice_letter(label, options)
        if answer is None:
            return {"question": question, "choices": options, "answer": label}  # check_row says why
        if self.shuffle_options:
            options, answer = shuffled(options, answer, f"{self.seed}:{row.get('question_id', row.get('id'))}")
        return {"question": question, "choices": options, "answer": answer}
