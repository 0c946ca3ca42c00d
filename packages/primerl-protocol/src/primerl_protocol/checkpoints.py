"""Where a run's checkpoints are and how to read the newest one's metadata.

The trainer writes `run_dir/checkpoints/step_N/` and, last of all, its `meta.json` (step,
world size, scheduler, `data`: what the data side needs to resume, including the
orchestrator's state). The orchestrator reads the same file on restart, so both resume from
the same step. Only folders whose `meta.json` exists are complete.
"""

from __future__ import annotations

import json
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
