"""Rows and images for task plugins, from the Hugging Face Hub or from a local copy (`data.path=`).

`load_rows` gives a split as a `datasets.Dataset`: lazy, indexable, each row a dict of the published
columns (images as PIL images where the column is an `Image` feature). A local copy may be a data file,
a folder of them named after their split, or a `save_to_disk` folder, so a machine without network
access trains on the same rows. `load_image` turns whatever a row holds into an RGB PIL image.
"""

from __future__ import annotations

import io
import os
import re
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import datasets
import numpy as np
from PIL import Image

from gpg_vl.errors import BadRow, UserError

BUILDERS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".csv": "csv", ".arrow": "arrow"}
ACCEPTED = "a parquet/jsonl/json/csv/arrow file, a folder of them named after their split, or a save_to_disk folder"
_SHARD = re.compile(r"-\d+-of-\d+$")  # train-00000-of-00003 -> train, as the Hub names shards
_METADATA = {"dataset_info.json", "dataset_infos.json", "dataset_dict.json", "state.json"}  # not rows


def load_rows(
    hub_id: str | None,
    split: str,
    *,
    path: str | os.PathLike | None = None,
    config_name: str | None = None,
    required_columns: Sequence[str] = (),
) -> datasets.Dataset:
    """The rows of `split`: from `path` when given (a local copy wins over the Hub), else from `hub_id`."""
    if path is not None:
        rows, where = _load_local(Path(path).expanduser(), split), repr(str(path))
    elif hub_id:
        rows, where = _load_hub(hub_id, split, config_name), f"dataset {hub_id!r}"
    else:
        raise UserError("no data source was given; pass data.path=/path/to/local/copy or a Hub dataset id.")
    if len(rows) == 0:
        raise UserError(f"split {split!r} of {where} has no rows; point data.path= at a copy that holds the split's "
                        "rows.")
    missing = [column for column in required_columns if column not in rows.column_names]
    if missing:
        raise UserError(
            f"split {split!r} of {where} lacks column(s) {missing} (it has {rows.column_names}); "
            "point data.path= at a copy of the dataset with the published columns."
        )
    return rows


def _load_hub(hub_id: str, split: str, config_name: str | None) -> datasets.Dataset:
    try:
        return datasets.load_dataset(hub_id, config_name, split=split)
    except Exception as exc:  # offline, unknown id, missing split: the exception types vary by cause
        reason = _reason(exc)
        if isinstance(exc, ValueError) and re.search(r"(Unknown|Bad) split", reason):
            raise UserError(f"dataset {hub_id!r} has no split {split!r} ({reason}); pick one of its splits.") from exc
        raise UserError(
            f"could not load dataset {hub_id!r} from the Hugging Face Hub ({reason}); check the id, or without "
            f"network access download it elsewhere and pass data.path=/path/to/local/copy ({ACCEPTED})."
        ) from exc


def _load_local(path: Path, split: str) -> datasets.Dataset:
    if not path.exists():
        raise UserError(f"data.path {str(path)!r} does not exist; pass {ACCEPTED}.")
    if _is_saved(path):
        return _select(_read(path, lambda: datasets.load_from_disk(str(path))), split, path)
    if path.is_file():
        if path.suffix.lower() not in BUILDERS:
            raise UserError(f"data.path {str(path)!r} has an unsupported file type {path.suffix!r}; pass {ACCEPTED}.")
        return _read_files(path.suffix.lower(), [path], path)  # a single file is the split, whatever its name
    saved = {child.name: child for child in path.iterdir() if child.is_dir() and _is_saved(child)}
    files: dict[str, list[Path]] = {}
    for file in sorted(path.rglob("*")):
        parts = file.relative_to(path).parts
        if file.is_file() and file.suffix.lower() in BUILDERS and parts[0] not in saved:
            if file.name not in _METADATA and not any(part.startswith(".") for part in parts):
                files.setdefault(_SHARD.sub("", file.name[: -len(file.suffix)]), []).append(file)
    if split in saved:
        return _select(_read(saved[split], lambda: datasets.load_from_disk(str(saved[split]))), split, saved[split])
    if split not in files:
        available = sorted({*saved, *files})
        raise UserError(
            f"data.path {str(path)!r} has no split {split!r} (available: {', '.join(available) or 'none'}); "
            f"name a file after the split ({split}.parquet) or pass the file itself as data.path=."
        )
    suffixes = {file.suffix.lower() for file in files[split]}
    if len({BUILDERS[suffix] for suffix in suffixes}) > 1:
        raise UserError(f"split {split!r} of {str(path)!r} mixes file types {sorted(suffixes)}; keep one type.")
    return _read_files(suffixes.pop(), files[split], path)


def _is_saved(path: Path) -> bool:
    """Whether `path` is a folder written by `Dataset.save_to_disk` or `DatasetDict.save_to_disk`."""
    return path.is_dir() and ((path / "dataset_dict.json").exists() or (path / "state.json").exists())


