"""A workspace per rollout: an agent's shell and files in the code sandbox's isolation.

`Workspace` starts one bubblewrap sandbox (primerl_code.isolation's namespaces: no network
unless asked, uid 65534, no further user namespaces, killed with its parent) whose one
process is primerl_sandbox.supervisor. What the sandbox sees:

  /usr, /bin, /lib*    read-only, as on the host (the shell, coreutils, python3, git), and of
                       /etc only the alternatives' symlinks and the linker's cache
  /work                the workspace: a tmpfs of `disk_mb` MiB, the repository copied in
  /tmp                 a tmpfs of `disk_mb` MiB
  /proc, /dev          the sandbox's own

and not /etc, /root, /home, the project or any other process. Limits: each command gets its
wall-clock bound (`command_timeout_s`, its whole process group killed) and the rlimits of
`Limits` (CPU seconds, address space and file size per process); the sandbox holds at most
`nproc` processes (RLIMIT_NPROC, counted per sandbox: each has its own user namespace) and
lives at most `episode_timeout_s`. RLIMIT_NPROC does not hold for processes whose user is
root outside, so when primerl runs as root the sandbox starts as uid 65534 outside too
(`setpriv`); the kernel then enforces it.

Zero orphans: the sandbox's processes die with bubblewrap (--die-with-parent, and the PID
namespace's init takes every process of it along), bubblewrap with the process that started it
(the same flag), and every sandbox is recorded in a registry folder
(`$PRIMERL_SANDBOX_REGISTRY`, default /tmp/primerl-sandboxes-UID) with the run that owns it
(`$PRIMERL_SANDBOX_OWNER`, set by `claim_run`: the orchestrator's process, else the process
that started it). `reap()` kills what a dead run left and forgets it; the first workspace of
each process, and `claim_run`, reap.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import io
import itertools
import json
import logging
import os
import shutil
import signal
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

from primerl_code import isolation
from primerl_code.isolation import SandboxUnavailable

__all__ = [
    "Changes",
    "CommandResult",
    "Limits",
    "SandboxUnavailable",
    "Workspace",
    "WorkspaceError",
    "claim_run",
    "reap",
]

log = logging.getLogger(__name__)

OWNER_ENV = "PRIMERL_SANDBOX_OWNER"
REGISTRY_ENV = "PRIMERL_SANDBOX_REGISTRY"
NOBODY = 65534
MAX_SOURCE_BYTES = 256 << 20
"""Largest repository (as a tar) copied into a workspace."""


@dataclass(frozen=True)
class Limits:
    """What one workspace may use."""

    command_timeout_s: float = 60.0
    """Wall clock of one command (its process group is killed at the bound)."""
    episode_timeout_s: float = 1800.0
    """Wall clock of the whole workspace: past it the sandbox is killed."""
    cpu_s: int = 120
    """CPU seconds per process."""
    memory_mb: int = 2048
    """Address space per process."""
    disk_mb: int = 512
    """Size of /work and of /tmp (each a tmpfs)."""
    file_mb: int = 256
    """Largest file a process may write."""
    nproc: int = 64
    """Processes (and threads) in the sandbox at once."""
    output_bytes: int = 16384
    """Bytes of stdout and of stderr a command returns; the rest is counted, not kept."""
    network: bool = False
    """Share the host's network (off: the sandbox has only its own loopback)."""

    def for_supervisor(self) -> dict:
        return {
            "memory_bytes": self.memory_mb << 20,
            "cpu_s": self.cpu_s,
            "file_bytes": self.file_mb << 20,
            "nproc": self.nproc,
        }


class WorkspaceError(RuntimeError):
    """The workspace cannot serve (the sandbox ended, a limit ended it, it answered nonsense)."""


@dataclass(frozen=True)
class CommandResult:
    stdout: str
    stderr: str
    exit_code: int
    timed_out: bool = False
    stdout_bytes: int = 0
    """Bytes the command wrote to stdout (beyond `stdout` when truncated)."""
    stderr_bytes: int = 0

    @property
    def truncated(self) -> bool:
        return self.stdout_bytes > len(self.stdout.encode()) or self.stderr_bytes > len(self.stderr.encode())


