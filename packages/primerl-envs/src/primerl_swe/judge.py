"""Judging an episode's changes against hidden tests, in a workspace the agent never touched.

`judge(instance, changes)`: a fresh primerl_sandbox workspace gets the repository and runs its
`setup_command`; then the agent's changes, less those to files the hidden tests own or that
would change how the tests run (see `protected`); then the test patch (`git apply`); then each
FAIL_TO_PASS and PASS_TO_PASS test id with `test_command` (a test passes when it exits 0 within
its time limit). A patch that only edits tests therefore leaves the bug, and its hidden tests
fail as on the untouched repository.
"""

from __future__ import annotations

import re
import shlex
import sys
from dataclasses import asdict, dataclass, replace

from primerl_sandbox.workspace import Changes, Limits, Workspace, WorkspaceError

__all__ = ["Verdict", "judge", "patch_files", "protected"]

TEST_FILE = re.compile(r"(^|/)(tests?/|test_[^/]*\.py$|[^/]*_test\.py$|conftest\.py$)")
STARTUP = re.compile(r"(^|/)(sitecustomize|usercustomize)\.py$|\.pth$")


@dataclass
class Verdict:
    fail_to_pass: int = 0
    fail_to_pass_total: int = 0
    pass_to_pass: int = 0
    pass_to_pass_total: int = 0
    changed_files: int = 0
    error: str | None = None
    """Why the tests could not run (the judge's sandbox failed, the test patch did not apply)."""

    @property
    def resolved(self) -> bool:
        return (
            self.error is None
            and self.fail_to_pass_total > 0
            and self.fail_to_pass == self.fail_to_pass_total
            and self.pass_to_pass == self.pass_to_pass_total
        )

    @staticmethod
    def fraction(passed: int, total: int) -> float:
        return passed / total if total else 1.0

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_state(cls, state) -> Verdict:
        data = getattr(state, "verdict", None)
        if not isinstance(data, dict):
            return cls(error="not judged")
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})


def patch_files(diff: str) -> set[str]:
    """The paths a unified diff touches (both sides of each file header)."""
    paths = set()
    for line in diff.splitlines():
        if line.startswith(("--- ", "+++ ")):
            name = line[4:].split("\t")[0].strip()
            if name != "/dev/null":
                paths.add(name[2:] if name[:2] in ("a/", "b/") else name)
    return paths


def protected(path: str, test_files: set[str]) -> bool:
    """Changes the judge drops: the test patch's files, test files and folders, and files that
    change how Python starts (a sitecustomize, a .pth, a top-level module named like one of the
    standard library's, which `python -m unittest` in /work would import instead)."""
    if path in test_files or TEST_FILE.search(path) or STARTUP.search(path):
        return True
    top = path.split("/")[0]
    return "/" not in path and top.endswith(".py") and top[:-3] in sys.stdlib_module_names


async def judge(instance, changes: Changes | None, limits: Limits, test_timeout_s: float = 60.0) -> Verdict:
    """Run the hidden tests of `instance` (SweData) on `changes` (None: the untouched repository)."""
    f2p, p2p = list(instance.FAIL_TO_PASS), list(instance.PASS_TO_PASS)
    verdict = Verdict(fail_to_pass_total=len(f2p), pass_to_pass_total=len(p2p))
    test_files = patch_files(instance.test_patch)
    kept = None
    if changes is not None:
        paths = set(changes.files) | set(changes.symlinks) | set(changes.deleted)
        verdict.changed_files = len(paths)
        kept = changes.without({p for p in paths if protected(p, test_files)})
    limits = replace(limits, command_timeout_s=max(limits.command_timeout_s, test_timeout_s))
    workspace = Workspace(limits)
    try:
        await workspace.start(instance.repo)
        if instance.setup_command:
            done = await workspace.run(instance.setup_command)
            if done.exit_code != 0:
                verdict.error = f"setup_command failed: exit code {done.exit_code}: {done.stderr[-300:]}"
                return verdict
        if kept:
            await workspace.apply(kept)
        await workspace.write("/tmp/test.patch", instance.test_patch.encode())
        done = await workspace.run("git apply --whitespace=nowarn /tmp/test.patch")
        if done.exit_code != 0:
            verdict.error = f"the test patch does not apply: {(done.stderr or done.stdout)[-300:]}"
            return verdict
        for tests, field in ((f2p, "fail_to_pass"), (p2p, "pass_to_pass")):
            for test in tests:
                command = instance.test_command.format(test=shlex.quote(test))
                done = await workspace.run(command, timeout=test_timeout_s)
                if done.exit_code == 0 and not done.timed_out:
                    setattr(verdict, field, getattr(verdict, field) + 1)
    except (WorkspaceError, OSError) as e:
        verdict.error = f"the judge's sandbox failed: {e}"
    finally:
        await workspace.close()
    return verdict
