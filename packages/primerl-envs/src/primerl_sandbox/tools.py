"""The workspace as a verifiers toolset: a shell and file tools for any verifiers environment.

A task opts in by listing it, and by using `SandboxState` as its state:

    class MyTask(vf.Task[MyData, SandboxState, MyTaskConfig]):
        @classmethod
        def toolsets(cls, config):
            return [SandboxTools(config.sandbox)]

verifiers starts the toolset's server once per rollout (`python -m primerl_sandbox.tools`);
`setup_task` starts a `Workspace` for it, copying in the task's `repo` or `workspace` (a
folder or tar file, when its data has one) and running its `setup_command`; the server's exit closes it (and if
the server is killed, bubblewrap's --die-with-parent does). After each tool that can change
files, the toolset writes what changed (`Changes.to_json()`) to the rollout's state
(`SandboxState.changes`), which verifiers syncs to the trace: scoring reads it there, after the
sandbox is gone, and judges it in a fresh workspace the agent never touched.

Tool failures (a missing file, an edit whose text is not found once) come back to the model as
text starting with "error:" and count in `SandboxState.tool_errors`; a sandbox that ended
(a limit, the agent killing its own supervisor) says so on every later call.
"""

from __future__ import annotations

import verifiers.v1 as vf
from pydantic import Field

from primerl_sandbox.workspace import Changes, Limits, Workspace, WorkspaceError

__all__ = ["SandboxState", "SandboxTools", "SandboxToolsConfig"]

READ_LINES = 400
"""Lines `read_file` returns by default."""
MAX_FILE_BYTES = 1 << 20


class SandboxState(vf.State):
    changes: dict | None = None
    """What the episode changed in the workspace (`Changes.to_json()`), after the last tool that
    could change it; None before any."""
    commands: int = 0
    tool_errors: int = 0
    changes_error: str | None = None
    """Why the changes could not be read (too large, the sandbox ended), if they could not."""


class SandboxToolsConfig(vf.ToolsetConfig):
    command_timeout_s: float = 60.0
    episode_timeout_s: float = 1800.0
    cpu_s: int = 120
    memory_mb: int = 2048
    disk_mb: int = 512
    nproc: int = 64
    output_bytes: int = Field(default=16384, ge=256)
    network: bool = False

    def limits(self) -> Limits:
        return Limits(
            command_timeout_s=self.command_timeout_s,
            episode_timeout_s=self.episode_timeout_s,
            cpu_s=self.cpu_s,
            memory_mb=self.memory_mb,
            disk_mb=self.disk_mb,
            nproc=self.nproc,
            output_bytes=self.output_bytes,
            network=self.network,
        )


def show(result) -> str:
    """A command's result as the model reads it."""
    parts = [f"exit code {result.exit_code}" + (" (killed: command time limit)" if result.timed_out else "")]
    for name, text, size in (
        ("stdout", result.stdout, result.stdout_bytes),
        ("stderr", result.stderr, result.stderr_bytes),
    ):
        if text:
            more = f" [truncated: {size} bytes in all]" if size > len(text.encode()) else ""
            parts.append(f"--- {name}{more} ---\n{text}")
    return "\n".join(parts)