def _read_files(suffix: str, files: list[Path], where: Path) -> datasets.Dataset:
    full = [file for file in files if not _is_empty(file)]  # `datasets` fails on empty ones ("StopIteration")
    if len(files) == 1 and not full:
        raise UserError(f"data file {str(files[0])!r} is empty (no rows); write its rows, or point data.path= at "
                        "the data.")
    if not full:
        raise UserError(f"all {len(files)} data files of the split under {str(where)!r} are empty (no rows), e.g. "
                        f"{files[0].name!r}; write their rows, or point data.path= at the data.")
    data_files = [str(file) for file in full]
    return _read(where, lambda: datasets.load_dataset(BUILDERS[suffix], data_files=data_files, split="train"))


def _is_empty(file: Path) -> bool:
    """Zero bytes; a parquet file whose footer counts no rows (pandas' empty frame, a table without columns);
    or (text formats) nothing but whitespace: the first non-blank byte is read, not the file."""
    if file.stat().st_size == 0:
        return True
    if BUILDERS.get(file.suffix.lower()) == "parquet":
        return _parquet_rows(file) == 0
    if BUILDERS.get(file.suffix.lower()) not in ("json", "csv"):
        return False
    with file.open("rb") as handle:
        while chunk := handle.read(1 << 16):
            if chunk.strip():
                return False
    return True


def _parquet_rows(file: Path) -> int | None:
    """The row count in a parquet file's footer (None when the footer cannot be read: `_read` then says why)."""
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(file).metadata.num_rows
    except Exception:  # a corrupt or truncated file: reported when it is read
        return None


def _read(where: Path, load: Callable[[], Any]) -> Any:
    try:
        return load()
    except Exception as exc:  # corrupt parquet, malformed json lines, incomplete save_to_disk folders
        if "corresponds to no data" in str(exc):  # `datasets` on files with a schema but no rows
            raise UserError(f"{str(where)!r} holds no rows; write its rows, or point data.path= at the data.") from exc
        raise UserError(f"could not read {str(where)!r} ({_reason(exc)}); check that it is {ACCEPTED}.") from exc


def _select(loaded: datasets.Dataset | datasets.DatasetDict, split: str, where: Path) -> datasets.Dataset:
    if isinstance(loaded, datasets.Dataset):
        return loaded  # a saved single Dataset is the split, like a single file
    if split not in loaded:
        raise UserError(
            f"save_to_disk folder {str(where)!r} has no split {split!r} (available: {', '.join(loaded)}); "
            "pick one of those splits."
        )
    return loaded[split]


def _reason(exc: BaseException) -> str:
    """The exception's message on one short line, so the UserError stays one sentence."""
    text = re.sub(r" <[^<>]* at 0x[0-9a-f]+>", "", " ".join(str(exc).split())).rstrip(".") or type(exc).__name__
    return text if len(text) <= 200 else text[:197] + "..."


def load_image(value: Any, *, image_root: str | os.PathLike | None = None, row: Any = None,
               allow_outside: bool = False) -> Image.Image:
    """An RGB image, fully decoded, from a PIL image, a `datasets` image dict, bytes or a path.

    Relative paths resolve against `image_root`, and a path must stay inside it (compared after resolving
    '..', not symlinks: a link the user put under the root is theirs) unless `allow_outside`
    (`data.allow_outside_paths=true`); without an `image_root` paths are not checked. `row` only names the row in
    error messages. A value that is no usable image raises `BadRow` (a UserError) whose `reason` says why:
    "missing image" (None), "not an image", "image path outside the image root" ('../../etc/passwd', an absolute
    path elsewhere), "missing image file", "zero-size image", "image too large" (a decompression bomb, over
    `PIL.Image.MAX_IMAGE_PIXELS`) or "corrupt image" (truncated or undecodable bytes).
    """
    where = "image bytes" + (f" of row {row}" if row is not None else "")
    if isinstance(value, dict):
        where = repr(value["path"]) if value.get("path") else where
        value = value.get("bytes") or value.get("path")
    if value is None:
        raise BadRow("missing image", f"{where} is missing (None); check the image column of the data.")
    if isinstance(value, (str, os.PathLike)):
        file = data_file(value, image_root, allow_outside, "image")
        where, value = repr(str(file)), file
        empty = file.stat().st_size == 0
    elif isinstance(value, (bytes, bytearray, memoryview)):
        value = io.BytesIO(bytes(value))
        empty = value.getbuffer().nbytes == 0
    elif isinstance(value, Image.Image):
        empty = value.width == 0 or value.height == 0
    else:
        raise BadRow("not an image", f"{where} is a {type(value).__name__}, not an image, a path or bytes; "
                                     "check the image column.")
    if empty:
        raise BadRow("zero-size image", f"{where} is empty (zero bytes or zero pixels); replace or drop it.")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # checked below, with the size
            image = value if isinstance(value, Image.Image) else Image.open(value)
        limit = Image.MAX_IMAGE_PIXELS
        if limit is not None and image.width * image.height > limit:
            raise Image.DecompressionBombError(f"{image.width}x{image.height} = {image.width * image.height} pixels")
        image.load()
        if image.width == 0 or image.height == 0:
            raise BadRow("zero-size image", f"{where} has zero pixels ({image.width}x{image.height}); drop it.")
        return to_rgb(image)
    except Image.DecompressionBombError as exc:
        raise BadRow(
            "image too large",
            f"{where} is too large to decode safely ({_pixels(exc)}, over PIL's limit of {Image.MAX_IMAGE_PIXELS}); "
            "shrink it, or raise PIL.Image.MAX_IMAGE_PIXELS if you trust the file."
        ) from exc
    except (OSError, ValueError, SyntaxError, EOFError) as exc:
        raise BadRow(
            "corrupt image",
            f"could not decode {where} ({_reason(exc)}); check that it is a complete image file and data.image_root=."
        ) from exc


