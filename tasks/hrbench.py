"""`hrbench`: HR-Bench 4K and 8K, multiple choice about ultra-high-resolution images, with the `zoom_in` tool.

Published as `DreamMr/HR-Bench`: `hr_bench_4k` and `hr_bench_8k`, each a tsv and a parquet file of 800 rows with
the columns `index` (int), `question`, `answer` (A-D), `category` (`single`: one detail, `cross`: several),
`A`, `B`, `C`, `D` (the options), `cycle_category` (which rotation of the options the row shows) and `image`
(base64; in the tsv, as in VLMEvalKit's files, a row may instead hold the `index` of the row whose image it
shares). `resolution` (4k or 8k) picks the file; data.path takes a local copy (the file, or the folder holding
it). Each question appears once per rotation of its options, so the options are never shuffled again.

Metrics as HR-Bench's evaluation computes them: within each `cycle_category` the accuracy of `single` and of
`cross` questions and of all its rows; each averaged over the cycles (`single`, `cross`, `average`).
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Sequence
from pathlib import Path

import datasets

from gpg_vl.data.sources import RowView, load_rows
from gpg_vl.data.task import column_text, register_task, row_name
from gpg_vl.errors import BadRow, UserError

from .vstar import ToolChoice, mean

HUB_ID = "DreamMr/HR-Bench"
RESOLUTIONS = ("4k", "8k")
COLUMNS = ("index", "question", "answer", "category", "A", "B", "C", "D", "cycle_category", "image")
CATEGORIES = ("single", "cross")
ALL = "\0all"  # the cell key of every row of a cycle (no category can be named so)


def decode_base64(value: str, row: dict) -> bytes:
    """The bytes of a base64 image; `BadRow` "corrupt image" when the text is not base64."""
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise BadRow("corrupt image", f"{row_name(row)} has an image that is not base64 text; fix or drop it.") \
            from None


def read_tsv(path: Path) -> datasets.Dataset:
    """A tsv file's rows through `datasets`' csv reader (memory-mapped: an 8K file's images take gigabytes)."""
    try:
        return datasets.load_dataset("csv", data_files=str(path), sep="\t", split="train")
    except Exception as error:  # malformed rows: the exception types vary
        raise UserError(f"could not read {str(path)!r} as a tsv file ({error}); check that it is HR-Bench's.") from None


@register_task
class HRBench(ToolChoice):
    """HR-Bench 4K / 8K: 800 rows each (200 questions x 4 rotations of their options)."""

    name = "hrbench"
    train_split = "test"  # HR-Bench has one split
    eval_split = "test"

    def __init__(self, resolution: str = "4k", **options) -> None:
        if str(resolution).lower() not in RESOLUTIONS:
            raise UserError(f"hrbench has no resolution {resolution!r}; set task.options.resolution to 4k or 8k.")
        super().__init__(**options)
        self.resolution = str(resolution).lower()

    @property
    def file_name(self) -> str:
        return f"hr_bench_{self.resolution}"

    def load(self, split: str) -> RowView:
        path = None if self.data_path is None else Path(self.data_path).expanduser()
        if path is not None and path.is_dir():
            found = [path / f"{self.file_name}{suffix}" for suffix in (".parquet", ".tsv")]
            path = next((file for file in found if file.is_file()), path)
        if path is not None and path.suffix == ".tsv" and path.is_file():
            rows = read_tsv(path)
        elif path is None:
            rows = self._hub_rows()
        else:
            rows = load_rows(None, split, path=path)
        missing = [column for column in COLUMNS if column not in rows.column_names]
        if missing:
            raise UserError(f"{str(path or HUB_ID)!r} lacks HR-Bench's column(s) {missing} (it has "
                            f"{rows.column_names}); point data.path= at hr_bench_{self.resolution}.tsv or .parquet.")
        positions = {int(index): position for position, index in enumerate(rows["index"])}
        return RowView(rows, lambda position, row: self._row(row, rows, positions))

    def _hub_rows(self) -> datasets.Dataset:
        try:
            return datasets.load_dataset(HUB_ID, data_files=f"{self.file_name}.parquet", split="train")
        except Exception as error:  # offline, moved files: the exception types vary
            raise UserError(f"could not load {self.file_name}.parquet of {HUB_ID!r} from the Hugging Face Hub "
                            f"({str(error)[:200]}); download it and pass data.path=/path/to/it.") from None

    def _row(self, row: dict, rows, positions: dict[int, int]) -> dict:
        row["id"] = f"hrbench-{self.resolution}-{row['index']}"
        targets = self.prepare_targets(row)  # before the image: a row without options is not decoded
        value = column_text(row, "image")
        if value.isdigit() and int(value) in positions:  # VLMEvalKit's tsv: the index of the row holding the image
            value = column_text(rows[positions[int(value)]], "image")
        return {**row, "image": self.open_image(decode_base64(value, row)), **targets}

    def prepare_targets(self, row: dict) -> dict:
        """`question`, `choices` (the A-D columns, up to the first empty one) and `answer` (the letter)."""
        choices = []
        for letter in "ABCD":
            value = row.get(letter)
            if value is None or (isinstance(value, float) and value != value) or not str(value).strip():
                break
            choices.append(str(value).strip())
        if len(choices) < 2:
            raise BadRow("no options", f"{row_name(row)} has fewer than two options in its A-D columns; drop it.")
        return {"question": column_text(row, "question"), "choices": choices,
                "answer": column_text(row, "answer").strip("() .").upper()}

    def metrics(self, rows: Sequence[dict], completions: Sequence[str],
                scores: Sequence[dict] | None = None) -> dict[str, float]:
        """The default metrics, and HR-Bench's (`report_acc_hrbench`): within each cycle the accuracy of each
        category and of all its rows; each averaged over the cycles (`single`, `cross`, and `average` from the
        per-cycle accuracy over ALL rows, HR-Bench's "Average / all"). `average` is not the mean of `single` and
        `cross`: the two agree only when every cycle holds as many single rows as cross rows."""
        rows = list(map(self.scoring_row, rows))
        scores = self.scored(rows, completions, scores)
        result = super().metrics(rows, completions, scores)
        cells: dict[tuple[str, str], list[float]] = {}
        for row, components in zip(rows, scores, strict=True):
            for category in (str(row["category"]), ALL):
                cells.setdefault((category, str(row["cycle_category"])), []).append(components["accuracy"])
        for category in sorted({category for category, _ in cells}):
            cycles = [mean(values) for (name, _), values in cells.items() if name == category]
            result["average" if category == ALL else category] = mean(cycles)
        return result
