"""A checkpoint folder and the output folder's checkpoints: the names (`checkpoint-<step>/`, `final/`, their
files), the finders (the newest complete and intact one, those past a step, the partial folders a kill left) and the
one sentence for a run's file that could not be written, naming the newest intact checkpoint.

A checkpoint folder holds
- the model and its processor in Hugging Face format, the weights as safetensors (with LoRA, the adapter or the
  merged weights, as `model.lora.save` says: `gpg_vl.models.lora.save_model`);
- `trainer_state.pt`: the step, the optimizer and LR scheduler states, every RNG state (python, numpy,
  torch, CUDA; one set per process), the data position and the run's counters. It holds only tensors,
  numbers, strings, lists and dicts, and is read with `torch.load(weights_only=True)`: loading a
  checkpoint never unpickles code;
- `checkpoint.json`, written last, the mark of a complete checkpoint: `{"step": N, "files": {name: {"size",
  "sha256"}}, "config": {...}}`, every other file's size and sha256 (`verify_checkpoint` checks them before a
  resume reads anything) and the settings the run was made with (a resume compares them:
  gpg_vl/train/checkpoint/resume.py's `compare_settings`).

How a checkpoint is written (atomically) is gpg_vl/train/checkpoint/save.py; how a run continues from one,
gpg_vl/train/checkpoint/resume.py.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
from pathlib import Path

from gpg_vl.errors import UserError
from gpg_vl.files import PARTIAL

STATE_FILE = "trainer_state.pt"
MARKER_FILE = "checkpoint.json"
SAMPLER_FILE = "sampler.safetensors"  # the older weights the steps in flight sample with (trainer.max_staleness >= 1)
OLD = ".old"  # a folder being replaced: renamed aside, deleted once the new one is in place
ZERO_STATE = "zero"  # under DeepSpeed: the engine's own checkpoint (each process's optimizer partition, fp32 master)
_CHECKPOINT = re.compile(r"checkpoint-(\d+)")


# How writers other than the OS report a full disk: safetensors ("SafetensorError: ... No space left on
# device (os error 28)"), and torch.save, whose zip writer finds its file shorter than what it wrote
# ("RuntimeError: [enforce fail at inline_container.cc:...] . unexpected pos 123 vs 456" or "... file write failed").
DISK_FULL = ("no space left on device", "disk quota exceeded")
SHORT_WRITE = ("unexpected pos", "file write failed")


def write_failure(error: BaseException, subject: str = "it") -> str:
    """Why a write failed, for a sentence: "the disk is full (No space left on device)", "the write was cut short,
    most often by a full disk (...)", or "`subject` could not be written (...)". `error` is an OSError or what
    torch.save and safetensors raise (a RuntimeError, a SafetensorError), judged by its errno or message."""
    detail = (getattr(error, "strerror", None) or str(error) or type(error).__name__).strip().splitlines()
    detail = " ".join(line.strip() for line in detail)[-160:]
    if not isinstance(error, OSError):
        detail = f"{type(error).__name__}: {detail}"
    message = str(error).lower()
    if getattr(error, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or any(m in message for m in DISK_FULL):
        why = "the disk is full"
    elif any(m in message for m in SHORT_WRITE):
        why = "the write was cut short, most often by a full disk"
    else:
        why = f"{subject} could not be written"
    return f"{why} ({detail.rstrip('.')})"


def unwritable(what: str, output_dir: Path, error: BaseException) -> UserError:
    """The one sentence for a run's file that could not be written (most often: the disk is full), naming
    the newest intact checkpoint, from which resume=auto continues."""
    intact = latest_checkpoint(output_dir)
    return UserError(f"could not {what} in {str(output_dir)!r}: {write_failure(error)}; "
                     f"the newest intact checkpoint is {intact or 'none (none was written)'}: free space or "
                     "fix the folder, then continue with resume=auto.")


@contextlib.contextmanager
def writing(what: str, output_dir: Path):
    """Write a run's file (metrics.jsonl, summary.json, curves, rollouts) inside this block: an OSError ends
    the run in `unwritable`'s sentence instead of a traceback (a checkpoint's save catches more: see
    `save_checkpoint`)."""
    try:
        yield
    except OSError as error:
        raise unwritable(what, Path(output_dir), error) from None


def file_sha256(file: Path) -> str:
    """The sha256 of a file, read a MiB at a time."""
    digest = hashlib.sha256()
    with file.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def remove_checkpoint(path: Path) -> None:
    """Delete a checkpoint folder: renamed aside first, so that a kill during the deletion never leaves a
    half-deleted folder that still looks complete."""
    old = path.with_name(path.name + OLD)
    shutil.rmtree(old, ignore_errors=True)
    path.rename(old)
    shutil.rmtree(old, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# find
# ---------------------------------------------------------------------------------------------
def checkpoint_step(path: Path) -> int | None:
    """The step of a complete checkpoint folder; None when `path` is not one (partial, missing, foreign)."""
    path = Path(path)
    if path.name.endswith((PARTIAL, OLD)) or not (path / STATE_FILE).is_file():
        return None
    try:
        return int(json.loads((path / MARKER_FILE).read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def numbered_checkpoints(folder: Path) -> list[tuple[int, Path]]:
    """(step, path) of the complete `checkpoint-<step>/` folders in `folder`."""
    found = []
    for child in Path(folder).glob("checkpoint-*"):
        if _CHECKPOINT.fullmatch(child.name) and checkpoint_step(child) is not None:
            found.append((checkpoint_step(child), child))
    return found


def _newest_first(output_dir: str | os.PathLike) -> list[Path]:
    """The complete checkpoints in `output_dir`, newest first (a numbered one before `final/` of its step)."""
    output_dir = Path(output_dir)
    candidates = numbered_checkpoints(output_dir) if output_dir.is_dir() else []
    final = output_dir / "final"
    if checkpoint_step(final) is not None:
        candidates.append((checkpoint_step(final), final))
    return [path for _, path in sorted(candidates, key=lambda item: (item[0], item[1].name != "final"), reverse=True)]


def latest_checkpoint(output_dir: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint in `output_dir` (`checkpoint-<step>/`, or `final/` when it is further on);
    `.partial` folders and folders without their marker are never chosen."""
    found = _newest_first(output_dir)
    return found[0] if found else None


