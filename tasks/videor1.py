"""`videor1`: Video-R1's RL data (Video-R1-260k), images and videos mixed in one run, with Video-R1's rewards.

Rows have Video-R1-260k's published columns: `problem_id`, `problem`, `data_type` ("image" or "video"),
`problem_type` ("multiple choice", "numerical", "OCR", "free-form", "regression"), `options` (["A. ...", ...],
empty unless multiple choice), `solution` ("<answer>X</answer>"), `path` ("./<source>/<file>", relative to the data
root) and `data_source`. The Hub copy (`Video-R1/Video-R1-data`) ships the json and its media as zip archives, so the
task reads a local copy: data.path=/path/Video-R1-260k.json, its `path`s resolving against data.image_root (by
default the json's folder, as Video-R1's own scripts resolve them).

Prompt: Video-R1's (think in <think>, answer in <answer>, plus a sentence per problem type). A video row becomes
`{"type": "video", "video": <file>, "nframes": 16, "max_pixels": 128 * 28 * 28}` (Video-R1's training setting,
task.options.nframes / max_pixels), an image row an image.

Accuracy, per problem type, as Video-R1's code scores it (`ACCURACY`): multiple choice, the option letter; numerical,
equal after rounding to 2 decimals (and Video-R1's rule that both or neither are written with a decimal mark);
OCR, 1 - word error rate over `str.split()` words (any whitespace separates), clipped to [0, 1]; free-form, the
mean of ROUGE-1, ROUGE-2 and ROUGE-L F1 (rouge_score, Porter stemming), clipped; regression, 1 - relative error,
clipped. Each reads the FIRST `<answer>...</answer>` (`first_answer`), as Video-R1's `extract_answer` does. Plus
the format reward, matched on the completion as it is (no stripping: a leading newline fails, as in Video-R1).

T-GRPO (task.options.temporal=true, off by default): `VideoR1.shuffled_messages` and `temporal_bonus` (see their
docs) are what the task contributes; the trainer rolls out the shuffled copies and adds the bonus as the reward
component "temporal" (gpg_vl/train/step/sample.py, `temporal_component`).
"""

from __future__ import annotations

import os
import random
import re
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from gpg_vl.data.sources import RowView, data_image_root, load_rows
from gpg_vl.data.task import Task, checked_text, column_text, register_task, require_text, row_name
from gpg_vl.errors import BadRow, UserError
from gpg_vl.reward.primitives import choice_letter, first_answer, format_reward

HUB_ID = "Video-R1/Video-R1-data"
DATA_FILE = "Video-R1-260k.json"
COLUMNS = ("problem_id", "problem", "data_type", "problem_type", "options", "solution", "path")
GROUP_COLUMNS = ("problem_type", "data_type", "data_source")  # accuracy is reported per value of each
NFRAMES = 16  # Video-R1's training setting: 16 frames of 128 * 28 * 28 pixels
MAX_PIXELS = 128 * 28 * 28

QUESTION_TEMPLATE = (
    "{question}\n"
    "Please think about this question as if you were a human pondering deeply. "
    "Engage in an internal dialogue using expressions such as 'let me think', 'wait', 'Hmm', 'oh, I see', "
    "'let's break it down', etc, or other natural language thought expressions "
    "It's encouraged to include self-reflection or verification in the reasoning process. "
    "Provide your detailed reasoning between the <think> and </think> tags, and then give your final answer between "
    "the <answer> and </answer> tags."
)
TYPE_TEMPLATE = {
    "multiple choice": " Please provide only the single option letter (e.g., A, B, C, D, etc.) within the <answer> "
                       "</answer> tags.",
    "numerical": " Please provide the numerical value (e.g., 42 or 3.14) within the <answer> </answer> tags.",
    "OCR": " Please transcribe text from the image/video clearly and provide your text answer within the <answer> "
           "</answer> tags.",
    "free-form": " Please provide your text answer within the <answer> </answer> tags.",
    "regression": " Please provide the numerical value (e.g., 42 or 3.14) within the <answer> </answer> tags.",
}

