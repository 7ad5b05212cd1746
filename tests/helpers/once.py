"""A fixture's work done once per test run, whichever pytest-xdist worker asks for it first.

A module-scoped fixture runs once per worker that runs one of its tests, and `--dist worksteal` may hand a
module's tests to both workers: a launch of 2 processes would then run twice. With `once`, the first worker
makes the folder and the others wait for it and read it (the pattern of pytest-xdist's docs, "Making
session-scoped fixtures execute only once").
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

from filelock import FileLock


def once(tmp_path_factory, name: str, make: Callable[[Path], None]) -> Path:
    """The folder `name`, filled by `make(folder)` in the first worker that asks; a failed `make` leaves it
    to the next one to try again."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # the run's folder, shared by its workers
    folder = base / f"once-{name}"
    with FileLock(f"{folder}.lock"):
        if not (folder / ".done").exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(parents=True)
            make(folder)
            (folder / ".done").touch()
    return folder
