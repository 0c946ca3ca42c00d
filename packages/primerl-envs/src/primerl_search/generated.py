"""A generated corpus of made-up places and people, and questions whose answer is in one document.

Each town document states its region, founder and river; each person document their trade and
home town (so a person's document names a town whose own document holds other facts: the
distractors a search has to rank below the right one). Names are drawn from syllables without
repeats, so every answer is unique to its document. The corpus is written once and shared
(`primerl_envs.folders`).
"""

from __future__ import annotations

import random
from pathlib import Path

from primerl_envs.folders import default_folder, write_folder

SYLLABLES = ["zor", "qux", "bel", "ran", "tik", "mo", "lun", "vas", "pel", "dra", "ko", "sen", "fir", "ga", "hul"]
TRADES = ["weaver", "smith", "potter", "baker", "glassblower", "tanner", "cooper", "mason"]
REGIONS = ["the northern hills", "the salt coast", "the river plain", "the high forest", "the eastern marsh"]


def _names(rng: random.Random, count: int) -> list[str]:
    """`count` distinct names of 2-3 syllables (3,600 of them), or of 2 to N syllables when 2-3
    give fewer than twice `count` names: a draw is then new at least half the time, so any
    count ends, and a count up to 1,800 draws as it always has (the same data for a seed)."""
    longest = 3
    while sum(len(SYLLABLES) ** n for n in range(2, longest + 1)) < 2 * count:
        longest += 1
    seen: set[str] = set()
    while len(seen) < count:
        seen.add("".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, longest))).capitalize())
    return sorted(seen)


def write_corpus(folder: str | None, count: int, seed: int = 0) -> list[dict]:
    """`count` questions over a corpus in `folder` (default: `default_folder`), written by
    `write_folder` (reused when there with these settings)."""
    root = Path(folder) if folder else default_folder("search", seed, count)
    files: dict[str, str] = {}
    rng = random.Random(seed)
    towns_n = max(2, count // 2 + 1)
    names = _names(rng, 3 * towns_n + 2 * count)
    towns = [
        {"name": names.pop(), "founder": names.pop(), "river": names.pop(), "region": rng.choice(REGIONS)}
        for _ in range(towns_n)
    ]
    for t in towns:
        files[f"towns/{t['name'].lower()}.txt"] = (
            f"{t['name']}\n{t['name']} is a town in {t['region']}. It was founded by {t['founder']}, "
            f"and the {t['river']} river runs through it.\n"
        )
    people = []
    for _ in range(count):
        p = {"name": names.pop(), "trade": rng.choice(TRADES), "town": rng.choice(towns)["name"]}
        people.append(p)
        files[f"people/{p['name'].lower()}.txt"] = (
            f"{p['name']}\n{p['name']} is a {p['trade']} who lives in {p['town']}.\n"
        )
    rows = []
    for i in range(count):
        if i % 2 == 0:
            p = people[i]
            question, answer = f"What is the trade of {p['name']}?", p["trade"]
        else:
            t = towns[i % len(towns)]
            question, answer = f"Who founded the town of {t['name']}?", t["founder"]
        rows.append({"id": f"search-{i}", "question": question, "answers": [answer], "corpus": str(root)})
    write_folder(root, files)
    return rows