TEMPORAL_BONUS = 0.3  # T-GRPO: added to the accuracy of the ordered completions that are right (accuracy > 0.1)
TEMPORAL_RATIO = 0.8  # ... when the ordered group's mean accuracy is at least this times the shuffled group's
TEMPORAL_RIGHT = 0.1


def question_text(problem: str, problem_type: str, options: Sequence[str]) -> str:
    """Video-R1's prompt: the problem (with "Options:" and one option a line for multiple choice) in
    `QUESTION_TEMPLATE`, then the problem type's sentence."""
    if problem_type == "multiple choice":
        problem = problem + "Options:\n" + "".join(f"{option}\n" for option in options)
    return QUESTION_TEMPLATE.format(question=problem) + TYPE_TEMPLATE[problem_type]


# ---------------------------------------------------------------- accuracy per problem type

_LEADING_LETTER = re.compile(r"[(\[]?\s*([A-Za-z])(?![A-Za-z])")


def multiple_choice_reward(completion: str, answer: str, options: Sequence[str]) -> float:
    """1.0 if the answer names the right option BY ITS LETTER ('B', '(B)', 'B.', 'B. <option B's text>'), else 0.0.

    Video-R1 compares the answer's text with the letter; the option's text alone does not count either here.
    """
    predicted = first_answer(completion)
    right = choice_letter(answer, options)
    if predicted is None or right is None:
        return 0.0
    lead = _LEADING_LETTER.match(predicted.strip())
    named = choice_letter(predicted, options)
    return 1.0 if lead is not None and lead.group(1).upper() == named == right else 0.0


def number(text: str) -> float | None:
    """Video-R1's reading of a number: commas dropped, then `float`; None when that fails or is not finite."""
    try:
        value = float(text.replace(",", ""))
    except (ValueError, OverflowError):
        return None
    return value if value == value and abs(value) != float("inf") else None


def _has_decimal_mark(text: str) -> bool:
    return "." in text or "," in text


def numerical_reward(completion: str, answer: str) -> float:
    """1.0 if the answer equals `answer` after rounding both to 2 decimals, else 0.0.

    As in Video-R1's code, an answer written with a decimal mark ('.' or ',') never matches one written without:
    '3.0' does not match '3'.
    """
    predicted = first_answer(completion)
    if predicted is None or _has_decimal_mark(predicted) != _has_decimal_mark(answer):
        return 0.0
    value, truth = number(predicted), number(answer)
    if value is None or truth is None:
        return 0.0
    return 1.0 if round(value, 2) == round(truth, 2) else 0.0


def ocr_reward(completion: str, answer: str) -> float:
    """1 - the word error rate of the answer against `answer`, clipped to [0, 1]; 0.0 without an answer.

    Words are `str.split()`'s, as in Video-R1's `wer`: any run of whitespace (spaces, newlines, tabs) separates
    them, so 'Hello\\nWorld' against 'Hello World' scores 1. Case is kept. The edit distance is jiwer's, on the
    words re-joined by single spaces (jiwer itself splits on spaces only)."""
    import jiwer  # here: only this reward needs it

    predicted = first_answer(completion)
    truth = answer.split()
    if predicted is None or not truth:
        return 0.0
    words = predicted.split()
    if not words:  # jiwer refuses an empty hypothesis; every reference word is then deleted: WER 1
        return 0.0
    return min(1.0, max(0.0, 1.0 - jiwer.wer(" ".join(truth), " ".join(words))))


_ROUGE: list = []  # the scorer, built once (it holds a stemmer)


