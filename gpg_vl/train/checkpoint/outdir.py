"""An output folder belongs to one run: a lock held for the run's whole life, and no silent reuse.

- `claim_output_dir` (the main process, before the model loads) checks that `output_dir` can be a folder and
  is writable, takes its lock, and refuses a new run (no `resume=`) in a folder that holds a previous run's
  results: continue that run with `resume=auto`, or `overwrite=true` moves its files into
  `output_dir/previous-<time>/` (nothing is deleted).
- The lock is `output_dir/run.lock`, locked with `fcntl.flock` on a file held open for the run: the OS
  releases it when the process ends, however it ends, so a killed run never leaves a lock that blocks. The
  file names the holder (pid, host, start time) for the sentence a second run fails with, and is removed on
  a clean release (a run that took the lock of a file removed meanwhile takes it again, on the new file); a
  file still naming a holder when the lock is free was left by a killed run, which is said in a warning.
  Where the file system has no flock, a held lock is judged by its pid (same host only).
- A folder the claim created and that is empty once its lock is released (a run that failed before it wrote
  anything, such as a model that cannot load) is removed: no empty timestamped folder is left behind.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

from gpg_vl.errors import UserError
from gpg_vl.train.checkpoint.folder import latest_checkpoint, write_failure

try:
    import fcntl
except ImportError:  # Windows: the pid fallback below
    fcntl = None

LOCK_FILE = "run.lock"
PREVIOUS = "previous-"  # overwrite=true moves a previous run's files into previous-<time>/
RESULTS = ("metrics.jsonl", "summary.json", "final")  # with checkpoint-<step>/: what a previous run leaves

_HELD: dict[str, int] = {}  # resolved output_dir -> the open lock file's descriptor, in this process


@contextlib.contextmanager
def claim_output_dir(output_dir: str | os.PathLike, *, resume=None, overwrite: bool = False,
                     warn=print) -> Iterator[None]:
    """Hold `output_dir` for the block: usable (`check_output_dir`), locked, and not another run's results
    unless `resume` asks to continue them (`auto`, or a checkpoint inside it) or `overwrite` moves them aside.
    Re-entrant in one process: a nested claim of a folder already held does nothing."""
    output_dir = Path(output_dir)
    created = not output_dir.exists()
    check_output_dir(output_dir)
    key = str(output_dir.resolve())
    if key in _HELD:
        yield
        return
    try:
        descriptor = _lock(output_dir, warn)
    except BaseException as error:
        _remove_if_empty(output_dir, created)
        if isinstance(error, OSError):  # writing the holder's name into the lock file on a full disk, most often
            raise _unusable(output_dir, f"take {LOCK_FILE}", error) from None
        raise
    _HELD[key] = descriptor
    try:
        try:
            _refuse_previous_run(output_dir, resume, overwrite, warn)
        except OSError as error:  # moving a previous run aside on a full or read-only disk
            raise _unusable(output_dir, "set the previous run aside", error) from None
        yield
    finally:
        del _HELD[key]
        _unlock(descriptor, output_dir / LOCK_FILE)
        _remove_if_empty(output_dir, created)


def _remove_if_empty(output_dir: Path, created: bool) -> None:
    """Remove the folder the claim created when nothing is in it (rmdir: never a folder with files)."""
    if created:
        with contextlib.suppress(OSError):
            output_dir.rmdir()


def _unusable(output_dir: Path, what: str, error: OSError) -> UserError:
    """One sentence for an output folder the run cannot write in (most often: the disk is full)."""
    intact = latest_checkpoint(output_dir)
    kept = f"; its newest intact checkpoint, {intact}, is untouched" if intact else ""
    return UserError(f"could not {what} in output_dir {str(output_dir)!r}: {write_failure(error)}{kept}: free "
                     "space or fix the folder, then run again (resume=auto continues).")


def check_output_dir(output_dir: Path) -> None:
    """One sentence when `output_dir` is an existing file, cannot be created, or is not writable."""
    if output_dir.exists() and not output_dir.is_dir():
        raise UserError(f"output_dir {str(output_dir)!r} is an existing file, not a folder; "
                        "pass a folder path (it is created if missing).")
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        probe = output_dir / f".write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as error:
        if error.errno in (errno.ENOSPC, errno.EDQUOT):
            raise _unusable(output_dir, "write", error) from None
        raise UserError(f"output_dir {str(output_dir)!r} is not writable ({error.strerror or error}); "
                        "pass an output_dir this user can write to.") from None


def previous_run(output_dir: Path) -> list[str]:
    """The names in `output_dir` that a previous run left: its checkpoints, final/, metrics and summary."""
    if not output_dir.is_dir():
        return []
    return sorted(p.name for p in output_dir.iterdir()
                  if p.name in RESULTS or (p.name.startswith("checkpoint-") and p.is_dir()))


def _refuse_previous_run(output_dir: Path, resume, overwrite: bool, warn) -> None:
    found = previous_run(output_dir)
    resume = None if resume is None or str(resume) in ("", "null", "none", "None") else str(resume)
    inside = resume is not None and (resume == "auto" or Path(resume).expanduser().resolve().parent
                                     == output_dir.resolve())
    if overwrite and inside:
        raise UserError(f"overwrite=true moves the files of {str(output_dir)!r} aside, so it cannot also continue "
                        f"them (resume={resume}); drop one of the two.")
    if not found or inside:
        return
    if not overwrite:
        shown = ", ".join(found[:4]) + (", ..." if len(found) > 4 else "")
        raise UserError(f"output_dir {str(output_dir)!r} holds a previous run ({shown}); continue it with "
                        "resume=auto, start afresh with overwrite=true (its files move to "
                        f"{PREVIOUS}<time>/ inside it, nothing is deleted), or pass another output_dir.")
    set_aside_previous_run(output_dir, "overwrite=true", warn)


def set_aside_previous_run(output_dir: Path, why: str, warn=print) -> Path | None:
    """Move everything a previous run left in `output_dir` (its lock aside) into `previous-<time>/` (nothing is
    deleted), saying so after `why`; None when there was nothing to move. The caller holds the folder's lock."""
    output_dir = Path(output_dir)
    if not previous_run(output_dir):
        return None
    aside = output_dir / f"{PREVIOUS}{datetime.now():%Y%m%d-%H%M%S}"
    while aside.exists():
        aside = aside.with_name(aside.name + "-1")
    aside.mkdir()
    moved = [p for p in output_dir.iterdir() if p != aside and p.name != LOCK_FILE and not p.name.startswith(PREVIOUS)]
    for path in moved:
        path.rename(aside / path.name)
    warn(f"{why}: moved the previous run's {len(moved)} files and folders to {aside}")
    return aside


