"""Run untrusted Python against hidden tests, isolated by the operating system.

A hidden test is data, `HiddenTest(fn, args, expected)`. `run_tests(code, tests)` starts the
runner (primerl_code.runner) in a bubblewrap sandbox (primerl_code.isolation: namespaces, a
read-only file system holding only the interpreter, no network, a seccomp filter that refuses
new processes, rlimits) and sends it the submission and the calls `(fn, args)`, never the
expected values; the runner reads the calls only after the submission has run, and writes one
JSON line per call back on its stdout. The comparison
happens here, in the parent, on plain JSON data, so:

- an object whose `__eq__` always says True is not JSON and fails its test;
- the child never says "passed": a line the submission forges can claim a return value, which
  counts only when it equals the expected value the child never saw;
- each test index counts at most once (its first well-formed line), out-of-range indices and
  garbage are ignored, so `passed <= total` by construction;
- at most OUTPUT_LIMIT bytes are read; past that, or past the time limit, the whole sandbox
  (every process in its PID namespace) is killed, and the calls reported so far count.

bubblewrap is required: without it the first use raises SandboxUnavailable, saying how to
install it. PRIMERL_SANDBOX=unsafe-no-namespaces runs the runner as a plain child process
(rlimits only, no isolation at all) and logs a warning each time; it is for trusted code only.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import math
import os
import re
import shutil
import signal
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from primerl_code import isolation
from primerl_code.isolation import SandboxUnavailable

__all__ = ["HiddenTest", "SandboxResult", "SandboxUnavailable", "require_sandbox", "run_tests", "score"]

log = logging.getLogger(__name__)

OUTPUT_LIMIT = 1 << 20
"""Most bytes read from the child; past that it is killed (what came before still counts)."""
NPROC_LIMIT = 32
"""RLIMIT_NPROC inside (threads count too); process creation is refused by seccomp anyway."""
RESULT_LINE = re.compile(rb'^\{"(?:i|error)": [^\n]*', re.MULTILINE)
"""How the runner's lines start (see primerl_code.runner)."""
UNSAFE = "unsafe-no-namespaces"
"""PRIMERL_SANDBOX's value that runs submissions without isolation."""


@dataclass(frozen=True)
class HiddenTest:
    """One hidden test: `fn(*args)` must equal `expected` (compared as JSON data)."""

    fn: str
    args: list[Any]
    expected: Any


@dataclass
class SandboxResult:
    passed: int
    total: int
    error: str | None = None
    """Why the run ended without all results (the solution failed to run, time, memory or output
    limit, crash), if it did."""

    @property
    def fraction(self) -> float:
        return self.passed / self.total if self.total else 0.0


def sandbox_mode() -> str:
    """ "bwrap" (the default) or UNSAFE, from $PRIMERL_SANDBOX."""
    mode = os.environ.get("PRIMERL_SANDBOX") or "bwrap"
    if mode not in ("bwrap", UNSAFE):
        raise ValueError(f"PRIMERL_SANDBOX={mode!r}: expected 'bwrap' (the default) or {UNSAFE!r}")
    return mode


def require_sandbox() -> None:
    """Raise SandboxUnavailable unless the sandbox works here (or warn that it is switched off)."""
    if sandbox_mode() == UNSAFE:
        log.warning("PRIMERL_SANDBOX=%s: the code environment runs submissions WITHOUT isolation", UNSAFE)
    else:
        isolation.require(isolation.bwrap_path())


@cache
def _runner_source() -> str:
    return Path(__file__).with_name("runner.py").read_text()


