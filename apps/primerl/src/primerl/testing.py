"""Helpers for tests that run whole primerl processes: finding them, and what they left behind."""

from __future__ import annotations

import os
from pathlib import Path


def processes(*needles: str | Path) -> list[tuple[int, list[str]]]:
    """(pid, argv) of every other process whose command line holds all of `needles`."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        line = " ".join(argv)
        if int(pid) != os.getpid() and all(str(n) in line for n in needles):
            out.append((int(pid), argv))
    return out


def leftovers(*paths: str | Path) -> list[str]:
    """Command lines (cut to 200 characters) of processes still running with any of `paths` on them."""
    return sorted({" ".join(argv)[:200] for p in paths for _, argv in processes(p)})