# ---------------------------------------------------------------------------------------------
# the lock
# ---------------------------------------------------------------------------------------------
def _lock(output_dir: Path, warn) -> int:
    path = output_dir / LOCK_FILE
    while True:
        descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            holder = _read_holder(descriptor)
            if not _flock(descriptor):
                raise UserError(f"output_dir {str(output_dir)!r} is in use by another run ({_describe(holder)}); "
                                "wait for it to end, or pass another output_dir.")
        except BaseException:
            os.close(descriptor)
            raise
        if _same_file(descriptor, path):
            break
        os.close(descriptor)  # its holder released it (removed the file) meanwhile: lock the new file
    try:
        if holder and holder.get("pid") != os.getpid():
            warn(f"warning: took over {path} from {_describe(holder)}, which ended without releasing it "
                 "(killed or crashed)")
        os.ftruncate(descriptor, 0)
        os.pwrite(descriptor, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                          "started": time.strftime("%Y-%m-%d %H:%M:%S")}).encode(), 0)
        os.fsync(descriptor)
    except BaseException:
        os.close(descriptor)
        raise
    return descriptor


def _flock(descriptor: int) -> bool:
    """Lock the file; False when another process holds it. Without flock (Windows, some network file
    systems), the holder named in the file counts as holding it while its pid runs on this host."""
    if fcntl is not None:
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return False
        except OSError as error:
            if error.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                raise
    holder = _read_holder(descriptor)
    return not holder or not _alive(holder)


def _alive(holder: dict) -> bool:
    if holder.get("host") != socket.gethostname():
        return True  # cannot be checked from here: a stopped run's lock file is removed by hand
    try:
        os.kill(int(holder.get("pid", 0)), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, ValueError, OSError):
        return True
    return int(holder.get("pid", 0)) > 0


def _read_holder(descriptor: int) -> dict:
    try:
        text = os.pread(descriptor, 4096, 0).decode(errors="replace").strip()
        return json.loads(text) if text else {}
    except (OSError, ValueError):
        return {"pid": "?", "host": "?"}


def _describe(holder: dict) -> str:
    if not holder:
        return "pid unknown"
    since = f", since {holder['started']}" if holder.get("started") else ""
    return f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}{since}"


def _same_file(descriptor: int, path: Path) -> bool:
    """Whether the open lock file is still the one at `path` (not removed by a releasing run meanwhile)."""
    try:
        opened, named = os.fstat(descriptor), os.stat(path)
    except OSError:
        return False
    return (opened.st_dev, opened.st_ino) == (named.st_dev, named.st_ino)


def _unlock(descriptor: int, path: Path) -> None:
    """Release cleanly: the file is removed while still locked (a run waiting on it then locks a new one)."""
    with contextlib.suppress(OSError):
        if _same_file(descriptor, path):
            path.unlink()
        else:
            os.ftruncate(descriptor, 0)
        if fcntl is not None:
            fcntl.flock(descriptor, fcntl.LOCK_UN)
    os.close(descriptor)