def verify_checkpoint(path: Path) -> str | None:
    """What is wrong with a complete checkpoint's files against the sizes and sha256 its checkpoint.json
    records (None: nothing; a checkpoint from before those records is taken as it is)."""
    try:
        files = json.loads((Path(path) / MARKER_FILE).read_text()).get("files")
    except (OSError, ValueError, AttributeError):
        return f"its {MARKER_FILE} cannot be read"
    for name, expected in (files or {}).items():
        file = Path(path) / name
        if not file.is_file():
            return f"{name} is missing"
        size = file.stat().st_size
        if size != expected.get("size"):
            return f"{name} has {size} bytes, {expected.get('size')} were written"
        if file_sha256(file) != expected.get("sha256"):
            return f"{name} does not match the sha256 it was written with"
    return None


def later_checkpoints(output_dir: str | os.PathLike, step: int) -> list[Path]:
    """The complete checkpoints in `output_dir` past `step` (`final/` included): a run resumed at `step` replaces
    them, and removes them first so that resume=auto never picks one of the abandoned continuation."""
    output_dir = Path(output_dir)
    found = [path for found_step, path in numbered_checkpoints(output_dir) if found_step > step] \
        if output_dir.is_dir() else []
    final_step = checkpoint_step(output_dir / "final")
    if final_step is not None and final_step > step:
        found.append(output_dir / "final")
    return found


def remove_partials(output_dir: str | os.PathLike) -> list[Path]:
    """Delete the `.partial` and `.old` folders an interrupted save left in `output_dir`; returns them."""
    output_dir = Path(output_dir)
    leftovers = [p for p in output_dir.glob("*") if p.is_dir() and p.name.endswith((PARTIAL, OLD))] \
        if output_dir.is_dir() else []
    for leftover in leftovers:
        shutil.rmtree(leftover, ignore_errors=True)
    return leftovers


def resolve_resume(resume, output_dir: str | os.PathLike, warn=print) -> Path | None:
    """The checkpoint that `resume=` names: None (start afresh), `auto` (the newest checkpoint in `output_dir`
    that is complete and intact, None when there is none; each damaged newer one is named in a warning) or a
    checkpoint folder, which must be complete and intact."""
    if resume is None or str(resume) in ("", "null", "none", "None"):
        return None
    if str(resume) == "auto":
        for path in _newest_first(output_dir):
            problem = verify_checkpoint(path)
            if problem is None:
                return path
            warn(f"warning: resume=auto skips {path}, which is damaged ({problem}); it falls back to an older one.")
        return None
    path = Path(str(resume)).expanduser()
    if checkpoint_step(path) is None:
        raise UserError(f"resume={str(resume)!r} is not a complete checkpoint (a folder with {MARKER_FILE} and "
                        f"{STATE_FILE}, e.g. {Path(output_dir) / 'checkpoint-100'}); pass one, or resume=auto to "
                        "continue from the newest one in output_dir.")
    problem = verify_checkpoint(path)
    if problem is not None:
        raise UserError(f"resume={str(resume)!r} is damaged ({problem}); pass an intact checkpoint, or resume=auto "
                        "to continue from the newest intact one in output_dir.")
    return path

