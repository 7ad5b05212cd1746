"""Tasks are data + prompt + tools + rewards + metrics, and a registry to find them by name.

A task never touches the model, the optimizer or the trainer. The trainer asks it for rows, turns each
row into chat messages with `messages`, scores completions with `reward_components`, and summarises an
evaluation with `metrics`.

    from gpg_vl import Task, register_task

    @register_task
    class Capitals(Task):
        name = "capitals"
        ...

`get_task("capitals")`, or `task.name=capitals` on the command line, then finds it. Out-of-tree tasks
load from `module:ClassName` or `path/to/file.py:ClassName`; loading a file runs its code.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import re
import sys
import threading
import traceback
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from gpg_vl.config.names import TASK_BUILTINS
from gpg_vl.data.answers import as_box, extract_answer
from gpg_vl.errors import BadRow, UserError, raised
from gpg_vl.registry import Registry

RewardFn = Callable[[str, dict], float]

_NON_FINITE = re.compile(r"[+-]?(?:nan|inf|infinity)", re.IGNORECASE)  # how str() writes a NaN or infinite float
SCORING_MEMO_ROWS = 8  # rows whose scoring form `Task.scoring_row` keeps (a published ReasonSeg row holds its mask)
_COUNTING = threading.Lock()  # guards the reward error counts of every task


class NotAScore(TypeError):
    """A reward function returned something that is not a number (a string such as "1.0", None, a list)."""

    def __init__(self, value):
        super().__init__(f"{value!r} is not a number")
        self.value = value


def _as_score(value) -> float:
    """A reward's value as a float: numbers (bool, int, float, numpy and 0-d torch scalars) only; text such as
    "1.0" is refused, never parsed."""
    if isinstance(value, str | bytes) or value is None or not hasattr(value, "__float__"):
        raise NotAScore(value)
    try:
        return float(value)
    except (TypeError, ValueError):
        raise NotAScore(value) from None


class Task:
    """Base class of every task. Subclasses set `name` and implement `load` and `messages`.

    `reward_functions` maps a reward's name to `fn(completion, row) -> float`; `reward_weights` gives
    each one's weight in the total (1.0 when absent). The default metrics are the mean of each reward
    and `accuracy`, the fraction of completions whose `accuracy` reward is 1.
    """

    name: ClassVar[str] = ""
    train_split: ClassVar[str] = "train"
    eval_split: ClassVar[str] = "test"
    uses_boxes: ClassVar[bool] = False  # completions hold boxes: the model family maps them to original pixels
    # completions hold clicks (points, or boxes read as their centre): the family maps every point and box form of
    # gpg_vl/models/points.py to original pixels (GUI grounding: tasks/gui.py)
    uses_points: ClassVar[bool] = False
    group_columns: ClassVar[tuple[str, ...]] = ()  # row columns whose values evaluation breaks accuracy down by
    # the tools the model may call (registered names, gpg_vl/rollout/multiturn/tools.py), with rollout.max_turns > 1
    tools: ClassVar[tuple[str, ...]] = ()
    # whether the prompt lists those tools as the model's chat template does (False: the task's own prompt does)
    describe_tools: ClassVar[bool] = True
    # whether some rows need an LLM judge (`self.judge`, set from reward.judge.* by the setup: gpg_vl/reward/judge.py)
    uses_judge: ClassVar[bool] = False
    # what its prompts hold: "image", "video" (a model that cannot read video refuses the task before it loads)
    inputs: ClassVar[tuple[str, ...]] = ("image",)

    def __init__(self, **options: Any) -> None:
        if options:
            raise UserError(
                f"task {self.name!r} takes no option {sorted(options)}; remove it from task.options."
            )
        self.reward_functions: dict[str, RewardFn] = {}
        self.reward_weights: dict[str, float] = {}
        self.data_path: str | None = None  # data.path: a local copy that replaces the hub dataset
        self.image_root: str | None = None  # data.image_root: where relative image paths resolve
        self.allow_outside_paths = False  # data.allow_outside_paths: image paths may leave the image root
        self.max_video_frames: int | None = None  # data.max_video_frames: the most frames sampled from a video
        self.reward_errors: dict[str, int] = {}  # reward name -> completions on which it raised (scored 0)
        self.reward_nonfinite: dict[str, int] = {}  # reward name -> NaN or infinite scores
        self.judge = None  # reward.judge: the run's judge, `judge(question, reference, answer) -> score`, or None

    def load(self, split: str) -> Sequence[dict]:
        """The rows of `split`, each a dict of the dataset's columns."""
        raise NotImplementedError

    def messages(self, row: dict) -> list[dict]:
        """Chat messages for one row, in the chat message format (`{"type": "image", "image": PIL.Image}`)."""
        raise NotImplementedError

    def check_row(self, row: dict) -> None:
        """Raise `BadRow` when `row` cannot be trained on or scored; training then skips and counts it.

        Called on every row before `messages` (which raises `BadRow` itself for a broken image, through
        `load_image`). The default checks the row's targets (`prepare_targets`) and the target box of a task with
        `uses_boxes` (`box`, in original pixels; None means no target); tasks add their columns' checks, e.g. with
        `require_text`.
        """
        row = self.scoring_row(row)  # raises BadRow when the row has no usable target
        if self.uses_boxes and row.get("box") is not None:
            check_box(row["box"], row)

    def check_data(self) -> None:
        """Cheap checks of the data's files, run by `get_task` once data.path is set, so that broken data fails in
        one sentence before any model loads; the default checks nothing (rows are checked as they are drawn, by
        `check_row`). GUI grounding (tasks/gui.py) checks every row's box and image file here."""

    def data_note(self, rows: Sequence[dict]) -> str | None:
        """One line the trainer prints once, at the start, about the training rows (e.g. how many need a judge);
        None (the default) for nothing to say. Must be cheap: it runs before the first step."""
        return None

    def open_image(self, value, row=None):
        """`load_image` of a row's image value (a PIL image, bytes, a `datasets` image dict or a path): a path
        resolves against data.image_root, else the data file's folder, and must stay inside it unless
        data.allow_outside_paths=true. `row` names the row in messages."""
        from gpg_vl.data.sources import data_image_root, load_image  # here: `datasets` is slow to import

        return load_image(value, image_root=data_image_root(self.image_root, self.data_path), row=row,
                          allow_outside=getattr(self, "allow_outside_paths", False))

    def prepare_targets(self, row: dict) -> dict:
        """What the rewards read that the published columns do not hold as such (a label taken out of its
        `<answer>` tag, the box around a mask, ...), derived from `row`; `{}` (the default) when the rewards read
        the published columns themselves. Raises `BadRow` when the row has no usable target.

        The one place a task turns a row into its targets: loaders add the result to every row they prepare, and
        `scoring_row` adds it to a row given straight from the dataset, so both score alike. It must accept a row
        its loader prepared too (giving the same targets).
        """
        return {}

    def scoring_row(self, row: dict) -> dict:
        """`row` with its targets (`prepare_targets`), as the reward functions read it: the dataset's published
        row and the row the loader prepared give the same scores. Kept for the last few row objects (by
        identity), so scoring the G completions of one row prepares it once; treat scored rows as read-only."""
        memo = vars(self).setdefault("_scoring_memo", OrderedDict())
        found = memo.pop(id(row), None)  # pop and insert (no move_to_end): each step is atomic across threads
        if found is None or found[0] is not row:  # the row itself is held, so its id is not reused meanwhile
            targets = self.prepare_targets(row)
            found = (row, {**row, **targets} if targets else row)
        memo[id(row)] = found
        while len(memo) > SCORING_MEMO_ROWS:
            with contextlib.suppress(KeyError):
                memo.popitem(last=False)
        return found[1]

    def target(self, row: dict) -> str:
        """The reference answer of a row, as shown in predictions files."""
        return str(self.scoring_row(row).get("answer", ""))

    def judge_question(self, completion: str, row: dict) -> tuple[str, str, str] | None:
        """The (question, reference, answer) the rewards of `completion` will put to the run's judge (`self.judge`,
        gpg_vl/reward/judge.py), or None: none, or the task does not say (the default). Saying it lets the scoring
        ask a batch's questions together (gpg_vl/reward/pool.py). `row` is the scoring row (`scoring_row`)."""
        return None

    def reward_components(self, completion: str, row: dict, trajectory=None) -> dict[str, float]:
        """Each reward function's raw score for one completion of `row` (the dataset's published row, or the
        row the loader prepared: see `scoring_row`). A reward function is called `fn(completion, row)`; one that
        takes a `trajectory` keyword also gets the multi-turn `Trajectory` of the completion (its segments, tool
        calls and observations: gpg_vl/rollout/multiturn/trajectory.py), None for a single turn or a re-scored file.

        A reward function that raises gives this completion 0 for that reward: the error is counted in
        `reward_errors[name]` (the task's running record) and its first traceback is printed once; the trainer
        takes each completion's count from `scored_components`. A NaN or infinite score is kept (the trainer
        leaves the completion's group out of the update) and counted in `reward_nonfinite[name]`. A row without a
        usable target raises `BadRow` (see `prepare_targets`).
        """
        return self.scored_components(completion, row, trajectory)[0]

    def scored_components(self, completion: str, row: dict, trajectory=None) -> tuple[dict[str, float], int]:
        """(`reward_components`, how many of the task's reward functions raised on this completion)."""
        raised = 0
        with _COUNTING:  # completions are scored on several threads (gpg_vl/reward/pool.py): a row is prepared once
            errors = vars(self).setdefault("reward_errors", {})
            nonfinite = vars(self).setdefault("reward_nonfinite", {})
            row = self.scoring_row(row)
        scores = {}
        for name, fn in self.reward_functions.items():
            try:
                score = _as_score(fn(completion, row, trajectory=trajectory) if takes_trajectory(fn) else
                                  fn(completion, row))
            except Exception as error:  # a reward (often a user's own) that fails on odd output must not end the run
                raised += 1
                with _COUNTING:
                    errors[name] = errors.get(name, 0) + 1
                    first = errors[name] == 1
                if first:
                    why = (f"returned {error.value!r} (a {type(error.value).__name__}), not a number"
                           if isinstance(error, NotAScore) else "raised on a completion")
                    shown = "" if isinstance(error, NotAScore) else \
                        f"; this traceback is shown once:\n{traceback.format_exc().rstrip()}"
                    print(f"warning: reward {name!r} of task {self.name!r} {why}; it scores 0 (counted as "
                          f"reward_errors in metrics.jsonl; a reward returns a float){shown}", file=sys.stderr)
                score = 0.0
            if not math.isfinite(score):
                with _COUNTING:
                    nonfinite[name] = nonfinite.get(name, 0) + 1
            scores[name] = score
        return scores, raised

    def scored(self, rows: Sequence[dict], completions: Sequence[str],
               scores: Sequence[dict[str, float]] | None = None) -> list[dict[str, float]]:
        """`scores` when given (checked to pair with the completions), else each completion's reward_components."""
        if scores is None:
            return [self.reward_components(c, r) for c, r in zip(completions, rows, strict=True)]
        if len(scores) != len(completions):
            raise ValueError(f"{len(scores)} scores for {len(completions)} completions")
        return list(scores)

    def total(self, components: dict[str, float]) -> float:
        """The weighted sum of reward components."""
        return sum(self.reward_weights.get(name, 1.0) * score for name, score in components.items())

    def reward(self, completion: str, row: dict) -> float:
        """The weighted total reward of one completion."""
        return self.total(self.reward_components(completion, row))

    def metrics(self, rows: Sequence[dict], completions: Sequence[str],
                scores: Sequence[dict[str, float]] | None = None) -> dict[str, float]:
        """Evaluation metrics over paired rows and completions. `scores`: each completion's
        `reward_components`, when already computed (evaluation scores each completion once, on several
        threads: gpg_vl/train/eval/evaluate.py); an override passes them on and reads them, see `scored`."""
        count = max(len(completions), 1)
        sums: dict[str, float] = {}
        for components in self.scored(rows, completions, scores):
            for name, score in components.items():
                sums[name] = sums.get(name, 0.0) + score
        result = {f"reward/{name}": total / count for name, total in sums.items()}
        if "accuracy" in sums:
            result["accuracy"] = sums["accuracy"] / count
        result["answered"] = sum(extract_answer(c) is not None for c in completions) / count
        return result