class SandboxTools(vf.Toolset[SandboxToolsConfig, SandboxState]):
    TOOL_PREFIX = None  # bash, read_file, ...: the names agents are trained on

    def __init__(self, config: SandboxToolsConfig) -> None:
        super().__init__(config)
        self.workspace: Workspace | None = None
        self.failed: str | None = None
        """Why the workspace could not start, if it could not."""

    async def setup_task(self, task) -> None:
        """Start the rollout's workspace from its task's data (verifiers passes the data). A
        failure does not end the server (verifiers would wait minutes for it): every tool
        call then answers with it, and the judge sees it as the changes' error."""
        data = getattr(task, "data", task)
        self.workspace = Workspace(self.config.limits())
        self._exit_stack.push_async_callback(self.workspace.close)
        try:
            await self.workspace.start(getattr(data, "repo", None) or getattr(data, "workspace", None))
            setup = getattr(data, "setup_command", None)
            if setup:
                result = await self.workspace.run(setup)
                if result.exit_code != 0:
                    raise WorkspaceError(f"the task's setup_command failed: {show(result)}")
        except Exception as e:  # noqa: BLE001 - reported on every call instead (see above)
            self.failed = f"the workspace could not start: {type(e).__name__}: {e}"[:1000]
            await self.workspace.close()

    def _ws(self) -> Workspace:
        if self.failed is not None:
            raise WorkspaceError(self.failed)
        if self.workspace is None:
            raise WorkspaceError("no workspace: the toolset serves per-rollout tasks only")
        return self.workspace

    async def _record_changes(self) -> None:
        try:
            self.state.changes = (await self._ws().changes()).to_json()
            self.state.changes_error = None
        except WorkspaceError as e:
            self.state.changes_error = str(e)

    def _error(self, what: str) -> str:
        self.state.tool_errors += 1
        if self.failed is not None:
            self.state.changes_error = self.failed
        return f"error: {what}"

    @vf.tool
    async def bash(self, command: str) -> str:
        """Run a bash command in the workspace (/work). The working directory and exported
        variables carry over to the next command; stdin is empty."""
        self.state.commands += 1
        try:
            result = await self._ws().run(command)
        except WorkspaceError as e:
            return self._error(str(e))
        await self._record_changes()
        return show(result)

    @vf.tool
    async def read_file(self, path: str, offset: int = 0, limit: int = READ_LINES) -> str:
        """Lines offset .. offset + limit of a file, numbered from 1."""
        try:
            data = await self._ws().read(path, MAX_FILE_BYTES)
        except (OSError, ValueError, WorkspaceError) as e:
            return self._error(str(e))
        lines = data.decode(errors="replace").splitlines()
        offset, limit = max(0, offset), max(1, limit)
        shown = [f"{i + 1:6}\t{line}" for i, line in enumerate(lines[offset : offset + limit], start=offset)]
        tail = f"\n[{len(lines) - offset - limit} more lines]" if len(lines) > offset + limit else ""
        return "\n".join(shown) + tail

    @vf.tool
    async def write_file(self, path: str, content: str) -> str:
        """Create or overwrite a file with `content`."""
        try:
            await self._ws().write(path, content.encode())
        except (OSError, WorkspaceError) as e:
            return self._error(str(e))
        await self._record_changes()
        return f"wrote {len(content.encode())} bytes to {path}"

    @vf.tool
    async def str_replace(self, path: str, old: str, new: str) -> str:
        """Replace the one occurrence of `old` in a file with `new` (it must occur exactly once)."""
        try:
            text = (await self._ws().read(path, MAX_FILE_BYTES)).decode()
        except (OSError, ValueError, UnicodeDecodeError, WorkspaceError) as e:
            return self._error(str(e))
        count = text.count(old) if old else 0
        if count != 1:
            return self._error(f"{path}: the text to replace occurs {count} times, not once")
        try:
            await self._ws().write(path, text.replace(old, new, 1).encode())
        except (OSError, WorkspaceError) as e:
            return self._error(str(e))
        await self._record_changes()
        return f"edited {path}"

    @vf.tool
    async def list_files(self, path: str = ".", depth: int = 2) -> str:
        """Files and folders under `path` (folders end in /), `depth` levels deep."""
        try:
            entries, more = await self._ws().listing(path, max(1, min(depth, 8)))
        except (OSError, WorkspaceError) as e:
            return self._error(str(e))
        return "\n".join(entries) + ("\n[more entries not shown]" if more else "")


def changes_of(state) -> Changes | None:
    """The changes a rollout's state recorded (None: no tool changed anything, or they could not
    be read); malformed ones raise ValueError naming what."""
    data = getattr(state, "changes", None)
    return None if data is None else Changes.from_json(data)


if __name__ == "__main__":
    SandboxTools.run()
