"""Memory per rank of a model at several trainer layouts (trainer.parallel), computed by the
trainer's planner, primerl_trainer.plan.trainer_memory (its docstring: every part's formula,
derived from the code; bench/plan_check.py: its predictions against every peak measured on one
H200 in bench/results, all within 10%).

Per rank, with W ranks, one micro-batch row of R tokens split over cp ranks, activation
checkpointing on, at the step's peak moment:
  states       = fp32 weights, gradients made by then and AdamW's moments: 16 B x parameters / W
                 at most (FSDP2 shards everything over all ranks; experts over ep x the W / ep
                 holding them)
  weights held = FSDP2's bf16 copies: the root's (embedding, output head), the running and the
                 prefetched layer's, the layer's unsharded gradients and the reduce-scatter
                 buffers; experts counted / ep
  activations  = each layer's checkpointed input, the layer recomputed, the loss's logits chunk
                 and output-weight gradient, x R / cp for the per-token parts

    python bench/memory_layouts.py                 # the table of docs/trainer.md
    python bench/memory_layouts.py --model qwen3-30b-a3b --gpus 8
"""

from __future__ import annotations

import argparse

from model_step import our_args
from primerl_trainer.plan import GIB, TrainerLayout, trainer_memory


def per_rank(args, gpus: int, ep: int, cp: int, row_tokens: int) -> dict:
    mem = trainer_memory(
        args, TrainerLayout(world=gpus, ep=ep, cp=cp, row_tokens=row_tokens, activation_checkpointing=True)
    )
    p = mem.parts
    states = p["weights"] + p["grads"] + p["optimizer"]
    act = p["activations"] + p["logits"] + p["overhead"]
    return {
        "states": states / GIB,
        "held": p["gathered"] / GIB,
        "activations": act / GIB,
        "total": mem.peak / GIB,
        "phase": mem.phase,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen3-30b-a3b")
    p.add_argument("--gpus", type=int, default=8)
    a = p.parse_args()
    args = our_args(a.model)
    print(
        f"primerl_trainer.plan.trainer_memory, activation checkpointing on, one row per GPU; {a.model}: "
        f"{args.num_params() / 1e9:.2f}B parameters, {args.num_layers} layers\n"
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
        m = per_rank(args, gpus, ep, cp, row)
        fits = "" if m["total"] < 139 else " (over an H200's 139)"
        print(
            f"| {gpus} | {gpus // cp} | {cp} | {ep} | {row:,} | {m['states']:.1f} | {m['held']:.1f} | "
            f"{m['activations']:.1f} | {m['total']:.1f}{fits} |"
        )


if __name__ == "__main__":
    main()
