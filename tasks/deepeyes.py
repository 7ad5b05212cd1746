"""`deepeyes`: training on DeepEyes-47k (`ChenShawn/DeepEyes-Datasets-47k`), thinking with images.

The published parquet files (`data_0.1.2_visual_toolbox_v2.parquet`, V*-style; a charts file; a reasoning file)
hold `prompt` (the chat messages: a system message that lists DeepEyes' tool, `image_zoom_in_tool`, and a user
message whose text holds `<image>` where each image goes), `images` (a list of `{bytes, path}`),
`reward_model` (`{ground_truth, style}`), `extra_info` (`{answer, question, index, split}`), `data_source`,
`ability` and `env_name`. data.path takes a local copy (a file, or a folder of them named after the split); the
Hub default reads `train` from the Hub id.

The prompt already describes the tool, so `describe_tools` is False and the tool it names is registered here:
`image_zoom_in_tool`, DeepEyes' crop (`bbox_2d`, optional `label`), which is `zoom_in` under its DeepEyes name.

Accuracy, by the ground truth's form:
- a letter (`B`, `(B)`, `B.`): the option the `<answer>` names (its letter or its text, the options read from
  the question's "(A) ..." lines);
- a short answer (a word, a number, a few words not written as a sentence): the same text after normalizing
  (case, spaces, edge punctuation), or the same number;
- a sentence ("The bag is black."): only a judge can tell, so with the run's judge (`reward.judge.kind=endpoint`
  or `local`, gpg_vl/reward/judge.py; the task reads `self.judge`, which the setup sets) the judge decides;
  without one (the default) such a row is skipped and counted as `skipped_rows/sentence answer without a judge`,
  outside data.max_bad_fraction (it is not damaged data), never scored 0; the run says at its start how many
  training rows need a judge (`data_note`).
"""

from __future__ import annotations

import re

from gpg_vl.data.sources import RowView, load_rows
from gpg_vl.data.task import checked_text, register_task, row_name
from gpg_vl.errors import BadRow, SkippedRow, UserError
from gpg_vl.reward.primitives import choice_letter, normalize_text
from gpg_vl.reward.tooluse import MAX_ANSWER_CHARS, deepeyes_answer, lettered_options
from gpg_vl.rollout.multiturn.tools import ZOOM_PARAMETERS, register_tool, zoom_in

from .vstar import ToolTask

HUB_ID = "ChenShawn/DeepEyes-Datasets-47k"
COLUMNS = ("prompt", "images", "reward_model")
IMAGE = "<image>"
_LETTER = re.compile(r"\(?([A-Z])\)?\.?")
_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)")
OLD_JUDGE_OPTIONS = ("judge", "judge_model", "judge_timeout_s")  # now reward.judge.* (a run setting)
JUDGE_KEYS = ("reward.judge.kind=endpoint reward.judge.url=<OpenAI-compatible endpoint URL>, or "
              "reward.judge.kind=local reward.judge.model=<model folder>")


@register_tool("image_zoom_in_tool", description=(
    "Zoom in on a specific region of an image by cropping it based on a bounding box (bbox) and an optional "
    "object label."), parameters={**ZOOM_PARAMETERS, "properties": {
        key: value for key, value in ZOOM_PARAMETERS["properties"].items() if key in ("bbox_2d", "label")}})
def image_zoom_in_tool(context, bbox_2d, label: str | None = None):
    """DeepEyes' crop: `zoom_in` on the prompt's image (docs/thinking-with-images.md)."""
    return zoom_in(context, bbox_2d, label)


def answer_kind(answer: str) -> str:
    """`letter` (`B`, `(B)`, `B.`), `sentence` (more than 5 words, or at least 3 words ending in a full stop)
    or `short` (anything else: a word, a number, a few words)."""
    if _LETTER.fullmatch(answer.strip()):
        return "letter"
    words = answer.split()
    if len(words) > 5 or (len(words) >= 3 and answer.rstrip().endswith(".")):
        return "sentence"
    return "short"


