"""Small generated terminal tasks: jobs over generated files, each with a check and a reference.

Five kinds (counting lines, distinct sorted lines, renaming files, packing a folder, summing a
column), their files drawn from a seeded generator; the check compares against the answer
computed here, in Python, never by running the reference. The workspaces are written once and
shared (`primerl_envs.folders`).
"""

from __future__ import annotations

import random
from pathlib import Path

from primerl_envs.folders import default_folder, write_folder

WORDS = ["ant", "bee", "cat", "dog", "eel", "fox", "gnu", "hen", "ibis", "jay", "koi", "lynx"]


def _lines(rng: random.Random, n: int) -> list[str]:
    return [rng.choice(WORDS) for _ in range(n)]


def _expect_file(path: str, content: str) -> str:
    """A check that `path` holds exactly `content` (a trailing newline either way)."""
    return f"printf '%s\\n' {_quote_lines(content)} | diff -q - <(sed -e '$a\\' {path}) >/dev/null\n"


def _quote_lines(content: str) -> str:
    return " ".join("'" + line.replace("'", "'\\''") + "'" for line in content.splitlines())


def task(folder: Path, index: int, rng: random.Random) -> tuple[dict[str, str], dict]:
    """One task whose workspace is `folder`: its files (path in the workspace -> text) and its row."""
    files: dict[str, str] = {}
    kind = index % 5
    if kind == 0:
        lines = _lines(rng, rng.randint(3, 40))
        files["data.txt"] = "\n".join(lines) + "\n"
        instruction = "Write the number of lines of data.txt (just the number) to count.txt."
        check = f'[ "$(tr -d "[:space:]" < count.txt)" = "{len(lines)}" ]\n'
        reference = "wc -l < data.txt > count.txt"
    elif kind == 1:
        lines = _lines(rng, rng.randint(5, 30))
        files["names.txt"] = "\n".join(lines) + "\n"
        instruction = "Write the distinct lines of names.txt, sorted alphabetically, one per line, to sorted.txt."
        check = _expect_file("sorted.txt", "\n".join(sorted(set(lines))))
        reference = "sort -u names.txt > sorted.txt"
    elif kind == 2:
        names = rng.sample(WORDS, rng.randint(2, 5))
        for name in names:
            files[f"docs/{name}.txt"] = f"{name}\n"
        instruction = "Rename every .txt file in docs/ to the same name ending in .md instead."
        check = (
            "".join(f'[ "$(cat docs/{n}.md)" = "{n}" ] || exit 1\n' for n in names) + "! ls docs/*.txt 2>/dev/null\n"
        )
        reference = 'for f in docs/*.txt; do mv "$f" "${f%.txt}.md"; done'
    elif kind == 3:
        modules = rng.sample(WORDS, 3)
        for name in modules:
            files[f"src/{name}.py"] = f"print({name!r})\n"
        instruction = (
            "Pack the folder src/ (with its path, src/...) into a gzip-compressed tar archive named src.tar.gz."
        )
        # grep without -q: an early exit would kill tar with SIGPIPE, a failure under pipefail
        check = "".join(f"tar -tzf src.tar.gz | grep -x 'src/{n}.py' > /dev/null || exit 1\n" for n in modules)
        reference = "tar -czf src.tar.gz src"
    else:
        rows = [(rng.choice(WORDS), rng.randint(-50, 500)) for _ in range(rng.randint(2, 12))]
        files["data.csv"] = "name,value\n" + "".join(f"{n},{v}\n" for n, v in rows)
        instruction = (
            "Write the sum of the value column of data.csv (it has a header row) to total.txt, just the number."
        )
        check = f'[ "$(tr -d "[:space:]" < total.txt)" = "{sum(v for _, v in rows)}" ]\n'
        reference = "awk -F, 'NR > 1 {s += $2} END {print s}' data.csv > total.txt"
    return files, {
        "id": f"terminal-{index}-{kind}",
        "instruction": instruction,
        "check": "set -e -o pipefail\ncd /work\n" + check,
        "workspace": str(folder),
        "reference": reference,
    }


def write_tasks(folder: str | None, count: int, seed: int = 0) -> list[dict]:
    """`count` tasks, their workspaces under `folder` (default: `default_folder`), written by
    `write_folder` (reused when there with these settings)."""
    root = Path(folder) if folder else default_folder("terminal", seed, count)
    rng = random.Random(seed)
    files: dict[str, str] = {}
    rows = []
    for i in range(count):
        workspace, row = task(root / f"{i:05d}", i, rng)
        files.update({f"{i:05d}/{rel}": text for rel, text in workspace.items()})
        rows.append(row)
    write_folder(root, files)
    return rows