@dataclass
class Changes:
    """What an episode changed in /work against the copied-in source: new or changed files
    (path -> bytes), symbolic links (path -> target) and deleted paths."""

    files: dict[str, bytes] = field(default_factory=dict)
    symlinks: dict[str, str] = field(default_factory=dict)
    deleted: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.files or self.symlinks or self.deleted)

    def to_json(self) -> dict:
        files = {p: base64.b64encode(d).decode() for p, d in self.files.items()}
        return {"files": files, "symlinks": dict(self.symlinks), "deleted": list(self.deleted)}

    @classmethod
    def from_json(cls, data: dict) -> Changes:
        """From `to_json`'s form, checked: anything else raises ValueError naming what."""
        if not isinstance(data, dict):
            raise ValueError(f"changes: expected an object, got {type(data).__name__}")
        files, links, deleted = data.get("files", {}), data.get("symlinks", {}), data.get("deleted", [])
        if not (isinstance(files, dict) and isinstance(links, dict) and isinstance(deleted, list)):
            raise ValueError("changes: files and symlinks must be objects, deleted a list")
        for name, part in (("files", files), ("symlinks", links)):
            if not all(isinstance(k, str) and isinstance(v, str) for k, v in part.items()):
                raise ValueError(f"changes.{name}: every path and value must be a string")
        if not all(isinstance(p, str) for p in deleted):
            raise ValueError("changes.deleted: every path must be a string")
        try:
            decoded = {p: base64.b64decode(d, validate=True) for p, d in files.items()}
        except ValueError as e:
            raise ValueError(f"changes.files: not base64 ({e})") from None
        return cls(decoded, dict(links), list(deleted))

    def without(self, paths: set[str]) -> Changes:
        """These changes, less any to `paths` (files the hidden tests own)."""
        keep = {p: d for p, d in self.files.items() if p not in paths}
        links = {p: t for p, t in self.symlinks.items() if p not in paths}
        return Changes(keep, links, [p for p in self.deleted if p not in paths])


def registry() -> Path:
    return Path(os.environ.get(REGISTRY_ENV) or f"/tmp/primerl-sandboxes-{os.getuid()}")


