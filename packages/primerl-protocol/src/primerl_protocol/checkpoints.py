"""Where a run's checkpoints are and how to read the newest one's metadata.

The trainer writes `run_dir/checkpoints/step_N/` and, last of all, its `meta.json` (step,
world size, scheduler, `data`: what the data side needs to resume, including the
orchestrator's state). The orchestrator reads the same file on restart, so both resume from
the same step. Only folders whose `meta.json` exists are complete.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

CHECKPOINTS = "checkpoints"
META = "meta.json"


def checkpoint_dirs(run_dir: str | Path) -> list[Path]:
    """Complete checkpoint folders of a run, oldest first."""
    root = Path(run_dir) / CHECKPOINTS
    done = [p for p in root.glob("step_*") if p.name[5:].isdigit() and (p / META).exists()]
    return sorted(done, key=lambda p: int(p.name[5:]))


def latest_checkpoint(run_dir: str | Path) -> tuple[Path, dict] | None:
    """(folder, meta.json contents) of the newest complete checkpoint, or None."""
    dirs = checkpoint_dirs(run_dir)
    if not dirs:
        return None
    path = dirs[-1]
    try:
        return path, json.loads((path / META).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"checkpoint {path} has an unreadable {META}: {err}") from None


def durable_rename(tmp: str | Path, final: str | Path) -> None:
    """Rename the finished folder `tmp` to `final` so that a crash (or a power cut) leaves
    either the old state or all of the new: every file and folder inside is fsynced before the
    rename, and the parent after it. Without it the rename can reach the disk before the
    files' data, and `final` is "complete" with empty files in it."""
    tmp, final = Path(tmp), Path(final)
    for folder, _, files in os.walk(tmp):
        for name in files:
            _fsync(Path(folder) / name, os.O_RDONLY)
        _fsync(Path(folder), os.O_RDONLY | os.O_DIRECTORY)
    tmp.rename(final)
    _fsync(final.parent, os.O_RDONLY | os.O_DIRECTORY)


def _fsync(path: Path, flags: int) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
