"""Attention back-ends on one GPU: causal forward + backward at training shapes.

Reference: torch SDPA with its default back-end choice (flash), measured in the same run.

    python bench/attention.py --seq 16384 --heads 16 --kv-heads 8 --docs 1,8
"""

from __future__ import annotations

import argparse
import statistics

import torch
from primerl_models import PackedSeqs, attention
from torch.nn.attention import SDPBackend, sdpa_kernel


def timed(fn, reps: int = 10) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seq", type=int, default=16384)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--docs", default="1,8")
    a = p.parse_args()
    t, h, g, k = a.seq, a.heads, a.kv_heads, a.head_dim
    q = torch.randn(1, t, h, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    kk = torch.randn(1, t, g, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1, t, g, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    print(f"{'docs':>4} {'backend':<14} {'ms fwd+bwd':>10} {'TFLOP/s':>8} {'vs sdpa-default':>15}")
    for docs in [int(d) for d in a.docs.split(",")]:
        bounds = torch.linspace(0, t, docs + 1).long().tolist()
        pos = torch.cat([torch.arange(e - s) for s, e in zip(bounds, bounds[1:])])[None].cuda()
        seqs = PackedSeqs.from_position_ids(pos)
        lens = [e - s for s, e in zip(bounds, bounds[1:])]
        flops = 6 * h * k * sum(n * n for n in lens)  # causal: 2 T^2 H K forward, x3 with backward

        def run(backend, ctx=None):
            def fn():
                if ctx is None:
                    out = attention(q, kk, v, seqs, backend)
                else:
                    with sdpa_kernel(ctx):
                        out = attention(q, kk, v, seqs, backend)
                out.sum().backward()

            return fn

        candidates = {"sdpa-default": run("sdpa")}
        if docs == 1:
            candidates["sdpa-cudnn"] = run("sdpa", [SDPBackend.CUDNN_ATTENTION])
            candidates["sdpa-flash"] = run("sdpa", [SDPBackend.FLASH_ATTENTION])
        else:
            candidates.pop("sdpa-default")  # a dense T x T mask: not a contender at this size
        candidates["varlen"] = run("varlen")
        candidates["flex"] = run("flex")
        ref = None
        for name, fn in candidates.items():
            try:
                s = timed(fn)
            except Exception as err:  # report and go on: a back-end may not exist on this torch
                print(f"{docs:>4} {name:<14} failed: {type(err).__name__}: {str(err)[:100]}")
                continue
            ref = ref or s
            print(f"{docs:>4} {name:<14} {s * 1e3:>10.2f} {flops / s / 1e12:>8.0f} {ref / s:>14.2f}x")


if __name__ == "__main__":
    main()