def process_id(pid: int) -> str | None:
    """`pid:start time` (in clock ticks since boot), which names one process even after its
    PID is reused; None when no such process runs (a zombie has ended)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return None if fields[0] in ("Z", "X") else f"{pid}:{fields[19]}"
    except (OSError, IndexError):
        return None


def _alive(pid_id: str) -> bool:
    try:
        pid = int(pid_id.split(":")[0])
    except ValueError:
        return False
    return process_id(pid) == pid_id


def claim_run() -> int:
    """This process owns the sandboxes it and its children start (the orchestrator calls this
    first); kills what dead runs left. Returns how many sandboxes it killed."""
    me = process_id(os.getpid())
    if me is not None:
        os.environ[OWNER_ENV] = me
    return reap()


def reap() -> int:
    """Kill every recorded sandbox whose owning run has ended and forget it; forget records of
    sandboxes that are gone. Returns how many it killed."""
    folder = registry()
    killed = 0
    if not folder.is_dir():
        return 0
    for record in folder.glob("*.json"):
        try:
            entry = json.loads(record.read_text())
            owner, sandbox = str(entry["owner"]), str(entry["sandbox"])
        except (OSError, ValueError, KeyError, TypeError):
            record.unlink(missing_ok=True)
            continue
        if _alive(owner) and _alive(sandbox):
            continue
        if _alive(sandbox):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(int(sandbox.split(":")[0]), signal.SIGKILL)
                killed += 1
        record.unlink(missing_ok=True)
    return killed


@functools.cache
def _reaped_once() -> int:
    return reap()


@functools.cache
def _supervisor_source() -> str:
    return Path(__file__).with_name("supervisor.py").read_text()


def _python() -> tuple[str, list[str]]:
    """The interpreter the supervisor runs on, and what to bind for it beyond /usr."""
    for folder in ("/usr/local/bin", "/usr/bin", "/bin"):
        path = os.path.join(folder, "python3")
        if os.access(path, os.X_OK):
            return path, []
    if os.geteuid() == 0:
        raise SandboxUnavailable(
            "the agent sandbox runs as uid 65534 when primerl runs as root and needs a python3 that uid can "
            "run under /usr (apt-get install python3-minimal)"
        )
    exe, binds, _ = isolation.interpreter()
    return exe, binds


def _argv(limits: Limits, seccomp_fd: int) -> list[str]:
    bwrap = isolation.bwrap_path()
    prefix: list[str] = []
    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            raise SandboxUnavailable("the agent sandbox drops root through setpriv (util-linux), not found on PATH")
        prefix = [setpriv, f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
    python, python_binds = _python()
    argv = prefix + isolation.namespace_args(bwrap)
    if limits.network:
        argv.append("--share-net")
    for path in ["/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"]:
        argv += isolation.system_bind(path)
    # Debian's alternatives (awk -> /etc/alternatives/awk -> mawk) and the linker's cache: symlinks
    # and library paths, nothing private
    etc = ["/etc/alternatives", "/etc/ld.so.cache"]
    if limits.network:
        etc += ["/etc/resolv.conf", "/etc/hosts", "/etc/ssl", "/etc/ca-certificates"]
    for path in etc:
        if os.path.exists(path):
            argv += ["--ro-bind", path, path]
    for path in python_binds:
        argv += ["--ro-bind", path, path]
    disk = str(limits.disk_mb << 20)
    argv += ["--proc", "/proc", "--dev", "/dev", "--size", disk, "--tmpfs", "/work"]
    argv += ["--size", disk, "--tmpfs", "/tmp", "--chdir", "/work", "--remount-ro", "/"]
    argv += ["--seccomp", str(seccomp_fd), "--"]
    return argv + [python, "-I", "-S", "-B", "-c", _supervisor_source(), json.dumps(limits.for_supervisor())]


def source_tar(source: str | Path | bytes) -> bytes:
    """A repository as a tar to copy into /work: a folder (its contents), a .tar / .tar.gz file,
    or tar bytes."""
    if isinstance(source, bytes):
        return source
    path = Path(source)
    if path.is_dir():
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            for child in sorted(path.iterdir()):
                tar.add(child, arcname=child.name)
        data = buf.getvalue()
    elif path.is_file():
        data = path.read_bytes()
    else:
        raise FileNotFoundError(f"repository {str(path)!r}: no such folder or tar file")
    if len(data) > MAX_SOURCE_BYTES:
        raise ValueError(f"repository {str(path)!r}: {len(data)} bytes as a tar, more than {MAX_SOURCE_BYTES}")
    return data


class Workspace:
    """One sandbox with a shell and files (see the module docstring). Use as `async with`."""

    def __init__(self, limits: Limits | None = None) -> None:
        self.limits = limits or Limits()
        self.proc: asyncio.subprocess.Process | None = None
        self._ids = itertools.count(1)
        self._lock = asyncio.Lock()
        self._record: Path | None = None
        self._deadline: asyncio.TimerHandle | None = None
        self._stderr: bytearray = bytearray()
        self._stderr_task: asyncio.Task | None = None
        self.ended: str | None = None
        """Why the sandbox ended before `close`, once it has."""

    async def __aenter__(self) -> Workspace:
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def start(self, source: str | Path | bytes | None = None) -> None:
        """Start the sandbox and copy `source` (see `source_tar`) into /work."""
        await asyncio.to_thread(isolation.require, isolation.bwrap_path())
        _reaped_once()
        tar = None if source is None else await asyncio.to_thread(source_tar, source)
        seccomp = isolation.seccomp_pipe(forks=True)
        try:
            self.proc = await asyncio.create_subprocess_exec(
                *_argv(self.limits, seccomp),
                env={},
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                pass_fds=(seccomp,),
                limit=4 * MAX_SOURCE_BYTES,
            )
        finally:
            os.close(seccomp)
        self._stderr_task = asyncio.ensure_future(self._drain_stderr())
        self._register()
        loop = asyncio.get_running_loop()
        self._deadline = loop.call_later(self.limits.episode_timeout_s, self._expire)
        try:
            first = await asyncio.wait_for(self.proc.stdout.readline(), timeout=60)  # type: ignore[union-attr]
            if not first.startswith(b'{"id": 0, "ready": true}'):
                raise WorkspaceError(f"the sandbox did not start: {self._said()}")
            if tar is not None:
                await self._call("extract", tar=base64.b64encode(tar).decode())
        except BaseException:
            await self.close()
            raise

    def _register(self) -> None:
        assert self.proc is not None
        sandbox = process_id(self.proc.pid)
        owner = os.environ.get(OWNER_ENV) or process_id(os.getpid())
        folder = registry()
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._record = folder / f"{self.proc.pid}.json"
        self._record.write_text(json.dumps({"sandbox": sandbox, "owner": owner}))

    def _expire(self) -> None:
        self.ended = f"the episode's time limit ({self.limits.episode_timeout_s:g} s) ended the sandbox"
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()

    async def _drain_stderr(self) -> None:
        assert self.proc is not None and self.proc.stderr is not None
        while chunk := await self.proc.stderr.read(65536):
            self._stderr += chunk
            del self._stderr[:-4096]

    def _said(self) -> str:
        text = self._stderr.decode(errors="replace").strip()
        return text[-500:] or f"exit code {self.proc.returncode if self.proc else None}"

    async def _call(self, op: str, timeout: float = 30.0, **request) -> dict:
        """One request to the supervisor, its reply (an `error` key: the operation failed, as
        the agent made it fail; the sandbox itself failing raises WorkspaceError)."""
        if self.proc is None or self.proc.returncode is not None or self.ended:
            raise WorkspaceError(self.ended or f"the sandbox has ended ({self._said()})")
        async with self._lock:
            rid = next(self._ids)
            line = json.dumps({"id": rid, "op": op, **request}).encode() + b"\n"
            try:
                assert self.proc.stdin is not None and self.proc.stdout is not None
                self.proc.stdin.write(line)
                await self.proc.stdin.drain()
                raw = await asyncio.wait_for(self.proc.stdout.readline(), timeout=timeout)
            except TimeoutError:
                self.ended = f"the sandbox did not answer {op!r} within {timeout:g} s"
                await self.close()
                raise WorkspaceError(self.ended) from None
            except (BrokenPipeError, ConnectionResetError, ValueError) as e:
                raise WorkspaceError(self.ended or f"the sandbox has ended ({e})") from None
            if not raw:
                await self._wait_ended()
                raise WorkspaceError(self.ended or f"the sandbox has ended ({self._said()})")
            try:
                reply = json.loads(raw)
            except ValueError:
                reply = None
            if not isinstance(reply, dict) or reply.get("id") != rid:
                await self.close()
                raise WorkspaceError(f"the sandbox answered {op!r} with something else: {raw[:200]!r}")
            return reply

    async def _wait_ended(self) -> None:
        if self.proc is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.proc.wait(), timeout=5)

    async def run(self, command: str, timeout: float | None = None) -> CommandResult:
        """Run `command` with bash in /work (the directory and exported variables of the last
        command carry over)."""
        timeout = min(timeout or self.limits.command_timeout_s, self.limits.command_timeout_s)
        reply = await self._call(
            "run", timeout=timeout + 30, command=command, seconds=timeout, output_bytes=self.limits.output_bytes
        )
        if "error" in reply:
            raise WorkspaceError(f"the sandbox could not run the command: {reply['error']}")
        return CommandResult(
            stdout=str(reply["stdout"]),
            stderr=str(reply["stderr"]),
            exit_code=int(reply["exit_code"]),
            timed_out=bool(reply["timed_out"]),
            stdout_bytes=int(reply["stdout_bytes"]),
            stderr_bytes=int(reply["stderr_bytes"]),
        )

    async def read(self, path: str, max_bytes: int = 1 << 20) -> bytes:
        """The file at `path` (relative to /work); OSError-like failures raise FileNotFoundError /
        ValueError with the sandbox's words."""
        reply = await self._call("read", path=path, max_bytes=max_bytes)
        if "error" in reply:
            raise OSError(reply["error"])
        data = base64.b64decode(reply["data"])
        if len(data) > max_bytes:
            raise ValueError(f"{path}: larger than {max_bytes} bytes")
        return data

    async def write(self, path: str, data: bytes) -> None:
        reply = await self._call("write", path=path, data=base64.b64encode(data).decode())
        if "error" in reply:
            raise OSError(reply["error"])

    async def listing(self, path: str = ".", depth: int = 2, max_entries: int = 500) -> tuple[list[str], bool]:
        """Paths under `path` to `depth` levels (folders end in /), and whether there were more."""
        reply = await self._call("list", path=path, depth=depth, max_entries=max_entries)
        if "error" in reply:
            raise OSError(reply["error"])
        return [str(e) for e in reply["entries"]], bool(reply["more"])

    async def changes(self, max_bytes: int = 16 << 20) -> Changes:
        """What changed in /work since the source was copied in."""
        reply = await self._call("changes", timeout=120, max_bytes=max_bytes)
        if "error" in reply:
            raise WorkspaceError(f"the workspace's changes cannot be read: {reply['error']}")
        return Changes.from_json(reply)

    async def apply(self, changes: Changes) -> None:
        reply = await self._call("apply", timeout=120, **changes.to_json())
        if "error" in reply:
            raise WorkspaceError(f"the changes cannot be applied: {reply['error']}")

    async def close(self) -> None:
        """Kill the sandbox (every process in it) and forget it. Idempotent."""
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        proc = self.proc
        if proc is not None:
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()  # --die-with-parent: the sandbox's init, and so its namespace, follow
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(proc.wait(), timeout=10)
            if proc.stdin is not None:
                proc.stdin.close()
        if self._stderr_task is not None:
            with contextlib.suppress(TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(self._stderr_task, timeout=5)
            self._stderr_task = None
        if self._record is not None:
            self._record.unlink(missing_ok=True)
            self._record = None
