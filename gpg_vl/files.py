"""Files written whole: what every stage that writes to the output folder shares (train/ for summaries, configs
and checkpoints, observe/ for the rollout log), so that no stage imports another for it."""

from __future__ import annotations

import os
from pathlib import Path

PARTIAL = ".partial"  # the suffix of a file or folder being written; renamed into place when whole


def write_atomic(path: Path, data: str | bytes) -> None:
    """Replace `path` with `data` whole: a failed write (a full disk) leaves the previous file, never a cut one."""
    partial = path.with_name(path.name + PARTIAL)
    try:
        partial.write_bytes(data) if isinstance(data, bytes) else partial.write_text(data)
        os.replace(partial, path)
    except OSError:
        partial.unlink(missing_ok=True)
        raise
