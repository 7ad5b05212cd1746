"""The prompt stream: an epoch-wise shuffled walk over a split's rows, with a resumable position.

Rows that cannot be used (a missing or broken image, an empty question, an invalid box, ...) are skipped:
`prepare_prompt` turns a row into chat messages or raises `BadRow` with the reason, the stream counts
each reason (`BadRowLog`) and draws the next rows instead, so a step always gets B good prompts. When more
than `max_bad_fraction` of the rows seen are bad, the run stops with one sentence naming the first bad rows.
`scan_rows` applies the same checks to a whole split (scripts/validate_data.py, held-out rows).
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from PIL import Image

from gpg_vl.errors import BadRow, SkippedRow, UserError

MAX_ASPECT_RATIO = 200.0  # the most elongated image any processor is given (a family may allow fewer)
MIN_ROWS_JUDGED = 100  # the bad fraction is taken over at least this many rows (or the whole split if smaller)
FIRST_KEPT = 5  # bad rows remembered by position, to name them when the run stops


@dataclass
class Prompt:
    """A good row of the split, ready for the policy."""

    index: int  # position in the split
    row: dict
    messages: list[dict]
    task: str | None = None  # its task in a mixture (gpg_vl/data/mixture.py)


def prepare_prompt(task, rows: Sequence, index: int, max_aspect_ratio: float = MAX_ASPECT_RATIO) -> Prompt:
    """Row `index` of `rows` as chat messages; raises `BadRow` (with its reason) when the row cannot be used.

    Reading the row, the task's `check_row` and `messages` may each find a problem; images in the messages
    must have pixels and an aspect ratio within `max_aspect_ratio` (the model family's processor limit);
    videos are read and sampled here, once per prompt (data/video.py), and one that cannot be read is bad.
    Any other exception from the task's code is a bad row too (reason "error"; `KeyError` is "missing
    column"), so one odd row never ends a run.
    """
    try:
        row = rows[index]
        task.check_row(row)
        messages = task.messages(row)
    except BadRow:
        raise
    except KeyError as error:
        raise BadRow("missing column", f"row {index} has no column {error}; check the column names of the data.") \
            from error
    except Exception as error:  # the task's own code on an odd row: counted, the first traceback shown
        raise BadRow("error", f"row {index} raised {type(error).__name__}: {str(error)[:200]}") from error
    for message in messages:
        for part in message["content"] if isinstance(message.get("content"), list) else []:
            image = part.get("image") if isinstance(part, dict) else None
            if isinstance(image, Image.Image):
                width, height = image.size
                if min(width, height) == 0:
                    raise BadRow("zero-size image", f"row {index} has an image of {width}x{height} pixels.")
                if max(width, height) / min(width, height) > max_aspect_ratio:
                    raise BadRow("extreme aspect ratio", f"row {index} has a {width}x{height} image, over the "
                                                         f"{max_aspect_ratio:g}:1 aspect ratio the model's processor "
                                                         "accepts.")
    return Prompt(index, row, _with_videos(task, messages, index))


def _with_videos(task, messages: list[dict], index: int) -> list[dict]:
    """The messages with their videos read and sampled once (data/video.py), within data.max_video_frames;
    a video that cannot be read raises BadRow with its reason."""
    from gpg_vl.data.video import decode_videos, message_videos

    if not message_videos(messages):
        return messages
    from gpg_vl.data.sources import data_image_root

    return decode_videos(messages, max_frames=getattr(task, "max_video_frames", None),
                         root=data_image_root(getattr(task, "image_root", None), getattr(task, "data_path", None)),
                         allow_outside=getattr(task, "allow_outside_paths", False), row=index)


class BadRowLog:
    """Counts of rows seen and bad rows by reason, the first bad rows, and the stop rule.

    The run stops once `bad > max_bad_fraction * max(seen, min(MIN_ROWS_JUDGED, split size))`: a few bad
    rows at the start of a run do not stop it, a split where most rows are bad stops it within a few rows.
    """

    def __init__(self, max_bad_fraction: float = 1.0, total: int | None = None, kept: int | None = FIRST_KEPT) -> None:
        self.max_bad_fraction, self.total, self.kept = max_bad_fraction, total, kept
        self.seen, self.bad, self.in_a_row = 0, 0, 0
        self.by_reason: dict[str, int] = {}
        self.skipped: dict[str, int] = {}  # rows a task skips by design (SkippedRow), by reason: never "bad"
        self.first: list[list] = []  # [index, reason, message] of the first `kept` bad rows (None: all)
        self.traceback_shown = False

    def good(self) -> None:
        self.seen += 1
        self.in_a_row = 0

    def record(self, index: int, error: BadRow) -> str | None:
        """Count a bad row (a skipped one apart); returns a message to print when its reason is new (one per
        reason)."""
        if isinstance(error, SkippedRow):
            self.in_a_row += 1  # a split of skipped rows only still ends (next_prompts' guard)
            new = error.reason not in self.skipped
            self.skipped[error.reason] = self.skipped.get(error.reason, 0) + 1
            return (f"skipped row {index} ({error.reason}): {error} Such rows are counted as skipped_rows/"
                    f"{error.reason} in metrics.jsonl and summary.json, outside data.max_bad_fraction; this is "
                    "shown once.") if new else None
        self.seen += 1
        self.bad += 1
        self.in_a_row += 1
        new = error.reason not in self.by_reason
        self.by_reason[error.reason] = self.by_reason.get(error.reason, 0) + 1
        if self.kept is None or len(self.first) < self.kept:
            self.first.append([index, error.reason, str(error)])
        if not new:
            return None
        note = f"skipped row {index} ({error.reason}): {error} Bad rows are counted by reason in metrics.jsonl " \
               "and summary.json; this is shown once per reason."
        cause = error.__cause__
        if error.reason == "error" and cause is not None and not self.traceback_shown:
            self.traceback_shown = True
            note += "\n" + "".join(traceback.format_exception(type(cause), cause, cause.__traceback__)).rstrip()
        return note

    def over_limit(self) -> bool:
        judged = max(self.seen, min(MIN_ROWS_JUDGED, self.total or MIN_ROWS_JUDGED))
        return self.bad > self.max_bad_fraction * judged

    def stop_message(self) -> str:
        """One sentence: how many rows are bad, the limit, the first bad rows with their reasons, the fix."""
        first = ", ".join(f"row {index} ({reason})" for index, reason, _ in self.first[:FIRST_KEPT])
        if not self.bad:  # every row drawn was skipped by design
            reasons = ", ".join(f"{count} {reason}" for reason, count in sorted(self.skipped.items()))
            return (f"no training row can be used: the task skipped every row drawn ({reasons}); give the run what "
                    "those rows need (the first skip's warning says what) or use other data.")
        return (f"{self.bad} of {self.seen} rows seen are bad ({self.bad / max(self.seen, 1):.1%}), over "
                f"data.max_bad_fraction={self.max_bad_fraction}; the first: {first}; fix or drop them "
                "(scripts/validate_data.py lists every bad row and why) or raise data.max_bad_fraction.")

    def metrics(self) -> dict[str, float]:
        """Cumulative counts for metrics.jsonl: rows_seen, bad_rows and bad_rows/<reason>."""
        counts = {"rows_seen": self.seen, "bad_rows": self.bad}
        counts.update({f"bad_rows/{reason}": count for reason, count in sorted(self.by_reason.items())})
        counts.update({f"skipped_rows/{reason}": count for reason, count in sorted(self.skipped.items())})
        return counts

    def summary(self) -> dict:
        skipped = {"skipped_rows": dict(sorted(self.skipped.items()))} if self.skipped else {}
        return {"rows_seen": self.seen, "bad_rows": self.bad, "by_reason": dict(sorted(self.by_reason.items())),
                **skipped, "first_bad_rows": [{"row": i, "reason": r, "message": m} for i, r, m in self.first]}

    def report(self, what: str = "rows") -> str:
        """A few lines for people: the counts by reason and the first bad rows."""
        lines = [f"{what}: {self.seen} seen, {self.bad} bad ({self.bad / max(self.seen, 1):.1%}; limit "
                 f"data.max_bad_fraction={self.max_bad_fraction})"]
        width = max((len(reason) for reason in self.by_reason), default=0)
        lines += [f"  {reason:<{width}}  {count}" for reason, count in sorted(self.by_reason.items())]
        lines += [f"{what} skipped by design (not bad): " + ", ".join(
            f"{count} {reason}" for reason, count in sorted(self.skipped.items()))] if self.skipped else []
        if self.first:
            lines.append("bad rows:" if len(self.first) == self.bad else f"first {len(self.first)} bad rows:")
            lines += [f"  row {index}: {reason}: {message}" for index, reason, message in self.first]
        return "\n".join(lines)

    def state_dict(self) -> dict:
        return {"seen": self.seen, "bad": self.bad, "in_a_row": self.in_a_row, "by_reason": dict(self.by_reason),
                "skipped": dict(self.skipped), "first": [list(entry) for entry in self.first]}

    def load_state_dict(self, state: dict) -> None:
        self.seen, self.bad, self.in_a_row = int(state["seen"]), int(state["bad"]), int(state["in_a_row"])
        self.by_reason = {str(k): int(v) for k, v in state["by_reason"].items()}
        self.skipped = {str(k): int(v) for k, v in state.get("skipped", {}).items()}
        self.first = [list(entry) for entry in state["first"]]


def scan_rows(task, rows: Sequence, *, max_bad_fraction: float = 1.0, kept: int | None = FIRST_KEPT,
              progress: Callable[[int], None] | None = None,
              max_aspect_ratio: float = MAX_ASPECT_RATIO) -> tuple[list[int], BadRowLog]:
    """Check every row of `rows` as training would; returns the good positions and the log (which keeps the
    first `kept` bad rows with their messages, or all of them with `kept=None`)."""
    log = BadRowLog(max_bad_fraction, total=len(rows), kept=kept)
    good = []
    for index in range(len(rows)):
        try:
            prepare_prompt(task, rows, index, max_aspect_ratio)
            log.good()
            good.append(index)
        except BadRow as error:
            log.record(index, error)
        if progress is not None:
            progress(index)
    return good, log


class Subset(Sequence):
    """The rows of `rows` at `positions`, read lazily (images are decoded when a row is read)."""

    def __init__(self, rows: Sequence, positions: Sequence[int]) -> None:
        self.rows, self.positions = rows, list(positions)

    def __len__(self) -> int:
        return len(self.positions)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return Subset(self.rows, self.positions[index])
        return self.rows[self.positions[index]]


class PromptStream:
    """Yields the row indices of B prompts at a time, global over processes; every process walks the
    same permutation (seeded by seed and epoch) and takes its own share, so no prompt repeats
    within an epoch and `state_dict()` / `load_state_dict()` resume exactly where it was.

    `next_prompts` checks every drawn row (on every process, so that all of them skip the same rows and
    stay in step without communicating) and replaces bad rows by the next ones of the walk."""

    def __init__(self, rows: Sequence, *, seed: int, rank: int = 0, world_size: int = 1,
                 max_bad_fraction: float = 1.0, warn: Callable[[str], None] | None = None,
                 stop: Callable[[str], None] | None = None, max_aspect_ratio: float = MAX_ASPECT_RATIO,
                 sampler=None) -> None:
        if len(rows) == 0:
            raise ValueError("the training split has no rows")
        self.rows, self.seed, self.rank, self.world_size = rows, seed, rank, world_size
        # data.sampler (gpg_vl/data/samplers.py): which rows of the walk are taken now; None: all (uniform)
        self.sampler = sampler
        self.epoch, self.position = 0, 0
        self._order = self._permutation(0)
        self.bad = BadRowLog(max_bad_fraction, total=len(rows))
        self.warn = warn or (lambda message: print(f"warning: {message}"))
        self.max_aspect_ratio = max_aspect_ratio
        self.stop = stop  # called with the stop sentence before the UserError is raised (e.g. to write a summary)
        self.said_passed_over = False  # the sampler deferred a whole pass once (said once)

    def _permutation(self, epoch: int) -> list[int]:
        generator = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
        return torch.randperm(len(self.rows), generator=generator).tolist()

    def next_indices(self, count: int) -> list[int]:
        """The next `count` global indices (crossing into the next epoch when needed). A sampler may defer rows
        to the next epoch; once it has deferred a whole pass's worth in a row (every row settled and a tiny
        data.difficulty_keep), the next row is taken without asking it: a prompt costs at most one pass."""
        indices, deferred = [], 0
        while len(indices) < count:
            if self.position >= len(self._order):
                self.epoch += 1
                self.position = 0
                self._order = self._permutation(self.epoch)
            if self.sampler is not None and self.sampler.records:  # a row may be deferred to the next epoch
                index = self._order[self.position]
                self.position += 1
                if deferred >= len(self._order):
                    self._passed_over()
                if deferred >= len(self._order) or self.sampler.take(index):
                    indices.append(index)
                    deferred = 0
                else:
                    deferred += 1
                continue
            take = min(count - len(indices), len(self._order) - self.position)
            indices += self._order[self.position:self.position + take]
            self.position += take
        return indices

    def _passed_over(self) -> None:
        """Say once that the sampler deferred a whole pass (the walk then takes a row anyway)."""
        if not self.said_passed_over:
            self.said_passed_over = True
            rows = f"{len(self._order)} row{'s' if len(self._order) != 1 else ''}"
            self.warn(f"data.sampler={getattr(self.sampler, 'name', 'the sampler')} deferred every row of a whole "
                      f"pass over the split ({rows}, all settled); the walk takes the next row anyway, at most one "
                      "pass per prompt (a larger data.difficulty_keep draws settled rows sooner).")

    @property
    def records(self) -> bool:
        """Whether its sampler keeps group outcomes (`record`)."""
        return self.sampler is not None and self.sampler.records

    def record(self, outcomes: Sequence[tuple[str | None, int, float]]) -> None:
        """Group outcomes (task, row, pass rate) for the sampler (the same on every process: the caller gathers
        them); the task is a mixture's (data/mixture.py), None here."""
        if self.sampler is not None:
            for _, index, rate in outcomes:
                self.sampler.record(index, rate)

    def next_local(self, global_count: int) -> list[tuple[int, dict]]:
        """This process's share (index, row) of the next `global_count` prompts (rows unchecked)."""
        indices = self.next_indices(global_count)[self.rank::self.world_size]
        return [(i, self.rows[i]) for i in indices]

    def next_prompts(self, global_count: int, task) -> list[Prompt]:
        """This process's share of the next `global_count` GOOD prompts: bad rows are skipped, counted and
        replaced by the next rows of the walk; raises UserError once too many of the rows seen are bad."""
        good: list[Prompt] = []
        while len(good) < global_count:
            for index in self.next_indices(global_count - len(good)):
                try:
                    good.append(prepare_prompt(task, self.rows, index, self.max_aspect_ratio))
                    self.bad.good()
                except BadRow as error:
                    note = self.bad.record(index, error)
                    if note:
                        self.warn(note)
                    if self.bad.over_limit() or self.bad.in_a_row >= len(self.rows):
                        if self.stop is not None:
                            self.stop(self.bad.stop_message())
                        raise UserError(self.bad.stop_message()) from None
        return good[self.rank::self.world_size]

    def state_dict(self) -> dict:
        state = {"epoch": self.epoch, "position": self.position, "seed": self.seed, "bad": self.bad.state_dict()}
        if self.sampler is not None and self.sampler.records:
            state["sampler"] = self.sampler.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = state["epoch"], state["position"]
        self._order = self._permutation(self.epoch)
        if "bad" in state:
            self.bad.load_state_dict(state["bad"])
        if "sampler" in state and self.sampler is not None:
            self.sampler.load_state_dict(state["sampler"])

    def metrics(self) -> dict:
        """The stream's figures for metrics.jsonl: bad rows, epoch, position, the sampler's own."""
        return {**self.bad.metrics(), "data_epoch": self.epoch, "data_position": self.position,
                **(self.sampler.metrics() if self.sampler is not None else {})}
