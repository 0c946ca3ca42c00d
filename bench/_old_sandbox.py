# The code sandbox as it was before issue 16 (python -I -S, rlimits and an audit hook), kept only so
# that bench/sandbox.py can measure the new one against it; nothing else uses it, and an outside
# review broke it (issue 16). A verbatim copy of packages/primerl-envs/src/primerl_code/sandbox.py
# at commit 6ad343e.
"""Run untrusted Python against hidden tests in a child process with time, memory and file limits.

The child is `python -I -S` (no site-packages, no PYTHON* variables) in a fresh temporary
folder with an empty environment, in its own session, under rlimits (address space, CPU
seconds, size of files it writes, open files) and a wall-clock limit after which its whole
process group is killed. Before the submission runs, an audit hook refuses: opening any path
outside the sandbox folder (the standard library may be read), listing or changing such
folders, starting processes, sockets, loading native libraries (ctypes), and signalling other
processes. The hidden tests arrive on stdin and are read before the submission runs, so it
cannot read them; the result goes to a file outside the sandbox, written through a descriptor
opened before the hook.

This is a guard against mistakes and casual escapes in a training loop (a model writing an
infinite loop, deleting files, reading secrets), not a security boundary against a determined
attacker: for that run the environment in verifiers' container runtimes.
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import shutil
import signal
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

RESULT_MARKER = "__PRIMERL_SANDBOX_RESULT__"

# The child: reads {"code", "tests"} from stdin, locks itself down, runs the code and each test.
RUNNER = r"""
import json, os, sys
def main():
    job = json.loads(sys.stdin.read())
    out = os.fdopen(int(sys.argv[1]), "w")
    run(job["code"], job["tests"], out)

box = os.path.realpath(os.getcwd())
stdlib = [os.path.realpath(p) for p in {sys.base_prefix, sys.prefix, sys.exec_prefix} if p]
DENY = {"subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork",
        "os.forkpty", "pty.spawn", "socket.__new__", "socket.connect", "socket.bind",
        "socket.getaddrinfo", "ctypes.dlopen", "ctypes.dlsym", "os.kill", "os.killpg",
        "signal.pthread_kill", "os.putenv", "os.unsetenv", "os.chroot", "os.link", "os.symlink",
        "sys._current_frames", "sys._current_exceptions", "gc.get_objects",
        "gc.get_referrers", "gc.get_referents", "object.__getattr__"}
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
PATH_EVENTS = {"os.listdir", "os.scandir", "os.chdir", "os.remove", "os.rename", "os.rmdir",
               "os.mkdir", "os.chmod", "os.chown", "os.truncate", "os.utime", "shutil.rmtree",
               "shutil.copyfile", "shutil.move", "os.walk", "glob.glob", "os.startfile"}
def inside(path, roots):
    try:
        p = os.path.realpath(os.fsdecode(path) if not isinstance(path, int) else ".")
    except Exception:
        return False
    return any(p == r or p.startswith(r + os.sep) for r in roots)
def hook(event, args):
    if event in DENY:
        raise PermissionError(f"sandbox: {event} is not allowed")
    if event == "open":
        path, mode, flags = args[0], args[1], args[2] if len(args) > 2 else 0
        if isinstance(path, int):
            return
        writes = any(c in str(mode or "") for c in "wax+") or bool((flags or 0) & WRITE_FLAGS)
        if inside(path, [box]) or (not writes and inside(path, stdlib)):
            return
        raise PermissionError(f"sandbox: opening {path!r} is not allowed")
    if event in PATH_EVENTS and args:
        for path in args[:2]:
            if isinstance(path, (str, bytes, os.PathLike)) and not inside(path, [box]):
                raise PermissionError(f"sandbox: {event} on {path!r} is not allowed")
import io
class Capped(io.StringIO):
    def write(self, s):
        return super().write(s) if self.tell() < 65536 else len(s)
def run(code, tests, out):
    sys.stdout = sys.stderr = Capped()
    compiled = [compile(t, "test", "exec") for t in tests]
    del tests
    sys.addaudithook(hook)
    namespace = {"__name__": "solution", "__builtins__": __builtins__}
    passed, error = 0, None
    try:
        exec(compile(code, "solution.py", "exec"), namespace)
    except BaseException as e:
        error = f"the solution failed to run: {type(e).__name__}: {e}"
    else:
        for test in compiled:
            try:
                exec(test, dict(namespace))
                passed += 1
            except BaseException:
                pass
    out.write("\n" + MARKER + json.dumps({"passed": passed, "total": len(compiled), "error": error}) + "\n")
    out.flush()
    os._exit(0)
main()
"""


@dataclass
class SandboxResult:
    passed: int
    total: int
    error: str | None = None
    """Why the run ended without results (time or memory limit, crash), if it did."""

    @property
    def fraction(self) -> float:
        return self.passed / self.total if self.total else 0.0


def _limits(memory_mb: int, cpu_s: int, file_mb: int) -> None:
    """preexec_fn: the child's resource limits (runs in the child before exec)."""
    resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
    resource.setrlimit(resource.RLIMIT_FSIZE, (file_mb << 20, file_mb << 20))
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


async def run_tests(
    code: str,
    tests: list[str],
    *,
    time_limit_s: float = 5.0,
    memory_mb: int = 512,
    file_mb: int = 4,
) -> SandboxResult:
    """Run `code` then each hidden test (a snippet of asserts) in a sandboxed child."""
    outside = Path(tempfile.mkdtemp(prefix="primerl-sandbox-"))
    box = outside / "box"
    box.mkdir()
    result_path = outside / "result"
    runner = RUNNER.replace("MARKER", repr(RESULT_MARKER))
    proc = None
    try:
        with open(result_path, "wb") as result_file:
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-I",
                "-S",
                "-c",
                runner,
                str(result_file.fileno()),
                cwd=box,
                env={"PATH": "/usr/bin:/bin", "PYTHONHASHSEED": "0"},
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.DEVNULL,
                pass_fds=(result_file.fileno(),),
                start_new_session=True,
                preexec_fn=lambda: _limits(memory_mb, max(1, int(time_limit_s + 0.999)), file_mb),
            )
        job = json.dumps({"code": code, "tests": tests}).encode()
        try:
            await asyncio.wait_for(proc.communicate(job), timeout=time_limit_s + 1.0)
        except TimeoutError:
            _kill_group(proc.pid)
            await proc.wait()
            return SandboxResult(0, len(tests), f"time limit ({time_limit_s:g} s) exceeded")
        _kill_group(proc.pid)  # anything the solution left behind in its session
        text = result_path.read_text(errors="replace")
        marker = text.rfind(RESULT_MARKER)
        if marker < 0:
            return SandboxResult(0, len(tests), f"the sandbox ended without a result: {_how(proc.returncode)}")
        data = json.loads(text[marker + len(RESULT_MARKER) :].splitlines()[0])
        error = data.get("error")
        return SandboxResult(int(data["passed"]), int(data["total"]), error)
    finally:
        if proc is not None and proc.returncode is None:
            _kill_group(proc.pid)
        shutil.rmtree(outside, ignore_errors=True)


def _how(returncode: int | None) -> str:
    if returncode is None or returncode >= 0:
        return f"exit code {returncode}"
    sig = -returncode
    known = {signal.SIGXCPU: "CPU time limit", signal.SIGXFSZ: "file size limit", signal.SIGKILL: "killed"}
    return f"{known.get(sig, signal.Signals(sig).name)} (signal {sig})"


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
