"""The SWE taskset's judge: the reference fix scores 1, the untouched repository 0, edits to the
tests or to how Python starts do not count; instances load from SWE-bench-style JSONL."""

from __future__ import annotations

import asyncio
import json
import sys

import pytest
from primerl_sandbox import Limits, Workspace
from primerl_sandbox.tools import SandboxState
from primerl_sandbox.workspace import REGISTRY_ENV
from primerl_swe import SweData, SweState, SweTask, SweTaskConfig, read_instances
from primerl_swe.judge import judge, patch_files, protected
from primerl_swe.synthetic import write_instances

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="bubblewrap is Linux-only")


@pytest.fixture(autouse=True)
def own_registry(tmp_path, monkeypatch):
    monkeypatch.setenv(REGISTRY_ENV, str(tmp_path / "registry"))


@pytest.fixture(scope="module")
def instances(tmp_path_factory):
    return [SweData(**row) for row in write_instances(str(tmp_path_factory.mktemp("swe")), 5, seed=1)]


async def changes_after(data: SweData, command: str):
    """What `command` changes in the instance's repository, as an agent's episode would."""
    ws = Workspace()
    await ws.start(data.repo)
    try:
        await ws.write("/tmp/fix.patch", (data.patch or "").encode())
        done = await ws.run(command)
        assert done.exit_code == 0, done
        return await ws.changes()
    finally:
        await ws.close()


def verdicts(data: SweData, command: str | None):
    async def go():
        changes = None if command is None else await changes_after(data, command)
        return await judge(data, changes, Limits())

    return asyncio.run(go())


def test_every_synthetic_instance_is_fixed_by_its_reference_patch_and_not_without_it(instances):
    assert len({d.FAIL_TO_PASS[0] for d in instances}) > 1  # several planted bugs
    for data in instances:
        fixed = verdicts(data, "git apply /tmp/fix.patch")
        assert fixed.resolved and (fixed.fail_to_pass, fixed.pass_to_pass) == (1, 4), (data.instance_id, fixed)
        untouched = verdicts(data, None)
        assert not untouched.resolved and (untouched.fail_to_pass, untouched.pass_to_pass) == (0, 4), untouched


@pytest.mark.parametrize(
    "hack",
    [
        # the hidden test's file written by the agent (it wins nothing: the test patch's version is used)
        "printf 'import unittest\\nclass TestFix(unittest.TestCase):\\n    def test_x(self): pass\\n' > tests/test_fix.py",
        # every test made to pass by a module that shadows the standard library's unittest
        "printf 'import sys\\nsys.exit(0)\\n' > unittest.py",
        # or by a sitecustomize / a conftest
        "printf 'raise SystemExit(0)\\n' > sitecustomize.py && echo 'import sys' > conftest.py",
        # the visible tests emptied
        "echo > tests/test_core.py && echo > tests/__init__.py",
    ],
)
def test_edits_to_tests_or_to_how_python_starts_score_0(instances, hack):
    data = instances[0]
    got = verdicts(data, hack)
    assert got.changed_files >= 1 and got.error is None
    assert not got.resolved and got.fail_to_pass == 0 and got.pass_to_pass == 4, got


def test_protected_paths_and_patch_files():
    test_patch = "diff --git a/x/t.py b/x/t.py\n--- a/x/t.py\n+++ b/x/t.py\n@@ -1 +1 @@\n-a\n+b\n"
    assert patch_files(test_patch) == {"x/t.py"}
    assert protected("x/t.py", {"x/t.py"}) and protected("tests/a.py", set()) and protected("pkg/test_a.py", set())
    assert protected("json.py", set()) and protected("a/b.pth", set()) and not protected("pkg/json.py", set())
    assert not protected("toolkit/core.py", set())


def test_finalize_judges_the_state_and_names_malformed_changes(instances):
    """finalize reads what the toolset wrote to the rollout's state: the reference fix's changes
    give reward 1; changes that are not changes give a judge error and reward 0."""
    from types import SimpleNamespace

    data = instances[1]
    task = SweTask(data, SweTaskConfig())

    async def score(state: SandboxState):
        trace = SimpleNamespace(state=state)  # what finalize and the reward read of a trace
        await task.finalize(trace, None)
        return trace.state.verdict, await task.resolved(trace)

    fixed = asyncio.run(changes_after(data, "git apply /tmp/fix.patch"))
    verdict, reward = asyncio.run(score(SweState(changes=fixed.to_json())))
    assert reward == 1.0 and verdict["fail_to_pass"] == 1
    verdict, reward = asyncio.run(score(SweState(changes={"files": {"a": 1}})))
    assert reward == 0.0 and "malformed" in verdict["error"]


def test_instances_load_from_jsonl_with_swe_bench_fields_and_bad_lines_are_named(tmp_path, instances):
    row = instances[0].model_dump(include=set(SweData.model_fields) - set(vf_fields()))
    row["FAIL_TO_PASS"] = json.dumps(row["FAIL_TO_PASS"])  # SWE-bench's JSON strings
    row["PASS_TO_PASS"] = json.dumps(row["PASS_TO_PASS"])
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps(row) + "\n\n")
    (loaded,) = read_instances(good)
    assert SweData(**loaded).FAIL_TO_PASS == instances[0].FAIL_TO_PASS
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(row) + "\n" + json.dumps({k: v for k, v in row.items() if k != "test_patch"}) + "\n")
    with pytest.raises(ValueError, match=r"(?s)bad.jsonl:2: .*test_patch"):
        read_instances(bad)


def vf_fields():
    import verifiers.v1 as vf

    return vf.TaskData.model_fields
