"""Per-rollout sandboxes for agents: a shell and files in the code sandbox's isolation
(primerl_sandbox.workspace), offered to verifiers environments as a toolset
(primerl_sandbox.tools)."""

from primerl_sandbox.workspace import (
    Changes,
    CommandResult,
    Limits,
    SandboxUnavailable,
    Workspace,
    WorkspaceError,
    claim_run,
    reap,
)

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
