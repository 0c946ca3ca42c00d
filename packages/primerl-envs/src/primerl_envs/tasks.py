"""Task data shared by the built-in environments."""

from __future__ import annotations

import json
from pathlib import Path

import verifiers.v1 as vf


class AnswerData(vf.TaskData):
    """A task with one reference answer."""

    answer: str
    """The reference answer the reward compares the reply with."""


def read_jsonl(path: Path, data: type[vf.TaskData], what: str, relative: tuple[str, ...] = ()) -> list[dict]:
    """The rows of a JSONL file of tasks, each validated as `data` (a bad line raises ValueError
    naming the file, the line and what was wrong; a file without rows too). The fields named in
    `relative` hold paths: relative ones are taken from the file's folder."""
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            data.model_validate(row)
        except Exception as e:  # noqa: BLE001 - a JSON or field error: named with its line
            raise ValueError(f"{path}:{n}: not {what} ({e})") from None
        for key in relative:
            if row.get(key) and not Path(row[key]).is_absolute():
                row[key] = str(path.parent / row[key])
        rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no {what}s")
    return rows
