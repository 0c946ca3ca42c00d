"""Shared prompts (orchestrator.share_prompts): a trainer step on a group's prompt laid once
against the same samples laid whole, in the same run.

The step's samples are `--groups` groups of `--group-size` completions of `--completion` tokens
after one `--prompt`-token prompt each (random tokens). Both layouts go through the trainer's
own pieces: the orchestrator's packing (primerl_algos.packing: shared_prompts, plan_packing,
build_batches) into rows of `--seq` tokens, then per row the RL loss (primerl_trainer.rl.rl_loss:
the model's chunked logprobs, `trainer.attention = "auto"`: flex attention with the shared
prompts' block mask on GPUs, varlen for the whole samples; sdpa on CPU) and its backward. One
step = forward and backward over every row (no optimizer: it costs the same for both). Reported:
rows, trainer (row) tokens per step, the samples' tokens, median step time, and each layout's
time over the unshared one's.

    python bench/shared_prompt.py --model qwen3-0.6b                       # 2,048 + 16 x 512, on CUDA
    python bench/shared_prompt.py --model qwen3-1.7b --prompt 8192 --completion 1024 --seq 32768
    python bench/shared_prompt.py --model tiny --device cpu --prompt 64 --completion 16 --group-size 4 --seq 256

`--model`: a shape of bench/model_step.py's SHAPES (pure-attention ones: shared prompts are
refused for recurrent layers), or `tiny` (primerl's tiny Qwen3). Random weights; bf16 on CUDA,
fp32 on CPU (where timings mean little: it checks the code path).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from model_step import SHAPES, our_args  # noqa: E402  (shapes shared with the model benchmark)
from primerl_algos.config import LossConfig
from primerl_algos.losses import LossScale
from primerl_algos.packing import build_batches, plan_packing, shared_prompts
from primerl_algos.types import Sample
from primerl_models import Transformer
from primerl_models.families import FAMILIES, TinyShape
from primerl_trainer.rl import rl_loss


def model_args(name: str, layers: int | None):
    if name == "tiny":
        shape = TinyShape(
            vocab_size=512, hidden_size=64, num_layers=layers or 2, num_heads=4, num_kv_heads=2, head_dim=16
        )
        return FAMILIES["qwen3"].args_from_hf(FAMILIES["qwen3"].tiny_config(shape))
    if name not in SHAPES:
        raise SystemExit(
            f"--model {name!r} is neither 'tiny' nor one of bench/model_step.py's shapes: {', '.join(SHAPES)}"
        )
    return our_args(name, layers)


def step_samples(a, vocab: int) -> list[Sample]:
    """The step's samples: each group's prompt, then each completion (trained, advantage +-1)."""
    rng = np.random.default_rng(0)
    out = []
    for _ in range(a.groups):
        prompt = rng.integers(0, vocab, a.prompt).tolist()
        for _ in range(a.group_size):
            ids = prompt + rng.integers(0, vocab, a.completion).tolist()
            mask = [False] * a.prompt + [True] * a.completion
            logprobs = [-11.0 if m else 0.0 for m in mask]
            out.append(
                Sample(
                    sample_id=len(out),
                    token_ids=ids,
                    loss_mask=mask,
                    inference_logprobs=logprobs,
                    advantage=float(rng.choice([-1.0, 1.0])),
                )
            )
    return out


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def measure(model, samples: list[Sample], shared: bool, a, device: torch.device) -> dict:
    lengths = [len(s) for s in samples]
    plan = plan_packing(lengths, a.seq, shared=shared_prompts(samples, a.seq) if shared else ())
    (batch,) = build_batches(samples, plan, step=0)
    rows = batch.micro_batches
    loss_fn = rl_loss(LossConfig(), LossScale(tokens=batch.num_loss_tokens, sequences=batch.num_sequences), device)
    times = []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for i in range(a.warmup + a.steps):
        sync(device)
        t0 = time.perf_counter()
        for mb in rows:
            loss, _ = loss_fn(model, mb)
            loss.backward()
        sync(device)
        if i >= a.warmup:
            times.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
    return {
        "layout": "shared prompts" if shared else "whole samples",
        "rows": len(rows),
        "row_tokens": sum(mb.num_tokens for mb in rows),
        "sample_tokens": sum(lengths),
        "step_s": statistics.median(times),
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen3-0.6b", help="a bench/model_step.py shape, or 'tiny'")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default: the shape's)")
    p.add_argument("--prompt", type=int, default=2048, help="tokens of each group's prompt")
    p.add_argument("--completion", type=int, default=512, help="tokens of each completion")
    p.add_argument("--group-size", type=int, default=16, help="completions per prompt")
    p.add_argument("--groups", type=int, default=2, help="groups (prompts) per step")
    p.add_argument("--seq", type=int, default=16384, help="tokens per row (seq_len)")
    p.add_argument("--steps", type=int, default=5, help="timed steps (median reported)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (compilation)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    a = p.parse_args()
    device = torch.device(a.device)
    args = model_args(a.model, a.layers)
    if (problem := args.prompt_sharing_problem()) is not None:
        raise SystemExit(f"--model {a.model}: {problem}; shared prompts are for pure-attention models")
    torch.manual_seed(0)
    with torch.device(device):
        model = Transformer(args)
    model.init_weights()
    if device.type == "cuda":
        model.cast_parameters(torch.bfloat16)
    model.train()
    samples = step_samples(a, args.vocab_size)
    rows = [measure(model, samples, shared, a, device) for shared in (False, True)]
    base = rows[0]["step_s"]
    print(
        f"{a.model} ({args.num_layers} layers) on {a.device}: {a.groups} prompts of {a.prompt} tokens x "
        f"{a.group_size} completions of {a.completion}, rows of {a.seq}\n"
    )
    print("| layout | rows | trainer tokens/step | sample tokens/step | step (s) | time vs whole | peak GiB |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        peak = "-" if r["peak_gib"] is None else f"{r['peak_gib']:.1f}"
        print(
            f"| {r['layout']} | {r['rows']} | {r['row_tokens']:,} | {r['sample_tokens']:,} | {r['step_s']:.3f} "
            f"| {r['step_s'] / base:.2f}x | {peak} |"
        )


if __name__ == "__main__":
    main()
