"""Generated task data on disk: written once, whole, and shared by the runs that use it.

The built-in tasksets that need files (search's corpus, swe's repositories, terminal's
workspaces) generate them from a seed and write them here. A run reads them while it trains,
and so may another run of the same settings on the node (and one run loads its tasksets twice:
in the launcher and in the orchestrator), so a write never touches a folder in use: the files
go to a fresh sibling folder, a marker holding their digest is written last, and the folder is
renamed into place (atomic: a reader sees no folder or a whole one). A folder whose marker
matches is reused as it is. One that holds other data of ours (other settings, an older
generator) is replaced; a folder with files that are not ours is refused, never deleted.
Writers of one folder take turns by a lock file beside it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

MARKER = ".primerl-complete"
"""Written last into a generated folder: the digest of its files."""


def default_folder(kind: str, seed: int, count: int) -> Path:
    """`<temp>/primerl-<kind>-<seed>-<count>-uid<uid>`: a folder per user (two users of a node
    never share one) and per settings (two runs of one user share it only when it holds the
    same files)."""
    return Path(tempfile.gettempdir()) / f"primerl-{kind}-{seed}-{count}-uid{os.getuid()}"


def digest(files: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()


def _marker(root: Path) -> str | None:
    try:
        return (root / MARKER).read_text()
    except (FileNotFoundError, NotADirectoryError):
        return None


@contextlib.contextmanager
def _locked(root: Path) -> Iterator[None]:
    with open(root.with_name(f".{root.name}.lock"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes
        yield


def write_folder(root: Path, files: dict[str, str]) -> None:
    """`root` holding exactly `files` (relative path -> text), written as the module says:
    reused when its marker matches, else written whole into a sibling and renamed into place.
    ValueError when `root` is a file or a folder with files not written here."""
    want = digest(files)
    root.parent.mkdir(parents=True, exist_ok=True)
    with _locked(root):
        have = _marker(root)
        if have == want:
            return
        if root.exists() and have is None and (not root.is_dir() or any(root.iterdir())):
            raise ValueError(f"{root}: not a folder of generated data (no {MARKER}); name a new or empty folder")
        token = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        staging = root.with_name(f".{root.name}.{token}.tmp")
        old = root.with_name(f".{root.name}.{token}.old")
        try:
            staging.mkdir()
            for rel, text in files.items():
                path = staging / rel
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text)
            (staging / MARKER).write_text(want)
            if have is not None:  # our data of other settings: moved aside, deleted once replaced
                root.rename(old)
            staging.rename(root)  # atomic; replaces an empty folder too
        finally:
            shutil.rmtree(staging, ignore_errors=True)
            shutil.rmtree(old, ignore_errors=True)
