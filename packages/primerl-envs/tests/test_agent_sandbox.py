"""The agent sandbox (primerl_sandbox): a shell and files per rollout in bubblewrap, with the
code sandbox's escapes tried from the shell, its limits at their bounds, and zero orphans."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from primerl_sandbox import Changes, Limits, Workspace, WorkspaceError, reap
from primerl_sandbox.workspace import OWNER_ENV, REGISTRY_ENV, process_id

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="bubblewrap is Linux-only")


@pytest.fixture(autouse=True)
def own_registry(tmp_path, monkeypatch):
    monkeypatch.setenv(REGISTRY_ENV, str(tmp_path / "registry"))
    monkeypatch.delenv(OWNER_ENV, raising=False)


def run(coro):
    return asyncio.run(coro)


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def sandbox_pids(ws: Workspace) -> list[int]:
    """bwrap and every process below it, seen from the host."""
    assert ws.proc is not None
    found, todo = [], [ws.proc.pid]
    while todo:
        pid = todo.pop()
        found.append(pid)
        for task in Path(f"/proc/{pid}/task").glob("*/children"):
            todo += [int(c) for c in task.read_text().split()]
    return found


def test_the_shell_keeps_its_directory_and_variables_and_reports_each_command():
    async def go():
        async with Workspace() as ws:
            first = await ws.run("mkdir -p a/b && cd a/b && export GREETING=hi && echo out && echo err >&2; exit 3")
            second = await ws.run('pwd; echo "$GREETING"')
            return first, second

    first, second = run(go())
    assert (first.stdout, first.stderr, first.exit_code) == ("out\n", "err\n", 3)
    assert second.stdout == "/work/a/b\nhi\n" and second.exit_code == 0


def test_escapes_from_the_shell_are_held(monkeypatch):
    """What the code sandbox's tests try, from a shell that may start processes: the host's
    files, the network, the caller's environment, other processes, writing outside /work."""
    monkeypatch.setenv("PRIMERL_TEST_SECRET", "s3cret")
    project = Path(__file__).resolve().parents[3]

    async def go():
        async with Workspace() as ws:
            return {
                "files": await ws.run(f"ls {project} /root /etc/passwd /home 2>&1; cat /proc/1/environ | tr '\\0' ' '"),
                "env": await ws.run("env; cat /proc/self/environ /proc/*/environ 2>/dev/null | tr '\\0' '\\n'"),
                "net": await ws.run(
                    "python3 -c \"import socket; s=socket.socket(); s.settimeout(2); s.connect(('1.1.1.1', 53))\"; "
                    "cat /proc/net/dev"
                ),
                "procs": await ws.run("ls /proc | grep -E '^[0-9]+$' | wc -l; id -u"),
                "write": await ws.run("touch /usr/x /x /proc/x 2>&1; echo ok > /work/y && cat /work/y"),
                "userns": await ws.run("unshare -U true 2>&1; echo rc=$?"),
            }

    got = run(go())
    assert "No such file" in got["files"].stdout and "s3cret" not in got["files"].stdout
    assert project.name not in got["files"].stdout.replace(str(project), "")
    assert "s3cret" not in got["env"].stdout and "PRIMERL_TEST_SECRET" not in got["env"].stdout
    assert "Network is unreachable" in got["net"].stderr
    assert [line.split(":")[0].strip() for line in got["net"].stdout.splitlines()[2:]] == ["lo"]
    count, uid = got["procs"].stdout.split()
    assert int(count) <= 6 and uid == "65534"  # bwrap's init, the supervisor, this command's few
    assert got["write"].stdout.count("cannot touch") == 3  # read-only /usr and /, no files in /proc
    assert got["write"].stdout.endswith("ok\n")
    assert "rc=0" not in got["userns"].stdout


def test_a_command_past_its_time_is_killed_with_what_it_started_and_the_shell_goes_on():
    async def go():
        async with Workspace(Limits(command_timeout_s=1)) as ws:
            slow = await ws.run("(sleep 60; echo late > /work/late) & sleep 60")
            background = await ws.run("sleep 30 & echo started")
            await asyncio.sleep(0.3)
            after = await ws.run("ls /work; ps -e -o comm= | grep -c sleep")
            return slow, background, after

    slow, background, after = run(go())
    assert slow.timed_out and slow.exit_code == -signal.SIGKILL
    assert background.stdout == "started\n" and not background.timed_out
    assert after.stdout.split() == ["0"]  # no late file, no sleep left from either command


def test_process_limit_is_per_sandbox_and_holds_at_its_bound():
    """nproc = 16: a fork bomb gets fewer than 16 processes; four sandboxes at once each start 8
    (as root the sandbox runs as uid 65534 outside, so that the kernel counts; per sandbox,
    since each has its own user namespace)."""
    bomb = 'python3 -c "import os\nn=0\ntry:\n    while True:\n        os.fork() or os._exit(os.pause() or 0)\n        n+=1\nexcept OSError: print(n)"'

    async def go():
        limits = Limits(nproc=16, command_timeout_s=10)
        async with Workspace(limits) as ws:
            bombed = await ws.run(f"timeout 3 {bomb}")
        spaces = [Workspace(limits) for _ in range(4)]
        try:
            await asyncio.gather(*(w.start() for w in spaces))
            eight = "for i in 1 2 3 4 5 6 7 8; do sleep 2 & done; wait && echo all"
            return bombed, await asyncio.gather(*(w.run(eight) for w in spaces))
        finally:
            await asyncio.gather(*(w.close() for w in spaces))

    bombed, each = run(go())
    assert 0 < int(bombed.stdout) < 16, bombed
    assert [r.stdout for r in each] == ["all\n"] * 4, each


