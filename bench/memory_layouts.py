"""Memory per rank of a model at several trainer layouts (trainer.parallel), computed from its
shape and two constants measured on one H200 (bench/results/trainer-mesh-1gpu-2026-12-02.json,
bench/trainer_step.py with activation checkpointing):

- the bytes each parameter keeps (fp32 weight, fp32 gradient, AdamW's two fp32 moments): the
  difference of the peaks of the 6- and 3-layer Qwen3-30B-A3B cuts over the 3 layers'
  parameters (16 expected);
- the activation bytes per token of a checkpointed step: the slope of the peak from 4,096 to
  16,384 tokens (the same for 3 and 6 layers, so it is the one layer being recomputed plus the
  loss, not a per-layer cost).

Per rank, with W ranks, rows of R tokens split over cp ranks:
  states       = bytes/param x parameters / W     (FSDP2 shards everything over all ranks;
                                                   experts over ep x the W / ep holding them)
  weights held = bf16 copies all-gathered for the forward and backward: the root's (embedding,
                 output head) and two decoder layers' (the one running and the one prefetched),
                 plus one layer's bf16 gradient and its fp32 reduce-scatter copy; the experts
                 counted / ep                      (computed: one rank gathers nothing)
  activations  = (measured per-token bytes + the checkpointed input of every layer, bf16 D)
                 x R / cp                          (Ulysses keeps a rank's share at R / cp)

    python bench/memory_layouts.py                 # the table of docs/trainer.md
    python bench/memory_layouts.py --model qwen3-30b-a3b --gpus 8
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from model_step import our_args
from primerl_models import MoEMLP

CALIBRATION = Path(__file__).parent / "results" / "trainer-mesh-1gpu-2026-12-02.json"
GIB = 2**30


def measured() -> tuple[float, float]:
    """(state bytes per parameter, activation bytes per token) from the calibration runs."""
    rows = [
        r
        for r in json.loads(CALIBRATION.read_text())["rows"]
        if r["ac"] and r["rows_per_gpu"] == 1 and r.get("dp") == 1
    ]
    peak = {(r.get("layers") or 6, r["seq"]): r["peak_gib"] * GIB for r in rows}
    slopes = [(peak[(n, 16384)] - peak[(n, 4096)]) / (16384 - 4096) for n in (3, 6)]
    per_token = max(slopes)
    base = {n: peak[(n, 4096)] - 4096 * per_token for n in (3, 6)}
    three = our_args("qwen3-30b-a3b-6l", 6).num_params() - our_args("qwen3-30b-a3b-6l", 3).num_params()
    return (base[6] - base[3]) / three, per_token


def layer_params(layer, d: int) -> tuple[int, int]:
    """(dense, routed-expert) parameters of a decoder layer."""
    experts = 3 * layer.mlp.num_experts * d * layer.mlp.experts.size if isinstance(layer.mlp, MoEMLP) else 0
    return layer.num_params(d) - experts, experts


def per_rank(args, gpus: int, ep: int, cp: int, row_tokens: int, bytes_per_param: float, act_per_token: float) -> dict:
    d = args.hidden_size
    states = bytes_per_param * args.num_params() / gpus
    dense, experts = max((layer_params(layer, d) for layer in args.layers), key=lambda p: p[0] + p[1] / ep)
    local_layer = dense + experts / ep
    root = 2 * args.vocab_size * d  # embedding and output head
    held = 2 * (root + 2 * local_layer) + (2 + 4) * local_layer if gpus > 1 else 0.0
    act = (act_per_token + 2 * d * args.num_layers) * row_tokens / cp
    return {"states": states / GIB, "held": held / GIB, "activations": act / GIB, "total": (states + held + act) / GIB}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen3-30b-a3b")
    p.add_argument("--gpus", type=int, default=8)
    a = p.parse_args()
    args = our_args(a.model)
    bpp, apt = measured()
    print(
        f"measured on one H200: {bpp:.2f} bytes per parameter, {apt / 1024:.0f} KiB of activations per token "
        f"(checkpointed); {a.model}: {args.num_params() / 1e9:.2f}B parameters, {args.num_layers} layers\n"
    )
    print("| GPUs | dp | cp | ep | tokens per row | states | weights held | activations | total GiB per GPU |")
    print("|---|---|---|---|---|---|---|---|---|")
    layouts = [(1, 1, 1, 16384)] + [
        (a.gpus, cp, ep, row)
        for row, cp, ep in (
            (16384, 1, 1),
            (16384, 1, a.gpus),
            (65536, 1, a.gpus),
            (65536, 2, a.gpus),
            (262144, 1, a.gpus),
            (262144, 4, a.gpus),
            (262144, a.gpus, a.gpus),
        )
    ]
    for gpus, cp, ep, row in layouts:
        m = per_rank(args, gpus, ep, cp, row, bpp, apt)
        fits = "" if m["total"] < 139 else " (over an H200's 139)"
        print(
            f"| {gpus} | {gpus // cp} | {cp} | {ep} | {row:,} | {m['states']:.1f} | {m['held']:.1f} | "
            f"{m['activations']:.1f} | {m['total']:.1f}{fits} |"
        )


if __name__ == "__main__":
    main()
