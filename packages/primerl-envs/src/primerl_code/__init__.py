"""code: write a small Python function; hidden unit tests decide the reward.

The reply's last ```python block (or the whole reply when it has none) runs in
primerl_code.sandbox: a bubblewrap sandbox (no network, a read-only view of the interpreter
only, one small scratch folder, no new processes, rlimits). A hidden test is data,
`HiddenTest(fn, args, expected)`, with `expected` computed by a reference implementation; the
sandbox only ever gets the function name and the args, and the parent compares the returned
values. Reward: the fraction of hidden tests passed; metric `all_passed`. A submission that
errors, loops or exhausts memory passes nothing and scores 0.

Loading the taskset checks that the sandbox works here and raises SandboxUnavailable, saying
how to install bubblewrap, when it does not (PRIMERL_SANDBOX=unsafe-no-namespaces switches the
isolation off, with a warning each time).
"""

from __future__ import annotations

import json
import random
import re

import verifiers.v1 as vf

from primerl_code.sandbox import HiddenTest, SandboxUnavailable, require_sandbox, run_tests

__all__ = ["CodeTaskset", "HiddenTest", "SandboxUnavailable"]

# name, signature, description, reference implementation (for generating expected values)
PROBLEMS = [
    ("add", "add(a, b)", "returns a + b", lambda a, b: a + b, lambda r: (r.randint(-50, 50), r.randint(-50, 50))),
    (
        "maximum",
        "maximum(xs)",
        "returns the largest number of the list xs",
        max,
        lambda r: ([r.randint(-99, 99) for _ in range(r.randint(1, 6))],),
    ),
    (
        "reverse",
        "reverse(s)",
        "returns the string s backwards",
        lambda s: s[::-1],
        lambda r: ("".join(r.choice("abcxyz") for _ in range(r.randint(0, 8))),),
    ),
    (
        "count_vowels",
        "count_vowels(s)",
        "returns how many of the characters of s are vowels (aeiou)",
        lambda s: sum(c in "aeiou" for c in s),
        lambda r: ("".join(r.choice("abeiouxyz") for _ in range(r.randint(0, 10))),),
    ),
    (
        "is_even",
        "is_even(n)",
        "returns True when the integer n is even",
        lambda n: n % 2 == 0,
        lambda r: (r.randint(-100, 100),),
    ),
    (
        "total",
        "total(xs)",
        "returns the sum of the list xs",
        sum,
        lambda r: ([r.randint(-20, 20) for _ in range(r.randint(0, 6))],),
    ),
]

SOLUTIONS = {
    "add": "def add(a, b):\n    return a + b\n",
    "maximum": "def maximum(xs):\n    return max(xs)\n",
    "reverse": "def reverse(s):\n    return s[::-1]\n",
    "count_vowels": "def count_vowels(s):\n    return sum(c in 'aeiou' for c in s)\n",
    "is_even": "def is_even(n):\n    return n % 2 == 0\n",
    "total": "def total(xs):\n    return sum(xs)\n",
}
"""A correct submission for each problem, as a model would write it (tests and examples)."""

CODE_BLOCK = re.compile(r"```(?:python|py)?\n(.*?)```", re.DOTALL)


def extract_code(reply: str) -> str:
    """The last fenced code block of `reply`, or the whole reply when it has none."""
    blocks = CODE_BLOCK.findall(reply or "")
    return blocks[-1] if blocks else (reply or "")


class CodeData(vf.TaskData):
    tests: list[HiddenTest]
    """Hidden tests: `fn(*args)` must return `expected` (JSON data, compared outside the sandbox)."""


class CodeTaskConfig(vf.TaskConfig):
    time_limit_s: float = 5.0
    """Wall-clock and CPU limit of one test run, in seconds."""
    memory_mb: int = 512
    """Address-space limit of the test run, in MiB."""


class CodeTask(vf.Task[CodeData, vf.State, CodeTaskConfig]):
    config: CodeTaskConfig
    """The task's limits (verifiers' Task makes a CodeTaskConfig when given none: config_type)."""

    async def _run(self, trace: vf.Trace):
        cached = trace.info.get("sandbox")
        if cached is None:
            result = await run_tests(
                extract_code(trace.last_reply or ""),
                self.data.tests,
                time_limit_s=self.config.time_limit_s,
                memory_mb=self.config.memory_mb,
            )
            cached = trace.info["sandbox"] = {"passed": result.passed, "total": result.total, "error": result.error}
        return cached

    @vf.reward(weight=1.0)
    async def tests_passed(self, trace: vf.Trace) -> float:
        r = await self._run(trace)
        return r["passed"] / r["total"] if r["total"] else 0.0

    @vf.metric
    async def all_passed(self, trace: vf.Trace) -> float:
        r = await self._run(trace)
        return float(r["total"] > 0 and r["passed"] == r["total"])


class CodeConfig(vf.TasksetConfig):
    num_tasks: int = 1000
    """How many problems to generate."""
    num_tests: int = 4
    """Hidden tests per problem."""
    seed: int = 0
    """Seed of the generated data."""
    task: CodeTaskConfig = CodeTaskConfig()
    """Sandbox limits passed to each task."""


class CodeTaskset(vf.Taskset[CodeTask, CodeConfig]):  # pyright: ignore[reportInvalidTypeArguments] (its config is CodeTaskConfig; verifiers' bound is invariant)
    def load(self):
        require_sandbox()
        cfg = self.config
        rng = random.Random(cfg.seed)
        for i in range(cfg.num_tasks):
            name, signature, description, reference, inputs = rng.choice(PROBLEMS)
            tests = []
            for _ in range(cfg.num_tests):
                args = inputs(rng)
                # as JSON carries them, so a tuple and a list compare alike
                expected = json.loads(json.dumps(reference(*args)))
                tests.append(HiddenTest(name, json.loads(json.dumps(list(args))), expected))
            prompt = (
                f"Write a Python function {signature} that {description}. Reply with the code in a ```python block."
            )
            data = CodeData(id=f"code-{i}", prompt=prompt, tests=tests)  # pyright: ignore[reportCallIssue] (verifiers' Field(default, ...) positional defaults read as required)
            yield CodeTask(data, cfg.task)