def free_form_reward(completion: str, answer: str) -> float:
    """The mean of the ROUGE-1, ROUGE-2 and ROUGE-L F1 of the answer against `answer` (rouge_score, Porter stemming;
    its tokenizer keeps lower-cased ASCII letters and digits), clipped to [0, 1]; 0.0 without an answer."""
    predicted = first_answer(completion)
    if predicted is None:
        return 0.0
    if not _ROUGE:
        from rouge_score import rouge_scorer  # here: only this reward needs it

        _ROUGE.append(rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=True))
    scores = _ROUGE[0].score(answer, predicted)
    mean = (scores["rouge1"].fmeasure + scores["rouge2"].fmeasure + scores["rougeL"].fmeasure) / 3
    return min(1.0, max(0.0, mean))


def regression_reward(completion: str, answer: str) -> float:
    """1 - the relative error |answer - truth| / |truth|, clipped to [0, 1]; 0.0 when either is not a number.

    Video-R1 computes (|answer - truth| + 1e-9) / (|truth| + 1e-9), which scores an exact answer 1 - 1e-10 and an
    exact 0 for a truth of 0 as 0; here an exact answer scores 1, and a truth of 0 scores 1 for 0 and 0 otherwise.
    """
    predicted = first_answer(completion)
    value, truth = (None, None) if predicted is None else (number(predicted), number(answer))
    if value is None or truth is None:
        return 0.0
    if truth == 0:
        return 1.0 if value == 0 else 0.0
    return 1.0 - min(1.0, abs(value - truth) / abs(truth))


# problem type -> accuracy(completion, row): the dispatch by the row's `problem_type`
ACCURACY: dict[str, Callable[[str, dict], float]] = {
    "multiple choice": lambda completion, row: multiple_choice_reward(completion, row["answer"], row["options"]),
    "numerical": lambda completion, row: numerical_reward(completion, row["answer"]),
    "OCR": lambda completion, row: ocr_reward(completion, row["answer"]),
    "free-form": lambda completion, row: free_form_reward(completion, row["answer"]),
    "regression": lambda completion, row: regression_reward(completion, row["answer"]),
}


# ---------------------------------------------------------------- T-GRPO

def temporal_bonus(ordered: torch.Tensor, shuffled: torch.Tensor, *, bonus: float = TEMPORAL_BONUS,
                   ratio: float = TEMPORAL_RATIO, right: float = TEMPORAL_RIGHT) -> torch.Tensor:
    """T-GRPO's bonus for the ordered completions of one video prompt, as Video-R1's trainer computes it.

    ordered: [G] the accuracy rewards of the completions of the prompt with its frames in order;
    shuffled: [G'] those of the completions of the same prompt with its frames shuffled (Video-R1: G' = G / 2).
    Returns [G]: `bonus` for each ordered completion with accuracy > `right`, when the ordered mean is at least
    `ratio` times the shuffled mean; zeros otherwise. The trainer adds it to the ordered accuracy rewards; the
    shuffled completions are scored only, never trained on. An empty shuffled group gives no bonus.
    """
    if shuffled.numel() == 0 or ordered.numel() == 0:
        return torch.zeros_like(ordered)
    earned = ordered.mean() >= ratio * shuffled.mean()  # [] bool
    return torch.where((ordered > right) & earned, torch.full_like(ordered, bonus), torch.zeros_like(ordered))


def shuffle_frames(frames: Sequence, seed: int) -> list:
    """The frames in an order drawn from `seed`, never the identity when there are two or more distinct positions
    (a shuffle that changes nothing would make the shuffled rollouts ordered ones)."""
    order = list(range(len(frames)))
    if len(order) > 1:
        rng = random.Random(seed)
        while order == sorted(order):
            rng.shuffle(order)
    return [frames[i] for i in order]


