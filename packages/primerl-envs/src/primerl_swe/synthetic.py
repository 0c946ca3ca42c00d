"""Small synthetic SWE instances: a Python package with one planted bug.

Each repository holds `toolkit/core.py` (five small functions, one of them wrong), visible tests
of the four others (`tests/test_core.py`, the PASS_TO_PASS ids) and no test of the wrong one;
the hidden test patch adds `tests/test_fix.py`, whose test fails until the bug is fixed (the
FAIL_TO_PASS id); `patch` is the fix. The problem statement describes the wrong behaviour with
one example, as an issue would. Everything runs on the standard library (`python3 -m unittest`).
The repositories are written once and shared (`primerl_envs.folders`).
"""

from __future__ import annotations

import difflib
import random
from pathlib import Path

from primerl_envs.folders import default_folder, write_folder

# name, signature, the right body, the planted bug, a call and its right value, a second check
FUNCTIONS = [
    ("clamp", "clamp(x, lo, hi)", "return max(lo, min(x, hi))", "return min(lo, max(x, hi))", "clamp(5, 0, 10)", "5"),
    ("mean", "mean(xs)", "return sum(xs) / len(xs)", "return sum(xs) / (len(xs) + 1)", "mean([2, 4, 6])", "4.0"),
    (
        "is_palindrome",
        "is_palindrome(s)",
        "return s == s[::-1]",
        "return s == s[1:][::-1]",
        "is_palindrome('level')",
        "True",
    ),
    (
        "factorial",
        "factorial(n)",
        "out = 1\n    for k in range(2, n + 1):\n        out *= k\n    return out",
        "out = 1\n    for k in range(2, n):\n        out *= k\n    return out",
        "factorial(5)",
        "120",
    ),
    ("count_words", "count_words(s)", "return len(s.split())", "return len(s.split(' '))", "count_words('a  b')", "2"),
]
EXTRA_CHECKS = {
    "clamp": ("clamp(-3, 0, 10)", "0"),
    "mean": ("mean([1])", "1.0"),
    "is_palindrome": ("is_palindrome('ab')", "False"),
    "factorial": ("factorial(0)", "1"),
    "count_words": ("count_words(' x y z ')", "3"),
}


def _module(bug: str | None) -> str:
    parts = ['"""Small helpers."""\n']
    for name, signature, right, wrong, _, _ in FUNCTIONS:
        parts.append(f"\ndef {signature}:\n    {wrong if name == bug else right}\n")
    return "".join(parts)


def _test(cls: str, names: list[str]) -> str:
    lines = [
        "import unittest\n",
        "\n",
        "from toolkit.core import *  # noqa: F403\n",
        "\n",
        "\n",
        f"class {cls}(unittest.TestCase):\n",
    ]
    for name in names:
        call, want = next((f[4], f[5]) for f in FUNCTIONS if f[0] == name)
        more_call, more_want = EXTRA_CHECKS[name]
        lines += [
            f"    def test_{name}(self):\n",
            f"        self.assertEqual({call}, {want})\n",
            f"        self.assertEqual({more_call}, {more_want})\n",
            "\n",
        ]
    return "".join(lines).rstrip("\n") + "\n"


def _diff(path: str, old: str | None, new: str) -> str:
    before = [] if old is None else old.splitlines(keepends=True)
    head = f"diff --git a/{path} b/{path}\n" + ("new file mode 100644\n" if old is None else "")
    body = difflib.unified_diff(
        before, new.splitlines(keepends=True), "/dev/null" if old is None else f"a/{path}", f"b/{path}"
    )
    return head + "".join(body)


def instance(folder: Path, index: int, rng: random.Random) -> tuple[dict[str, str], dict]:
    """One instance whose repository is `folder`: its files (path in the repository -> text) and
    its row."""
    name, signature, _, _, call, want = FUNCTIONS[rng.randrange(len(FUNCTIONS))]
    others = [f[0] for f in FUNCTIONS if f[0] != name]
    buggy = _module(name)
    files = {
        "toolkit/__init__.py": "",
        "tests/__init__.py": "",
        "toolkit/core.py": buggy,
        "tests/test_core.py": _test("TestCore", others),
        "README.md": "toolkit: small helpers. Run the tests with `python3 -m unittest`.\n",
    }
    got = {"clamp": "0", "mean": "3.0", "is_palindrome": "False", "factorial": "24", "count_words": "3"}[name]
    return files, {
        "instance_id": f"synthetic-{index}-{name}",
        "repo": str(folder),
        "problem_statement": f"`{signature}` in toolkit/core.py is wrong: `{call}` returns {got}, but it should return {want}.",
        "test_patch": _diff("tests/test_fix.py", None, _test("TestFix", [name])),
        "FAIL_TO_PASS": [f"tests.test_fix.TestFix.test_{name}"],
        "PASS_TO_PASS": [f"tests.test_core.TestCore.test_{o}" for o in others],
        "patch": _diff("toolkit/core.py", buggy, _module(None)),
    }


def write_instances(folder: str | None, count: int, seed: int = 0) -> list[dict]:
    """`count` instances, their repositories under `folder` (default: `default_folder`), written
    by `write_folder` (reused when there with these settings)."""
    root = Path(folder) if folder else default_folder("swe", seed, count)
    rng = random.Random(seed)
    files: dict[str, str] = {}
    rows = []
    for i in range(count):
        repo, row = instance(root / f"{i:05d}", i, rng)
        files.update({f"{i:05d}/{rel}": text for rel, text in repo.items()})
        rows.append(row)
    write_folder(root, files)
    return rows