def takes_trajectory(fn) -> bool:
    """Whether a reward function takes the `trajectory` keyword (named, or through **kwargs)."""
    try:
        return _takes_trajectory(fn)
    except TypeError:  # an unhashable callable: not cached
        return _takes_trajectory.__wrapped__(fn)


@functools.lru_cache(maxsize=1024)
def _takes_trajectory(fn) -> bool:
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == "trajectory" or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def row_name(row: dict) -> str:
    """How messages name a row: by its id when it has one."""
    return f"row {str(row['id'])!r}" if row.get("id") is not None else "a row"


def require_text(row: dict, **roles: str) -> None:
    """`BadRow` unless each column holds text: `require_text(row, question="problem", answer="solution")`; see
    `column_text` for the reasons."""
    for role, column in roles.items():
        column_text(row, column, role)


def column_text(row: dict, column: str, role: str = "answer") -> str:
    """The text of `row[column]`, stripped. `BadRow` "missing column" for an absent or null column, then as
    `checked_text`: a NaN or infinite value ("non-finite answer") or blank text ("empty answer")."""
    value = row.get(column)
    if value is None:
        raise BadRow("missing column", f"{row_name(row)} has no {column!r} ({role}); check the data's columns.")
    return checked_text(str(value), row, role, f"{column!r}")


