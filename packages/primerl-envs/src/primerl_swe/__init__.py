"""swe: fix a repository so that its hidden tests pass (SWE-bench's shape, run locally).

An instance is SWE-bench's fields: `instance_id`, `repo` (a folder or tar file here, not a
GitHub name), `problem_statement`, `test_patch` (a unified diff adding the hidden tests),
`FAIL_TO_PASS` and `PASS_TO_PASS` (test ids, lists or SWE-bench's JSON strings of lists),
optionally `patch` (the reference fix), `setup_command` and `test_command` (default
`python3 -m unittest {test}`, run once per test id). Load them from JSONL (`instances =
"path.jsonl"`), or generate small synthetic ones (`num_tasks = N`, without `instances`: a Python package with a
planted bug, its visible tests, a hidden test that fails until the bug is fixed, and the fix).

The agent works in a primerl_sandbox workspace holding the repository (tools: bash,
read_file, write_file, str_replace, list_files) and never sees the hidden tests. After the
episode, `finalize` judges what it changed (`primerl_swe.judge`): a fresh workspace gets the
repository, the changes except those to test files, the test patch, and runs each test id.
Reward 1.0 when every FAIL_TO_PASS test passes and no PASS_TO_PASS test fails, else 0.0;
metrics: the fraction of each list passing, files changed, commands run, tool errors.
"""

from __future__ import annotations

import json
from pathlib import Path

import verifiers.v1 as vf
from primerl_envs.tasks import read_jsonl
from primerl_sandbox.tools import SandboxState, SandboxTools, SandboxToolsConfig, changes_of
from pydantic import field_validator

from primerl_swe.judge import Verdict, judge

__all__ = ["SweData", "SweTaskset"]

PROMPT = """You are working in a Python repository at /work. Fix the issue below so that the repository's \
behaviour matches it. Use the tools to explore, edit and run code; the hidden tests that check your fix \
are not in the repository. When you are done, reply with a short summary and no tool call.

<issue>
{problem}
</issue>"""


class SweData(vf.TaskData):
    instance_id: str
    repo: str
    """The repository: a folder or a .tar / .tar.gz file."""
    problem_statement: str
    test_patch: str
    FAIL_TO_PASS: list[str]
    PASS_TO_PASS: list[str] = []
    patch: str | None = None
    """The reference fix (a unified diff); never shown to the agent."""
    setup_command: str | None = None
    test_command: str = "python3 -m unittest {test}"

    @field_validator("FAIL_TO_PASS", "PASS_TO_PASS", mode="before")
    @classmethod
    def _json_list(cls, value):
        """SWE-bench stores the lists as JSON strings."""
        return json.loads(value) if isinstance(value, str) else value


class SweState(SandboxState):
    verdict: dict | None = None
    """primerl_swe.judge.Verdict as a dict, set by `finalize`."""


class SweTaskConfig(vf.TaskConfig):
    sandbox: SandboxToolsConfig = SandboxToolsConfig()
    """Limits of the agent's workspace (and of the judge's)."""
    test_timeout_s: float = 60.0
    """Wall clock of one hidden test."""


class SweTask(vf.Task[SweData, SweState, SweTaskConfig]):
    @classmethod
    def toolsets(cls, config: SweTaskConfig) -> list[vf.Toolset]:
        return [SandboxTools(config.sandbox)]  # pyright: ignore[reportReturnType] (verifiers' generics are invariant)

    async def finalize(self, trace: vf.Trace, runtime) -> None:
        state = trace.state
        assert isinstance(state, SweState)
        try:
            changes = changes_of(state)
        except ValueError as e:  # what the toolset's channel carried is not changes
            state.verdict = Verdict(error=f"the episode's changes are malformed: {e}").to_dict()
            return
        if changes is None and state.changes_error:
            state.verdict = Verdict(error=state.changes_error).to_dict()
            return
        config = self.config
        assert isinstance(config, SweTaskConfig), "SweTaskset builds its tasks with an SweTaskConfig"
        verdict = await judge(self.data, changes, config.sandbox.limits(), config.test_timeout_s)
        state.verdict = verdict.to_dict()

    @vf.metric
    async def tests(self, trace: vf.Trace) -> dict[str, float]:
        v = Verdict.from_state(trace.state)
        state = trace.state
        return {
            "fail_to_pass": v.fraction(v.fail_to_pass, v.fail_to_pass_total),
            "pass_to_pass": v.fraction(v.pass_to_pass, v.pass_to_pass_total),
            "changed_files": float(v.changed_files),
            "commands": float(getattr(state, "commands", 0)),
            "tool_errors": float(getattr(state, "tool_errors", 0)),
            "judge_error": float(v.error is not None),
        }

    @vf.reward(weight=1.0)
    async def resolved(self, trace: vf.Trace) -> float:
        return 1.0 if Verdict.from_state(trace.state).resolved else 0.0


class SweConfig(vf.TasksetConfig):
    instances: str | None = None
    """A JSONL file of SWE-bench-style instances (relative `repo` paths are read from its folder)."""
    num_tasks: int = 100
    """How many synthetic instances to generate when `instances` is unset."""
    synthetic_dir: str | None = None
    """Where the synthetic repositories go
    (default: `<temp>/primerl-swe-<seed>-<num_tasks>-uid<uid>`, one per user and settings).
    Written whole into a sibling folder and renamed into place; a run that finds it complete
    with the same data reuses it, so runs of the same settings share it and never delete it
    under each other. A folder of other generated data (other settings) is replaced, one with
    files not generated here refused (primerl_envs.folders)."""
    seed: int = 0
    task: SweTaskConfig = SweTaskConfig()


class SweTaskset(vf.Taskset[SweTask, SweConfig]):  # pyright: ignore[reportInvalidTypeArguments] (its State is SweState; verifiers' bound is invariant)
    def load(self):
        cfg = self.config
        if cfg.instances:
            path = Path(cfg.instances)
            rows = read_instances(path)
        elif cfg.num_tasks > 0:
            from primerl_swe.synthetic import write_instances

            rows = write_instances(cfg.synthetic_dir, cfg.num_tasks, cfg.seed)
        else:
            raise ValueError("swe: set instances = 'file.jsonl', or num_tasks > 0 synthetic instances")
        for row in rows:
            row = {k: v for k, v in row.items() if k not in ("id", "prompt")}
            data = SweData(id=row["instance_id"], prompt=PROMPT.format(problem=row["problem_statement"].strip()), **row)
            yield SweTask(data, cfg.task)


def read_instances(path: Path) -> list[dict]:
    """The instances of a JSONL file, each checked (a bad line raises ValueError naming it); a
    relative `repo` is taken from the file's folder."""
    rows = read_jsonl(path, SweData, "a SWE instance", relative=("repo",))
    return [{k: v for k, v in row.items() if k in SweData.model_fields} for row in rows]
