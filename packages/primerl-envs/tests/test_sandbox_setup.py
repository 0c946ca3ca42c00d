"""The code sandbox's set-up and scoring: a missing or weaker bubblewrap is refused, the opt-out
warns, and the parent's scoring of the child's lines counts each test at most once."""

import asyncio
import logging
import os
import tempfile

import pytest
from primerl_code import CodeConfig, CodeData, CodeTaskset, isolation
from primerl_code.sandbox import (
    UNSAFE,
    HiddenTest,
    SandboxUnavailable,
    _start_unsafe,
    require_sandbox,
    run_tests,
    score,
)

TESTS = [HiddenTest("add", [2, 3], 5), HiddenTest("add", [-1, 1], 0), HiddenTest("add", [0, 0], 0)]
ADD = "def add(a, b):\n    return a + b\n"


def fake_bwrap(tmp_path, name: str, body: str) -> str:
    path = tmp_path / name
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return str(path)


def test_a_missing_bubblewrap_is_refused_saying_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setenv("PRIMERL_BWRAP", str(tmp_path / "no-such-bwrap"))
    with pytest.raises(SandboxUnavailable, match="apt-get install bubblewrap") as e:
        asyncio.run(run_tests(ADD, TESTS))
    assert "no-such-bwrap" in str(e.value) and "user namespaces" in str(e.value)
    with pytest.raises(SandboxUnavailable, match="apt-get install bubblewrap"):
        list(CodeTaskset(CodeConfig(num_tasks=2)))  # the taskset refuses to load


def test_a_bubblewrap_without_namespaces_is_refused(tmp_path, monkeypatch):
    said = "bwrap: No permissions to create new namespace, likely because the kernel does not allow"
    monkeypatch.setenv("PRIMERL_BWRAP", fake_bwrap(tmp_path, "bwrap", f"echo '{said}' >&2\nexit 1\n"))
    with pytest.raises(SandboxUnavailable, match="unprivileged user namespaces") as e:
        require_sandbox()
    assert said in str(e.value)


def test_a_bwrap_that_isolates_nothing_is_refused(tmp_path, monkeypatch):
    # runs the command as it is: the probe's child can fork, so this is no sandbox
    passthrough = 'while [ "$1" != "--" ]; do shift; done\nshift\nexec "$@"\n'
    monkeypatch.setenv("PRIMERL_BWRAP", fake_bwrap(tmp_path, "bwrap", passthrough))
    with pytest.raises(SandboxUnavailable, match="could not start the code sandbox"):
        asyncio.run(run_tests(ADD, TESTS))


def test_the_opt_out_warns_every_time(monkeypatch, caplog):
    monkeypatch.setenv("PRIMERL_SANDBOX", UNSAFE)
    monkeypatch.setenv("PRIMERL_BWRAP", "/nonexistent/bwrap")  # not needed without namespaces
    with caplog.at_level(logging.WARNING, logger="primerl_code.sandbox"):
        require_sandbox()
        assert asyncio.run(run_tests(ADD, TESTS)).passed == 3
        assert asyncio.run(run_tests("def add(a, b):\n    return a * b\n", TESTS)).passed == 1
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "WITHOUT isolation" in r.message]
    assert len(warnings) == 3
    monkeypatch.setenv("PRIMERL_SANDBOX", "weaker-please")
    with pytest.raises(ValueError, match="PRIMERL_SANDBOX"):
        require_sandbox()


def test_failed_bwrap_spawns_leave_no_descriptor_open(tmp_path, monkeypatch):
    # a bwrap that passes the probe and is then gone: every spawn fails
    bwrap = tmp_path / "bwrap"
    bwrap.symlink_to(isolation.bwrap_path())
    monkeypatch.setenv("PRIMERL_BWRAP", str(bwrap))
    require_sandbox()
    bwrap.unlink()

    async def main() -> tuple[int, int]:
        with pytest.raises(FileNotFoundError):
            await run_tests(ADD, TESTS)  # the first one may set up the loop's own machinery
        before = len(os.listdir("/proc/self/fd"))
        for _ in range(50):
            with pytest.raises(FileNotFoundError):
                await run_tests(ADD, TESTS)
        return before, len(os.listdir("/proc/self/fd"))

    before, after = asyncio.run(main())
    assert after == before


def test_a_rollout_cancelled_while_bwrap_starts_leaves_nothing_running(tmp_path, monkeypatch):
    """Cancelled while waiting for bwrap to say its child's pid (a bwrap slow to start: this
    one sleeps 2 s first), run_tests leaves no bwrap behind."""
    pids = tmp_path / "pids"
    monkeypatch.setenv(
        "PRIMERL_BWRAP",
        fake_bwrap(
            tmp_path,
            "bwrap",
            (f'[ -e {tmp_path}/probed ] && echo $$ >> {pids} && sleep 2\nexec {isolation.bwrap_path()} "$@"\n'),
        ),
    )
    require_sandbox()  # the probe, once, without the delay
    (tmp_path / "probed").touch()

    async def main() -> int:
        task = asyncio.create_task(run_tests(ADD, TESTS))
        while not pids.exists():
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.2)  # inside the wait for bwrap's info
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.5)  # the loop's child watcher reaps what was killed
        return int(pids.read_text().split()[0])

    pid = asyncio.run(main())
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        state = "gone"
    assert state in ("gone", "Z"), f"the cancelled rollout's bwrap {pid} is still running ({state})"


def test_a_failed_unsafe_spawn_leaves_no_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where mkdtemp makes the scratch folder
    with pytest.raises(FileNotFoundError):
        asyncio.run(_start_unsafe([str(tmp_path / "no-such-python")], file_mb=1))
    assert list(tmp_path.iterdir()) == []


def test_old_style_assert_tests_are_refused():
    with pytest.raises(TypeError, match="HiddenTest"):
        asyncio.run(run_tests(ADD, ["assert add(2, 3) == 5"]))


def test_scoring_counts_each_index_once_by_its_first_line():
    lines = b"\n".join(
        [
            b"garbage",
            b"",
            b'{"error": "the solution failed to run: X"}',
            b'["i", 0]',
            b'{"i": 0, "v": 5}',
            b'{"i": 0, "v": 5}',  # a duplicate counts once
            b'{"i": 1, "v": 7}',
            b'{"i": 1, "v": 0}',  # the first line for an index decides
            b'{"i": 2, "error": "TypeError: no"}',
            b'{"i": 2, "v": 0}',
            b'{"i": 3, "v": 0}',
            b'{"i": -1, "v": 0}',
            b'{"i": true, "v": 0}',
            b'{"i": 1.0, "v": 0}',
            b'{"error": "a second error"}',
        ]
    )
    assert score(lines, TESTS) == (1, 3, "the solution failed to run: X")
    assert score(b'{"i": 0, "v": 5}\n' * 1000, TESTS) == (1, 1, None)
    assert score(b"[" * 100_000 + b"\n" + b'{"i": 0, "v": ' + b"[" * 100_000 + b"\n", TESTS) == (0, 0, None)
    assert score(b"", TESTS) == (0, 0, None)
    # expected values compare as JSON data: a list where a tuple is expected
    assert score(b'{"i": 0, "v": [1, 2]}', [HiddenTest("pair", [1], (1, 2))])[0] == 1


def test_hidden_tests_travel_as_data():
    data = CodeData(id="x", prompt="p", tests=[{"fn": "add", "args": [1, 2], "expected": 3}])
    assert data.tests == [HiddenTest("add", [1, 2], 3)]
    assert CodeData.model_validate_json(data.model_dump_json()).tests == data.tests