async def run_tests(
    code: str,
    tests: Sequence[HiddenTest],
    *,
    time_limit_s: float = 5.0,
    memory_mb: int = 512,
    file_mb: int = 4,
) -> SandboxResult:
    """Run `code`, then call each test's function on its args, in the sandbox; count the passes.

    `time_limit_s` bounds wall-clock time (plus 1 s for start-up) and CPU seconds, `memory_mb`
    the address space, `file_mb` each file written and the whole scratch folder.
    """
    if not all(isinstance(t, HiddenTest) for t in tests):
        raise TypeError("run_tests takes HiddenTest(fn, args, expected) tests (since issue 16, not assert snippets)")
    mode = sandbox_mode()
    if mode == UNSAFE:
        log.warning("PRIMERL_SANDBOX=%s: running a submission WITHOUT isolation", UNSAFE)
    else:
        await asyncio.to_thread(isolation.require, isolation.bwrap_path())
    limits = [memory_mb << 20, max(1, math.ceil(time_limit_s)), file_mb << 20, NPROC_LIMIT]
    command = [isolation.interpreter()[0], "-I", "-S", "-B", "-c", _runner_source(), *map(str, limits)]
    job = (json.dumps(code) + "\n" + json.dumps([[t.fn, list(t.args)] for t in tests]) + "\n").encode()
    start = _start_unsafe if mode == UNSAFE else _start_bwrap
    proc, kill, cleanup = await start(command, file_mb)
    stdin, _ = _pipes(proc)
    try:
        output, limit = await _exchange(proc, job, time_limit_s)
        if limit is not None:
            await kill()
        await proc.wait()
    finally:
        if proc.returncode is None:
            await kill()
        cleanup()
        stdin.close()
    passed, answered, error = score(output, tests)
    if limit is not None:
        error = limit
    elif error is None and answered < len(tests):
        ended = "without a result" if answered == 0 else f"after {answered} of {len(tests)} results"
        error = f"the sandbox ended {ended}: {_how(proc.returncode, mode)}{_bwrap_said(output)}"
    return SandboxResult(passed, len(tests), error)


def score(output: bytes, tests: Sequence[HiddenTest]) -> tuple[int, int, str | None]:
    """(tests passed, tests answered, the solution's error) from the child's output lines.

    Each index in range counts at most once, by its first well-formed line; anything else
    (garbage, duplicates, out-of-range or non-integer indices) is ignored. Only lines that start
    as the runner's do are parsed, and at most 2 * len(tests) + 64 of them, so that a megabyte of
    junk costs milliseconds of this (event-loop) thread: the runner writes len(tests) + 1 at most,
    and the submission's own prints never reach this stream, so the bound only costs a
    submission that writes junk to the result channel on purpose.
    """
    expected = [json.loads(json.dumps(t.expected)) for t in tests]  # as the values travel: a tuple is a list
    seen: set[int] = set()
    passed, error = 0, None
    candidates = (m.group() for m in RESULT_LINE.finditer(output))
    for line in itertools.islice(candidates, 2 * len(tests) + 64):
        if len(seen) == len(tests):
            break
        try:
            msg = json.loads(line)
        except (ValueError, RecursionError):  # RecursionError: a forged line nested too deep
            continue
        if not isinstance(msg, dict):
            continue
        i = msg.get("i")
        if i is None and error is None and isinstance(msg.get("error"), str):
            error = msg["error"][:500]
        if type(i) is not int or not 0 <= i < len(tests) or i in seen:
            continue
        seen.add(i)
        try:
            passed += "v" in msg and msg["v"] == expected[i]
        except RecursionError:
            pass
    return passed, len(seen), error


async def _exchange(proc: asyncio.subprocess.Process, job: bytes, time_limit_s: float) -> tuple[bytes, str | None]:
    """Send `job`, read stdout until EOF: (the output, which limit ended it early or None).

    The wall-clock limit is `time_limit_s` plus 1 s for the sandbox's start-up.
    """

    stdin, stdout = _pipes(proc)

    async def send() -> None:
        try:
            stdin.write(job)
            await stdin.drain()
            stdin.close()
        except (BrokenPipeError, ConnectionResetError):
            pass  # the child ended (or closed stdin) before reading it all

    chunks: list[bytes] = []

    async def receive() -> str | None:
        size = 0
        while chunk := await stdout.read(65536):
            chunks.append(chunk)
            size += len(chunk)
            if size > OUTPUT_LIMIT:
                return f"output limit ({OUTPUT_LIMIT >> 20} MiB) exceeded"
        return None

    sender = asyncio.ensure_future(send())
    try:
        limit = await asyncio.wait_for(receive(), timeout=time_limit_s + 1.0)
    except TimeoutError:
        limit = f"time limit ({time_limit_s:g} s) exceeded"
    finally:
        sender.cancel()
    return b"".join(chunks)[:OUTPUT_LIMIT], limit


