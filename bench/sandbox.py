"""Code sandbox benchmark: what one episode's test run costs, bubblewrap sandbox vs the old one.

One episode = a typical correct submission (`count_vowels`) checked against 4 hidden tests, as
the `code` environment does it. Both sandboxes run the same submission on the same inputs:

  old     the pre-issue-16 sandbox (bench/_old_sandbox.py: `python -I -S` with rlimits and an
          audit hook; broken, kept only for this comparison), tests as assert snippets
  bwrap   primerl_code.sandbox: bubblewrap namespaces + seccomp + rlimits, tests as data

`--runs` sequential runs of each, interleaved so that machine noise hits both alike (after one
warm-up each), give the latency per episode; then `--runs` episodes at once, `--concurrency` in
flight, give the cost per episode when a training step checks many at a time.

    uv run python bench/sandbox.py [--runs 30] [--concurrency 8] [--out bench/results/sandbox.json]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from primerl_code.sandbox import HiddenTest, run_tests

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("_old_sandbox", ROOT / "bench/_old_sandbox.py")
old_sandbox = sys.modules["_old_sandbox"] = importlib.util.module_from_spec(_spec)  # dataclasses look it up
_spec.loader.exec_module(old_sandbox)

CODE = "def count_vowels(s):\n    return sum(c in 'aeiou' for c in s)\n"
INPUTS = ["aozyxo", "uizeoeb", "ozeobbuyz", "u"]
NEW_TESTS = [HiddenTest("count_vowels", [s], sum(c in "aeiou" for c in s)) for s in INPUTS]
OLD_TESTS = [f"assert count_vowels(*{(t.args[0],)!r}) == {t.expected!r}" for t in NEW_TESTS]
RUN = {
    "old": lambda: old_sandbox.run_tests(CODE, OLD_TESTS),
    "bwrap": lambda: run_tests(CODE, NEW_TESTS),
}


async def timed(name: str) -> float:
    """Milliseconds of one episode; every test must pass, or the comparison means nothing."""
    start = time.perf_counter()
    result = await RUN[name]()
    elapsed = (time.perf_counter() - start) * 1e3
    assert (result.passed, result.total) == (4, 4), f"{name}: {result}"
    return elapsed


async def concurrent(name: str, runs: int, concurrency: int) -> float:
    """Wall-clock milliseconds per episode of `runs` episodes, `concurrency` in flight."""
    gate = asyncio.Semaphore(concurrency)

    async def one() -> None:
        async with gate:
            await timed(name)

    start = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(runs)))
    return (time.perf_counter() - start) * 1e3 / runs


async def measure(runs: int, concurrency: int) -> dict:
    for name in RUN:
        await timed(name)  # warm-up: page cache, the bwrap probe
    sequential: dict[str, list[float]] = {name: [] for name in RUN}
    for _ in range(runs):
        for name in RUN:
            sequential[name].append(await timed(name))
    amortized = {name: await concurrent(name, runs, concurrency) for name in RUN}
    return {"sequential_ms": sequential, "concurrent_ms_per_episode": amortized}


def bwrap_version() -> str:
    try:
        return subprocess.run(["bwrap", "--version"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return "none"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=30, help="episodes per sandbox")
    parser.add_argument("--concurrency", type=int, default=8, help="episodes in flight in the concurrent pass")
    parser.add_argument("--out", default=str(ROOT / "bench/results/sandbox.json"))
    args = parser.parse_args()

    data = asyncio.run(measure(args.runs, args.concurrency))
    seq, conc = data["sequential_ms"], data["concurrent_ms_per_episode"]
    print(
        f"one episode = {len(INPUTS)} hidden tests of a correct submission; {args.runs} runs each, interleaved; "
        f"{os.cpu_count()} cores, {bwrap_version()}"
    )
    print(
        f"{'sandbox':<8} {'min ms':>8} {'median ms':>10} {'max ms':>8} {'vs old':>7}   "
        f"{'ms/episode at ' + str(args.concurrency) + ' in flight':>26} {'vs old':>7}"
    )
    base = statistics.median(seq["old"])
    for name in RUN:
        t = seq[name]
        print(
            f"{name:<8} {min(t):>8.1f} {statistics.median(t):>10.1f} {max(t):>8.1f} "
            f"{statistics.median(t) / base:>6.2f}x   {conc[name]:>26.1f} {conc[name] / conc['old']:>6.2f}x"
        )
    data.update(
        runs=args.runs,
        concurrency=args.concurrency,
        cores=os.cpu_count(),
        machine=platform.machine(),
        bwrap=bwrap_version(),
        median_ms={name: statistics.median(t) for name, t in seq.items()},
    )
    Path(args.out).write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