def data_file(value: str | os.PathLike, root: str | os.PathLike | None, allow_outside: bool, kind: str) -> Path:
    """The file a path in the data names: relative paths resolve against `root`, and must stay inside it unless
    `allow_outside`; raises BadRow "<kind> path outside the image root" or "missing <kind> file"."""
    file = Path(value).expanduser()
    if not file.is_absolute() and root is not None:
        file = Path(root).expanduser() / file
    if root is not None and not allow_outside and not _inside(file, root):
        raise BadRow(f"{kind} path outside the image root",
                     f"{kind} path {str(value)!r} resolves to {os.path.abspath(file)!r}, outside the image root "
                     f"{os.path.abspath(Path(root).expanduser())!r}; fix the path or data.image_root=, or "
                     "set data.allow_outside_paths=true if you trust the data's paths.")
    if not file.is_file():
        raise BadRow(f"missing {kind} file",
                     f"{kind} file {str(file)!r} does not exist; check data.image_root= (now "
                     f"{None if root is None else str(root)!r}).")
    return file


def _inside(file: Path, root: str | os.PathLike) -> bool:
    """Whether `file` lies under `root`, both made absolute and their '..' resolved (symlinks are not followed)."""
    return Path(os.path.abspath(file)).is_relative_to(os.path.abspath(Path(root).expanduser()))


def _pixels(exc: Exception) -> str:
    """The size named by PIL's decompression-bomb message ("Image size (N pixels) exceeds ...")."""
    found = re.search(r"\d+x\d+ = \d+ pixels|\d+ pixels", str(exc))
    return found.group(0) if found else _reason(exc)


def to_rgb(image: Image.Image) -> Image.Image:
    """`image` in RGB: transparency composited on white, 16-bit and float data scaled to 8 bits, not clipped."""
    if image.mode == "RGB":
        return image
    if image.mode in ("I", "F") or image.mode.startswith("I;16"):
        pixels = np.asarray(image).astype(np.float64)
        if image.mode == "F":
            scale = 255.0 if pixels.size and pixels.max() <= 1.0 else 1.0
        else:  # I;16 always holds 16 bits; I holds 16-bit data (PNG) unless every value fits in 8 bits
            scale = 1.0 if image.mode == "I" and (not pixels.size or pixels.max() <= 255) else 1 / 257
        gray = np.clip(np.rint(pixels * scale), 0, 255).astype(np.uint8)
        return Image.fromarray(gray).convert("RGB")
    if image.mode in ("LA", "La", "PA", "RGBa") or (image.mode == "P" and "transparency" in image.info):
        image = image.convert("RGBA")
    if image.mode == "RGBA":
        white = Image.new("RGBA", image.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, image).convert("RGB")
    return image.convert("RGB")


class RowView(Sequence):
    """A lazy view of a `datasets.Dataset`: `prepare(index, row)` completes each row when it is read.

    Slicing a `datasets.Dataset` gives a dict of columns; slicing a view gives another lazy view, so
    `rows[:limit]` works as on any sequence of rows and decodes nothing until a row is read.
    """

    def __init__(self, rows: Any, prepare: Callable[[int, dict], dict], positions: range | None = None) -> None:
        self.rows, self.prepare = rows, prepare
        self.positions = range(len(rows)) if positions is None else positions

    def __len__(self) -> int:
        return len(self.positions)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return RowView(self.rows, self.prepare, self.positions[index])
        position = self.positions[index]
        return self.prepare(position, dict(self.rows[position]))


def data_image_root(image_root: str | os.PathLike | None, data_path: str | os.PathLike | None) -> str | None:
    """Where relative image paths resolve: data.image_root, else next to the data file (or in the data folder)."""
    if image_root is not None or data_path is None:
        return None if image_root is None else str(image_root)
    path = Path(data_path).expanduser()
    return str(path.parent if path.is_file() else path)