async def _start_bwrap(command: list[str], file_mb: int):
    """The sandbox, and how to kill everything in it: its PID namespace's init, whose death
    takes every process of the namespace with it (the kernel's, not a process group's doing)."""
    bwrap = isolation.bwrap_path()
    seccomp = isolation.seccomp_pipe()
    info_read, info_write = os.pipe()
    try:
        argv = isolation.bwrap_argv(bwrap, command, seccomp_fd=seccomp, info_fd=info_write, scratch_mb=file_mb)
        proc = await asyncio.create_subprocess_exec(
            *argv,
            env={},
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            pass_fds=(seccomp, info_write),
        )
    except BaseException:
        os.close(info_read)  # no bwrap: nothing will write its info, nobody will read it
        raise
    finally:
        os.close(seccomp)
        os.close(info_write)
    try:
        init = await asyncio.wait_for(asyncio.to_thread(_pidfd_of_init, info_read, proc.pid), timeout=30)
    except TimeoutError:
        init = None  # bwrap hangs before starting its child; killing bwrap ends the read
    except BaseException:  # cancelled (the rollout was) while bwrap started: it must not run on
        with contextlib.suppress(ProcessLookupError):
            proc.kill()  # --die-with-parent takes its sandbox with it; asyncio's watcher reaps it
        raise

    async def kill() -> None:
        with contextlib.suppress(ProcessLookupError):
            if init is not None:
                signal.pidfd_send_signal(init, signal.SIGKILL)  # bwrap then reaps it and exits
            else:
                proc.kill()  # --die-with-parent takes the namespace with it
        try:
            await asyncio.wait_for(_finish(proc), timeout=10)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await _finish(proc)

    def cleanup() -> None:
        if init is not None:
            os.close(init)

    return proc, kill, cleanup


def _pidfd_of_init(info_read: int, bwrap_pid: int) -> int | None:
    """A pidfd of the sandbox's init, from bwrap's --info-fd (bwrap's own, which the child
    never holds); None if bwrap ended without writing it or the child is gone already."""
    with os.fdopen(info_read, "rb") as info:
        data = info.read(4096)
    try:
        pid = int(json.loads(data)["child-pid"])
        pidfd = os.pidfd_open(pid)
    except (ValueError, KeyError, TypeError, OSError):
        return None
    try:  # still bwrap's child, so `pid` was not reused before pidfd_open
        ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        ppid = None
    if ppid != bwrap_pid:
        os.close(pidfd)
        return None
    return pidfd


async def _start_unsafe(command: list[str], file_mb: int):
    """The runner as a plain child in a temporary folder: rlimits, nothing else."""
    folder = tempfile.mkdtemp(prefix="primerl-unsafe-sandbox-")
    try:
        proc = await asyncio.create_subprocess_exec(
            *command,
            cwd=folder,
            env={},
            start_new_session=True,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)  # no child: the caller gets no cleanup to call
        raise

    async def kill() -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        await _finish(proc)

    return proc, kill, lambda: shutil.rmtree(folder, ignore_errors=True)


async def _finish(proc: asyncio.subprocess.Process) -> None:
    """Wait for a killed child: read its stdout to EOF (what the dead wrote is at most a pipe's
    worth), without which asyncio's wait() never returns once reading has stopped."""
    _, stdout = _pipes(proc)
    while await stdout.read(1 << 16):
        pass
    await proc.wait()


def _pipes(proc: asyncio.subprocess.Process) -> tuple[asyncio.StreamWriter, asyncio.StreamReader]:
    """The child's stdin and stdout (both piped by _start_unsafe and _start_bwrap)."""
    assert proc.stdin is not None and proc.stdout is not None, (
        "the sandbox's child is started with stdin and stdout piped"
    )
    return proc.stdin, proc.stdout


def _how(returncode: int | None, mode: str) -> str:
    """A child's exit status in words; bwrap exits with 128 + N when its child died of signal N."""
    sig = -returncode if returncode is not None and returncode < 0 else None
    if mode != UNSAFE and returncode is not None and returncode > 128:
        sig = returncode - 128
    if sig is None:
        return f"exit code {returncode}"
    known: dict[int, str] = {
        signal.SIGXCPU: "CPU time limit",
        signal.SIGXFSZ: "file size limit",
        signal.SIGKILL: "killed",
    }
    try:
        name = known.get(sig, signal.Signals(sig).name)
    except ValueError:
        name = "signal"
    return f"{name} (signal {sig})"


def _bwrap_said(output: bytes) -> str:
    lines = [line for line in output.decode(errors="replace").splitlines() if line.startswith("bwrap:")]
    return f"; {lines[0][:300]}" if lines else ""