def test_output_memory_and_disk_are_bounded():
    async def go():
        async with Workspace(Limits(output_bytes=1000, disk_mb=8, memory_mb=256)) as ws:
            loud = await ws.run("yes | head -c 100000")
            memory = await ws.run('python3 -c "x = bytearray(512 << 20)"')
            disk = await ws.run("head -c 20000000 /dev/zero > /work/big; echo rc=$?")
            return loud, memory, disk

    loud, memory, disk = run(go())
    assert len(loud.stdout) == 1000 and loud.stdout_bytes == 100000 and loud.truncated
    assert memory.exit_code != 0 and "MemoryError" in memory.stderr
    assert "No space left" in disk.stderr and "rc=1" in disk.stdout


def test_the_episode_limit_ends_the_sandbox_and_later_calls_say_so():
    async def go():
        ws = Workspace(Limits(episode_timeout_s=1))
        await ws.start()
        try:
            await ws.run("echo ok")
            await asyncio.sleep(1.5)
            with pytest.raises(WorkspaceError, match="episode's time limit"):
                await ws.run("echo again")
            return ws.proc.returncode if ws.proc else None
        finally:
            await ws.close()

    assert run(go()) is not None


def test_files_in_and_out_and_changes_against_the_source(tmp_path):
    repo = tmp_path / "repo"
    (repo / "pkg").mkdir(parents=True)
    (repo / "pkg" / "a.py").write_text("A = 1\n")
    (repo / "gone.txt").write_text("bye\n")

    async def go():
        ws = Workspace()
        await ws.start(repo)
        try:
            await ws.write("pkg/a.py", b"A = 2\n")
            await ws.write("new/b.txt", b"\x00\xff")
            await ws.run("rm gone.txt && ln -s pkg/a.py link")
            listing = await ws.listing(".", depth=1)
            with pytest.raises(OSError, match="No such file"):
                await ws.read("missing.txt")
            return listing, await ws.changes(), await ws.read("pkg/a.py")
        finally:
            await ws.close()

    listing, changes, content = run(go())
    assert listing == (["new/", "pkg/", "link"], False)
    assert changes.files == {"pkg/a.py": b"A = 2\n", "new/b.txt": b"\x00\xff"}
    assert changes.symlinks == {"link": "pkg/a.py"} and changes.deleted == ["gone.txt"]
    assert content == b"A = 2\n"
    assert Changes.from_json(json.loads(json.dumps(changes.to_json()))) == changes


@pytest.mark.parametrize(
    "bad, named",
    [
        ([1, 2], "expected an object"),
        ({"files": {"a": 3}}, "changes.files"),
        ({"files": {"a": "not base64!"}}, "not base64"),
        ({"deleted": [1]}, "changes.deleted"),
    ],
)
def test_malformed_changes_are_refused_naming_the_field(bad, named):
    with pytest.raises(ValueError, match=named):
        Changes.from_json(bad)


def test_nothing_is_left_when_the_owner_is_killed_and_the_reaper_clears_dead_runs(tmp_path):
    """Chaos: a process standing in for the orchestrator (it claims the run) opens 16 sandboxes
    with a shell each, each running a command, and is SIGKILLed: every sandbox process dies
    with it (bubblewrap's --die-with-parent, the PID namespace's init). A sandbox whose owner
    died while it lived (its record says so) is killed by the next run's reaper."""
    registry = Path(os.environ[REGISTRY_ENV])
    script = textwrap.dedent(
        """
        import asyncio, sys
        from primerl_sandbox import Workspace, claim_run
        claim_run()
        async def main():
            spaces = [Workspace() for _ in range(16)]
            await asyncio.gather(*(w.start() for w in spaces))
            for w in spaces:
                asyncio.ensure_future(w.run("sleep 600"))
            await asyncio.sleep(1)
            print(" ".join(str(w.proc.pid) for w in spaces), flush=True)
            await asyncio.sleep(600)
        asyncio.run(main())
        """
    )
    owner = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=os.environ)
    try:
        pids = [int(p) for p in owner.stdout.readline().split()]  # type: ignore[union-attr]
        assert len(pids) == 16 and all(alive(p) for p in pids)
        assert len(list(registry.glob("*.json"))) == 16
        children = {
            p: [int(c) for t in Path(f"/proc/{p}/task").glob("*/children") for c in t.read_text().split()] for p in pids
        }
    finally:
        owner.kill()
        owner.wait()
    deadline = time.monotonic() + 10
    every = pids + [c for cs in children.values() for c in cs]
    while any(alive(p) for p in every) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(p) for p in every)
    assert reap() == 0 and not list(registry.glob("*.json"))  # records of the dead run forgotten

    # a sandbox outliving its owner (as if --die-with-parent could not act): the reaper kills it
    os.environ[OWNER_ENV] = "1:0"  # a process that does not exist
    try:

        async def orphan():
            ws = Workspace()
            await ws.start()
            return ws

        async def scenario():
            ws = await orphan()
            pid = ws.proc.pid
            assert alive(pid) and reap() == 1
            await asyncio.sleep(0.5)
            gone = not alive(pid)
            await ws.close()
            return gone

        assert asyncio.run(scenario())
    finally:
        del os.environ[OWNER_ENV]
    assert not list(registry.glob("*.json"))
    assert process_id(os.getpid()) is not None