def checked_text(text: str, row: dict, role: str, where: str) -> str:
    """`text` stripped; `BadRow` "non-finite <role>" when it reads as a NaN or infinite number ('nan', 'inf', a
    float NaN written out: a reward would match the answer 'nan' to it), "empty <role>" when it is blank."""
    text = text.strip()
    if not text:
        raise BadRow(f"empty {role}", f"{row_name(row)} has an empty {role} ({where}); fix or drop the row.")
    if _NON_FINITE.fullmatch(text):
        raise BadRow(f"non-finite {role}", f"{row_name(row)} has the {role} {text!r} ({where}), NaN or infinite: "
                                           "not a usable value; fix or drop the row.")
    return text


def check_box(box, row: dict) -> None:
    """`BadRow` ("bad box") unless `box` is four finite numbers (x1, y1, x2, y2) with x2 > x1 and y2 > y1."""
    if as_box(box) is None:
        raise BadRow("bad box", f"{row_name(row)} has the box {box!r}: not four finite numbers x1 < x2, y1 < y2.")


def image_question(image, text: str) -> list[dict]:
    """The chat messages of a single-image question: one user turn holding the image, then the text."""
    return [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": text}]}]


def prompt_text(messages: list[dict]) -> str:
    """The text of chat messages, each image written `<image>` (what predictions files and the rollout log show)."""
    parts = []
    for message in messages:
        content = message["content"]
        if isinstance(content, str):
            parts.append(content)
        else:
            parts += ["<image>" if part.get("type") == "image" else part.get("text", "") for part in content]
    return "".join(parts)


def _is_task(obj) -> bool:
    return isinstance(obj, type) and issubclass(obj, Task)


# The built-in tasks (gpg_vl_tasks, the tasks/ folder: gpg_vl/config/names.py), imported on first use.
TASKS = Registry("task", "task.name", builtins=TASK_BUILTINS, accepts=_is_task, expects="a Task subclass")


def register_task(task_class: type[Task]) -> type[Task]:
    """Register a Task subclass under its `name`; usable as a class decorator. Duplicates raise."""
    if not _is_task(task_class) or not task_class.name:
        raise UserError(f"register_task needs a Task subclass with a `name`; got {task_class!r}.")
    return TASKS.register(task_class)


def list_tasks() -> list[str]:
    """Names of every registered task, built-in ones included."""
    return TASKS.names()


def get_task(name: str, *, data_path: str | None = None, image_root: str | None = None,
             allow_outside_paths: bool = False, max_video_frames: int | None = None, **options: Any) -> Task:
    """Build the task called `name` (a registered name, `module:Name` or `file.py:Name`).

    `options` go to the task's constructor; `data_path` / `image_root` point it at a local copy of its data, and
    `allow_outside_paths` lets the data's image paths leave the image root (`Task.open_image`);
    `max_video_frames` bounds the frames sampled from each video of a prompt (data/video.py).
    """
    task_class = TASKS.get(name)
    if ":" in name and task_class.name and task_class.name not in TASKS:
        register_task(task_class)
    accepted = inspect.signature(task_class.__init__).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values()):
        unknown = sorted(set(options) - set(accepted))
        if unknown:
            valid = [p for p in accepted if p != "self"]
            raise UserError(f"task {task_class.name!r} has no option {', '.join(unknown)}; "
                            f"its options are: {', '.join(valid) or 'none'} (set them as task.options.<name>=...).")
    try:
        task = task_class(**options)
    except UserError:
        raise
    except Exception as error:  # the task's own code: named in one sentence, before anything else loads
        raise UserError(f"task {name} could not be built: {task_class.__name__}(...) raised {raised(error)}; fix its "
                        "__init__ or its options (task.options.*).") from error
    if data_path is not None:
        task.data_path = str(data_path)
    if image_root is not None:
        task.image_root = str(image_root)
    task.allow_outside_paths = bool(allow_outside_paths)
    task.max_video_frames = max_video_frames
    task.check_data()
    return task


def load_split(task: Task, split: str) -> Sequence[dict]:
    """`task.load(split)`; a failure of the task's own code (not a UserError, which says its own sentence) is told
    in one sentence naming the task, the split and the error."""
    try:
        return task.load(split)
    except UserError:
        raise
    except Exception as error:
        raise UserError(f"task {task.name} could not load its {split!r} split: {type(task).__name__}.load raised "
                        f"{raised(error)}; fix its load() or its data (data.path).") from error