def shuffled_messages(messages: list[dict], seed: int) -> list[dict]:
    """`messages` with the frames of each video part shuffled by `shuffle_frames`: T-GRPO's shuffled prompt.

    Each video must be a list of frames: the prompt as the data stream decoded it (each video read and sampled
    once), so the shuffle permutes exactly the frames the model sees; the part's other keys (its metadata, hence
    the frames' timestamps) are kept. A video still given as a file raises ValueError.
    """
    shuffled = []
    for message in messages:
        content = message["content"]
        if not isinstance(content, str):
            content = [_shuffled_part(part, seed) if part.get("type") == "video" else part for part in content]
        shuffled.append({**message, "content": content})
    return shuffled


def _shuffled_part(part: dict, seed: int) -> dict:
    if not isinstance(part["video"], list | tuple):
        raise ValueError(f"shuffled_messages needs decoded videos (lists of frames); got {part['video']!r}")
    return {**part, "video": shuffle_frames(list(part["video"]), seed)}


# ---------------------------------------------------------------- data

def media_file(task: Task, value, row: dict, kind: str = "video") -> str:
    """The file a row's media `path` names, resolved against data.image_root (else the data file's folder); it
    must stay inside that root unless data.allow_outside_paths=true. `BadRow` when it leaves it or is missing."""
    root = data_image_root(task.image_root, task.data_path)
    file = Path(str(value)).expanduser()
    if not file.is_absolute() and root is not None:
        file = Path(root).expanduser() / file
    if root is not None and not task.allow_outside_paths and \
            not Path(os.path.abspath(file)).is_relative_to(os.path.abspath(Path(root).expanduser())):
        raise BadRow(f"{kind} path outside the data root",
                     f"{row_name(row)} names the {kind} {str(value)!r}, outside the data root {root!r}; fix the path "
                     "or data.image_root=, or set data.allow_outside_paths=true if you trust the data's paths.")
    if not file.is_file():
        raise BadRow(f"missing {kind} file", f"{row_name(row)} names the {kind} file {str(file)!r}, which does not "
                                             f"exist; check data.image_root= (now {task.image_root!r}).")
    return str(file)


def slug(value) -> str:
    """A metric name part: 'multiple choice' -> 'multiple_choice', 'free-form' -> 'free_form', 'OCR' -> 'ocr'."""
    return re.sub(r"[^0-9a-z]+", "_", str(value).lower()).strip("_")


def group_accuracy(rows: Sequence[dict], scores: Sequence[dict[str, float]], columns: Sequence[str]) -> dict:
    """`accuracy/<value>`: the mean accuracy reward of the rows holding each value of each of `columns`."""
    groups: dict[str, list[float]] = {}
    for row, components in zip(rows, scores, strict=True):
        for column in columns:
            if row.get(column) is not None:
                groups.setdefault(f"accuracy/{slug(row[column])}", []).append(components["accuracy"])
    return {name: sum(values) / len(values) for name, values in sorted(groups.items())}


