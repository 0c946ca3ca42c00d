"""Small generated terminal tasks: jobs over generated files, each with a check and a reference.

Five kinds (counting lines, distinct sorted lines, renaming files, packing a folder, summing a
column), their files drawn from a seeded generator; the check compares against the answer
computed here, in Python, never by running the reference.
"""

from __future__ import annotations

import random
import shutil
import tempfile
from pathlib import Path

WORDS = ["ant", "bee", "cat", "dog", "eel", "fox", "gnu", "hen", "ibis", "jay", "koi", "lynx"]


def _lines(rng: random.Random, n: int) -> list[str]:
    return [rng.choice(WORDS) for _ in range(n)]


def _expect_file(path: str, content: str) -> str:
    """A check that `path` holds exactly `content` (a trailing newline either way)."""
    return f"printf '%s\\n' {_quote_lines(content)} | diff -q - <(sed -e '$a\\' {path}) >/dev/null\n"


def _quote_lines(content: str) -> str:
    return " ".join("'" + line.replace("'", "'\\''") + "'" for line in content.splitlines())


def task(folder: Path, index: int, rng: random.Random) -> dict:
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    kind = index % 5
    if kind == 0:
        lines = _lines(rng, rng.randint(3, 40))
        (folder / "data.txt").write_text("\n".join(lines) + "\n")
        instruction = "Write the number of lines of data.txt (just the number) to count.txt."
        check = f'[ "$(tr -d "[:space:]" < count.txt)" = "{len(lines)}" ]\n'
        reference = "wc -l < data.txt > count.txt"
    elif kind == 1:
        lines = _lines(rng, rng.randint(5, 30))
        (folder / "names.txt").write_text("\n".join(lines) + "\n")
        instruction = "Write the distinct lines of names.txt, sorted alphabetically, one per line, to sorted.txt."
        check = _expect_file("sorted.txt", "\n".join(sorted(set(lines))))
        reference = "sort -u names.txt > sorted.txt"
    elif kind == 2:
        names = rng.sample(WORDS, rng.randint(2, 5))
        (folder / "docs").mkdir()
        for name in names:
            (folder / "docs" / f"{name}.txt").write_text(f"{name}\n")
        instruction = "Rename every .txt file in docs/ to the same name ending in .md instead."
        check = (
            "".join(f'[ "$(cat docs/{n}.md)" = "{n}" ] || exit 1\n' for n in names) + "! ls docs/*.txt 2>/dev/null\n"
        )
        reference = 'for f in docs/*.txt; do mv "$f" "${f%.txt}.md"; done'
    elif kind == 3:
        (folder / "src").mkdir()
        files = rng.sample(WORDS, 3)
        for name in files:
            (folder / "src" / f"{name}.py").write_text(f"print({name!r})\n")
        instruction = (
            "Pack the folder src/ (with its path, src/...) into a gzip-compressed tar archive named src.tar.gz."
        )
        # grep without -q: an early exit would kill tar with SIGPIPE, a failure under pipefail
        check = "".join(f"tar -tzf src.tar.gz | grep -x 'src/{n}.py' > /dev/null || exit 1\n" for n in files)
        reference = "tar -czf src.tar.gz src"
    else:
        rows = [(rng.choice(WORDS), rng.randint(-50, 500)) for _ in range(rng.randint(2, 12))]
        (folder / "data.csv").write_text("name,value\n" + "".join(f"{n},{v}\n" for n, v in rows))
        instruction = (
            "Write the sum of the value column of data.csv (it has a header row) to total.txt, just the number."
        )
        check = f'[ "$(tr -d "[:space:]" < total.txt)" = "{sum(v for _, v in rows)}" ]\n'
        reference = "awk -F, 'NR > 1 {s += $2} END {print s}' data.csv > total.txt"
    return {
        "id": f"terminal-{index}-{kind}",
        "instruction": instruction,
        "check": "set -e -o pipefail\ncd /work\n" + check,
        "workspace": str(folder),
        "reference": reference,
    }


def write_tasks(folder: str | None, count: int, seed: int = 0) -> list[dict]:
    root = Path(folder) if folder else Path(tempfile.gettempdir()) / f"primerl-terminal-{seed}"
    rng = random.Random(seed)
    return [task(root / f"{i:05d}", i, rng) for i in range(count)]
