"""The terminal taskset: each generated kind's reference passes its check in a fresh workspace
and the untouched workspace does not; tasks load from JSONL and bad lines are named."""

from __future__ import annotations

import asyncio
import json
import sys

import pytest
from primerl_sandbox import Limits, Workspace
from primerl_sandbox.workspace import REGISTRY_ENV
from primerl_terminal import TerminalData, check, read_tasks
from primerl_terminal.generated import write_tasks

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="bubblewrap is Linux-only")


@pytest.fixture(autouse=True)
def own_registry(tmp_path, monkeypatch):
    monkeypatch.setenv(REGISTRY_ENV, str(tmp_path / "registry"))


def checks(data: TerminalData, command: str | None) -> bool:
    async def go():
        changes = None
        if command is not None:
            ws = Workspace()
            await ws.start(data.workspace)
            try:
                done = await ws.run(command)
                assert done.exit_code == 0, done
                changes = await ws.changes()
            finally:
                await ws.close()
        return await check(data, changes, Limits())

    return asyncio.run(go())


def test_each_kind_passes_with_its_reference_and_fails_untouched_or_half_done(tmp_path):
    tasks = [TerminalData(**row) for row in write_tasks(str(tmp_path), 5, seed=3)]
    assert len({t.instruction for t in tasks}) == 5
    for data in tasks:
        assert data.reference and checks(data, data.reference), data.id
        assert not checks(data, None), data.id
    count = tasks[0]
    assert not checks(count, "wc -l < data.txt > count.txt && echo 1 >> data.txt && wc -l < data.txt > count.txt")


def test_tasks_load_from_jsonl_and_bad_lines_are_named(tmp_path):
    (tmp_path / "ws").mkdir()
    (tmp_path / "ws" / "a.txt").write_text("x\n")
    row = {"instruction": "copy a.txt to b.txt", "check": "cmp a.txt b.txt", "workspace": "ws"}
    good = tmp_path / "tasks.jsonl"
    good.write_text(json.dumps(row) + "\n")
    (loaded,) = read_tasks(good)
    data = TerminalData(**loaded)
    assert data.workspace == str(tmp_path / "ws") and checks(data, "cp a.txt b.txt") and not checks(data, None)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(row) + "\n" + json.dumps({"instruction": "no check"}) + "\n")
    with pytest.raises(ValueError, match=r"(?s)bad.jsonl:2: .*check"):
        read_tasks(bad)