@register_task
class VideoR1(Task):
    """Video-R1-260k: images and videos, five problem types; accuracy per type (Video-R1's rules) + format.

    Options: `nframes` and `max_pixels` (frames sampled per video and pixels per frame, Video-R1's 16 and
    128 * 28 * 28), `temporal` (T-GRPO's shuffled-frame bonus, off by default: see `temporal_bonus`).
    """

    name = "videor1"
    inputs = ("image", "video")
    group_columns = GROUP_COLUMNS

    def __init__(self, nframes: int = NFRAMES, max_pixels: int = MAX_PIXELS, temporal: bool = False) -> None:
        super().__init__()
        if int(nframes) < 2 or int(nframes) % 2:
            raise UserError(f"task videor1 takes an even nframes of 2 or more (frames pair up); got {nframes}, set "
                            "task.options.nframes=16.")
        self.nframes, self.max_pixels, self.temporal = int(nframes), int(max_pixels), bool(temporal)
        self.reward_functions = {
            "accuracy": lambda completion, row: ACCURACY[row["problem_type"]](completion, row),
            "format": lambda completion, row: format_reward(completion, strip=False),
        }
        self.reward_weights = {"accuracy": 1.0, "format": 1.0}

    def load(self, split: str) -> RowView:
        if self.data_path is None:
            raise UserError(f"Video-R1's data ({HUB_ID!r}) ships its images and videos as zip archives; download and "
                            f"unzip it, then pass data.path=/path/to/{DATA_FILE} (media paths resolve next to it, or "
                            "under data.image_root=).")
        rows = load_rows(HUB_ID, split, path=self.data_path, required_columns=COLUMNS)
        return RowView(rows, lambda index, row: {**row, "id": str(row["problem_id"]), **self.prepare_targets(row)})

    def prepare_targets(self, row: dict) -> dict:
        """`answer`: the content of the `solution` tag (the whole solution without one); `options` as a list. A
        missing or blank answer, an unknown problem type or a multiple-choice row whose answer names no option
        letter raises `BadRow`."""
        kind = row.get("problem_type")
        if kind not in ACCURACY:
            raise BadRow("unknown problem type", f"{row_name(row)} has the problem_type {kind!r}; use one of "
                                                 f"{', '.join(ACCURACY)}.")
        solution = column_text(row, "solution")
        answer = first_answer(solution)
        answer = solution if answer is None else checked_text(answer, row, "answer", "'solution' tag")
        options = [str(option) for option in (row.get("options") or [])]
        if kind == "multiple choice" and choice_letter(answer, options) is None:
            raise BadRow("no options", f"{row_name(row)} is multiple choice but its answer {answer!r} names none of "
                                       f"its options {options}; check the options column.")
        return {"answer": answer, "options": options}

    def check_row(self, row: dict) -> None:
        """A problem, a known data type, a media path, and the targets (`prepare_targets`)."""
        require_text(row, question="problem", media="path")
        if row.get("data_type") not in ("image", "video"):
            raise BadRow("unknown data type", f"{row_name(row)} has the data_type {row.get('data_type')!r}; use "
                                              "image or video.")
        super().check_row(row)

    def messages(self, row: dict) -> list[dict]:
        row = self.scoring_row(row)
        if row["data_type"] == "video":
            media = {"type": "video", "video": media_file(self, row["path"], row), "nframes": self.nframes,
                     "max_pixels": self.max_pixels}
        else:
            media = {"type": "image", "image": self.open_image(media_file(self, row["path"], row, "image"), row=row)}
        text = question_text(row["problem"], row["problem_type"], row["options"])
        return [{"role": "user", "content": [media, {"type": "text", "text": text}]}]

    @staticmethod
    def parsed_answer(completion: str) -> str | None:
        """The answer maj@k votes with: the first `<answer>`, as the rewards read it."""
        return first_answer(completion)

    def shuffled_messages(self, messages: list[dict], seed: int) -> list[dict] | None:
        """T-GRPO's prompt: a video prompt's decoded `messages` with its frames shuffled (`shuffled_messages`);
        None with temporal off or for a prompt without video (an image row: no shuffled rollout is due)."""
        videos = [part for message in messages if not isinstance(message["content"], str)
                  for part in message["content"] if part.get("type") == "video"]
        return shuffled_messages(messages, seed) if self.temporal and videos else None

    def temporal_bonus(self, ordered: torch.Tensor, shuffled: torch.Tensor) -> torch.Tensor:
        """`temporal_bonus` (module function): [G] bonuses for the ordered completions' accuracy."""
        return temporal_bonus(ordered, shuffled)

    def metrics(self, rows: Sequence[dict], completions: Sequence[str],
                scores: Sequence[dict] | None = None) -> dict[str, float]:
        """The default metrics and `accuracy/<value>` per problem type, data type and data source."""
        rows = [self.scoring_row(row) for row in rows]
        scores = self.scored(rows, completions, scores)
        result = super().metrics(rows, completions, scores)
        result.update(group_accuracy(rows, scores, GROUP_COLUMNS))
        return result