def same_short_answer(answer: str, reference: str) -> float:
    """1.0 when the answer text equals `reference` after `normalize_text` (and is not empty), or both are the same
    number; else 0.0."""
    given, expected = normalize_text(answer), normalize_text(reference)
    if given and given == expected:
        return 1.0
    if not _NUMBER.fullmatch(given) or not _NUMBER.fullmatch(expected):
        return 0.0
    return 1.0 if abs(float(given) - float(expected)) <= 1e-9 else 0.0


@register_task
class DeepEyes(ToolTask):
    """DeepEyes-47k: DeepEyes' prompts and tool, its reward (or Mini-o3's, `rewards=accuracy`), rule-scored
    where the ground truth allows, judged (`reward.judge.*`) or skipped where it is a sentence."""

    name = "deepeyes"
    tools = ("image_zoom_in_tool",)
    describe_tools = False  # the data's system message lists the tool itself
    group_columns = ("data_source",)
    eval_split = "train"  # DeepEyes-47k has one split: evaluate on a held-out copy through data.path / eval.split
    uses_judge = True  # sentence ground truths

    def __init__(self, **options) -> None:
        old = [name for name in OLD_JUDGE_OPTIONS if name in options]
        if old:
            raise UserError(f"task.options.{old[0]} is gone: the judge is a run setting now; set {JUDGE_KEYS} "
                            "(docs/tasks.md#the-llm-judge).")
        super().__init__(**options)

    def load(self, split: str) -> RowView:
        rows = load_rows(HUB_ID, split, path=self.data_path, required_columns=COLUMNS)
        return RowView(rows, lambda index, row: self._row(row, index, split))

    def _row(self, row: dict, index: int, split: str) -> dict:
        extra = row.get("extra_info") or {}
        row["id"] = f"deepeyes-{split}-{extra.get('index', index)}"
        targets = self.prepare_targets(row)  # before the images: a skipped row is not decoded
        images = [self.open_image(image, row=index) for image in row.get("images") or []]
        return {**row, "images": images, **targets}

    def prepare_targets(self, row: dict) -> dict:
        """`answer` (`reward_model.ground_truth`, else `extra_info.answer`), its `answer_kind`, the `question`
        (the user text without its image marks), its lettered `choices` and the question the judge is shown
        (`judge_question`: `extra_info.question` as DeepEyes' judge reads it, else `question`). `BadRow` for a row
        without a ground truth, and "sentence answer without a judge" for a sentence when no judge is set."""
        truth = (row.get("reward_model") or {}).get("ground_truth")
        if truth is None:
            truth = (row.get("extra_info") or {}).get("answer")
        if truth is None:
            raise BadRow("missing column", f"{row_name(row)} has no reward_model.ground_truth; check the data.")
        answer = checked_text(str(truth), row, "answer", "reward_model.ground_truth")
        kind = answer_kind(answer)
        if kind == "sentence" and getattr(self, "judge", None) is None:
            raise SkippedRow("sentence answer without a judge",
                         f"{row_name(row)}'s ground truth is a sentence, which only a judge can compare; set "
                         f"{JUDGE_KEYS} to train on such rows.")
        question = self.user_text(row).replace(IMAGE, "").strip()
        asked = (row.get("extra_info") or {}).get("question")
        return {"answer": answer, "answer_kind": kind, "question": question, "choices": lettered_options(question)[1],
                "judge_question": asked.strip() if isinstance(asked, str) and asked.strip() else question}

    def data_note(self, rows) -> str | None:
        """How many of `rows` have a sentence ground truth (need a judge), read from the ground-truth columns
        only (no image is decoded); None when none has."""
        raw, positions = (rows.rows, rows.positions) if isinstance(rows, RowView) else (rows, range(len(rows)))
        columns = raw.column_names if hasattr(raw, "column_names") else []
        truths = raw["reward_model"] if "reward_model" in columns else [raw[i].get("reward_model") for i in positions]
        answers = raw["extra_info"] if "extra_info" in columns else [None] * len(truths)
        sentences = 0
        for i in positions:
            truth = (truths[i] or {}).get("ground_truth")
            truth = (answers[i] or {}).get("answer") if truth is None else truth
            sentences += truth is not None and answer_kind(str(truth)) == "sentence"
        if not sentences:
            return None
        if self.judge is None:
            return (f"{sentences} of {len(positions)} training rows have a sentence ground truth, which only a judge "
                    f"can score: they are skipped (not counted as bad rows); set {JUDGE_KEYS} to train on them.")
        return f"{sentences} of {len(positions)} training rows have a sentence ground truth: the judge scores them."

    @staticmethod
    def user_text(row: dict) -> str:
        """The text of the prompt's (last) user message."""
        texts = [m.get("content") for m in row.get("prompt") or [] if isinstance(m, dict) and m.get("role") == "user"]
        if not texts or not isinstance(texts[-1], str):
            raise BadRow("missing column", f"{row_name(row)} has no user message in its prompt; check the data.")
        return texts[-1]

    def check_row(self, row: dict) -> None:
        """A ground truth (see `prepare_targets`), and as many images as the user text has `<image>` marks."""
        super().check_row(row)
        marks, images = self.user_text(row).count(IMAGE), len(row.get("images") or [])
        if marks != images:
            raise BadRow("image count mismatch", f"{row_name(row)} has {images} image(s) for {marks} <image> "
                                                 "mark(s) in its prompt; fix or drop the row.")

    def messages(self, row: dict) -> list[dict]:
        """The published prompt, each `<image>` mark of the user text replaced by the next image."""
        images = iter(row["images"])
        messages = []
        for message in row["prompt"]:
            if message["role"] != "user":
                messages.append({"role": message["role"], "content": message["content"]})
                continue
            parts = []
            for k, piece in enumerate(message["content"].split(IMAGE)):
                if k:
                    parts.append({"type": "image", "image": next(images)})
                if piece.strip():
                    parts.append({"type": "text", "text": piece})
            messages.append({"role": "user", "content": parts})
        return messages

    @staticmethod
    def parsed_answer(completion: str) -> str | None:
        """The answer maj@k votes with: DeepEyes' answer text (`deepeyes_answer`), as the rewards read it."""
        return deepeyes_answer(completion) or None

    def judge_question(self, completion: str, row: dict) -> tuple[str, str, str] | None:
        """(the question the judge is shown, the sentence ground truth, the answer text) for a sentence row with an
        answer to judge; None for every other (see `accuracy`)."""
        answer = deepeyes_answer(completion)
        if row["answer_kind"] != "sentence" or not answer or len(answer) >= MAX_ANSWER_CHARS:
            return None
        return row["judge_question"], row["answer"], answer

    def accuracy(self, completion: str, row: dict) -> float:
        """By the ground truth's kind: the option named, the same short answer, or the judge's score (a verdict,
        or a rubric's score mapped to 0..1: reward.judge.mode; NaN when it gives none), on the answer text DeepEyes
        reads (`deepeyes_answer`: after the last `<answer>`, closed or not; the whole reply without one). An answer
        of `MAX_ANSWER_CHARS` or more scores 0, as in DeepEyes (a judge is never asked)."""
        answer = deepeyes_answer(completion)
        if not answer or len(answer) >= MAX_ANSWER_CHARS:
            return 0.0
        kind = row["answer_kind"]
        if kind == "letter":
            right = choice_letter(row["answer"], row["choices"])
            return 1.0 if right is not None and choice_letter(answer, row["choices"]) == right else 0.0
        if kind == "short":
            return same_short_answer(answer, row["answer"])
        return 0.0 if self.judge is None else self.judge(*self.judge_question(completion, row))
