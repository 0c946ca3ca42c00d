"""terminal: do a job in a shell; a check script decides (Terminal-Bench's shape, run locally).

A task is an `instruction`, a starting workspace (`workspace`: a folder or tar file; none: an
empty /work) and a `check` script (bash) that exits 0 when the job is done. Load tasks from
JSONL (`tasks = "path.jsonl"`, relative workspaces from its folder), or generate small ones
(`num_tasks = N`: counting, sorting, renaming and archive jobs over generated files, each with a
`reference` solution that passes its check).

The agent works in a primerl_sandbox workspace (tools: bash, read_file, write_file,
str_replace, list_files). After the episode a fresh workspace gets the starting files and the
episode's changes, then the check script (which the agent never saw) runs there. The file
system is what is judged: processes the agent left running are not carried over. Reward 1.0
when the check exits 0 within `check_timeout_s`, else 0.0; metrics: commands, tool errors,
files changed.
"""

from __future__ import annotations

from pathlib import Path

import verifiers.v1 as vf
from primerl_envs.tasks import read_jsonl
from primerl_sandbox.tools import SandboxState, SandboxTools, SandboxToolsConfig, changes_of
from primerl_sandbox.workspace import Changes, Limits, Workspace, WorkspaceError

__all__ = ["TerminalData", "TerminalTaskset", "check"]

PROMPT = """You have a bash shell in a Linux sandbox; your working directory is /work. Do this:

{instruction}

Use the tools to run commands and edit files. When the job is done, reply with a short summary and no tool call."""


class TerminalData(vf.TaskData):
    instruction: str
    check: str
    """A bash script run in /work after the episode: exit 0 when the job is done."""
    workspace: str | None = None
    """The starting files: a folder or a .tar / .tar.gz file; None: an empty /work."""
    reference: str | None = None
    """A command that does the job (for checking the task itself); never shown to the agent."""


class TerminalState(SandboxState):
    passed: bool | None = None
    check_error: str | None = None


class TerminalTaskConfig(vf.TaskConfig):
    sandbox: SandboxToolsConfig = SandboxToolsConfig()
    check_timeout_s: float = 60.0


async def check(data: TerminalData, changes: Changes | None, limits: Limits, timeout_s: float = 60.0) -> bool:
    """Whether the check passes on the starting files plus `changes`, in a fresh workspace
    (WorkspaceError when the sandbox itself fails)."""
    workspace = Workspace(limits)
    try:
        await workspace.start(data.workspace)
        if changes:
            await workspace.apply(changes)
        await workspace.write("/tmp/.check.sh", data.check.encode())
        done = await workspace.run("bash /tmp/.check.sh", timeout=timeout_s)
        return done.exit_code == 0 and not done.timed_out
    finally:
        await workspace.close()


class TerminalTask(vf.Task[TerminalData, TerminalState, TerminalTaskConfig]):
    @classmethod
    def toolsets(cls, config: TerminalTaskConfig) -> list[vf.Toolset]:
        return [SandboxTools(config.sandbox)]  # pyright: ignore[reportReturnType] (verifiers' generics are invariant)

    async def finalize(self, trace: vf.Trace, runtime) -> None:
        state = trace.state
        assert isinstance(state, TerminalState)
        config = self.config
        assert isinstance(config, TerminalTaskConfig), "TerminalTaskset builds its tasks with a TerminalTaskConfig"
        try:
            changes = changes_of(state)
            if changes is None and state.changes_error:
                raise WorkspaceError(state.changes_error)
            state.passed = await check(self.data, changes, config.sandbox.limits(), config.check_timeout_s)
        except (ValueError, WorkspaceError, OSError) as e:
            state.passed, state.check_error = False, str(e)[:500]

    @vf.metric
    async def episode(self, trace: vf.Trace) -> dict[str, float]:
        state = trace.state
        changes = getattr(state, "changes", None) or {}
        changed = sum(len(changes.get(k, ())) for k in ("files", "symlinks", "deleted"))
        return {
            "commands": float(getattr(state, "commands", 0)),
            "tool_errors": float(getattr(state, "tool_errors", 0)),
            "changed_files": float(changed),
            "check_error": float(getattr(state, "check_error", None) is not None),
        }

    @vf.reward(weight=1.0)
    async def passed(self, trace: vf.Trace) -> float:
        return 1.0 if getattr(trace.state, "passed", False) else 0.0


class TerminalConfig(vf.TasksetConfig):
    tasks: str | None = None
    """A JSONL file of tasks (instruction, check, workspace, reference)."""
    num_tasks: int = 100
    """How many generated tasks when `tasks` is unset."""
    tasks_dir: str | None = None
    """Where generated workspaces go
    (default: `<temp>/primerl-terminal-<seed>-<num_tasks>-uid<uid>`, one per user and settings).
    Written whole into a sibling folder and renamed into place; a run that finds it complete
    with the same data reuses it, so runs of the same settings share it and never delete it
    under each other. A folder of other generated data (other settings) is replaced, one with
    files not generated here refused (primerl_envs.folders)."""
    seed: int = 0
    task: TerminalTaskConfig = TerminalTaskConfig()


class TerminalTaskset(vf.Taskset[TerminalTask, TerminalConfig]):  # pyright: ignore[reportInvalidTypeArguments] (its State is TerminalState; verifiers' bound is invariant)
    def load(self):
        cfg = self.config
        if cfg.tasks:
            rows = read_tasks(Path(cfg.tasks))
        elif cfg.num_tasks > 0:
            from primerl_terminal.generated import write_tasks

            rows = write_tasks(cfg.tasks_dir, cfg.num_tasks, cfg.seed)
        else:
            raise ValueError("terminal: set tasks = 'file.jsonl', or num_tasks > 0 generated tasks")
        for i, row in enumerate(rows):
            data = TerminalData(
                id=row.get("id") or f"terminal-{i}",
                prompt=PROMPT.format(instruction=row["instruction"]),
                **{k: v for k, v in row.items() if k in ("instruction", "check", "workspace", "reference")},
            )
            yield TerminalTask(data, cfg.task)


def read_tasks(path: Path) -> list[dict]:
    """The tasks of a JSONL file, each checked (a bad line raises ValueError naming it); a
    relative `workspace` is taken from the file's folder."""
    return read_jsonl(path, TerminalData, "a terminal task", relative=("workspace",))
