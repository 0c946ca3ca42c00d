"""The DeltaNet conv + SiLU kernels (primerl_models/kernels/conv.py) on one GPU: forward and backward
times over tile sizes and warps, against flash-linear-attention's causal_conv1d (the reference,
same run, when fla is importable) and the memory traffic's floor.

Shape: Qwen3.5-0.8B's DeltaNet conv at 16,384 tokens (6,144 channels: q, k, v of 16 heads of
128, 4 taps), one packed row of 4 documents. Each row: ms forward, ms backward (the two kernels
and dw's sum), GB/s of the bytes each must move (forward: x read, y written; backward: x and dy
read, dx written, the pre-activation's gradient written and read back in its dtype), and the
largest difference from the first row's outputs (all rows compute the same thing).

    PYTHONPATH=packages/primerl-models/src:$FLA python bench/conv_kernels.py --out conv.json
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
from attention import timed
from primerl_models.kernels import conv


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--channels", type=int, default=6144)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    n, c, k = args.tokens, args.channels, 4
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(n, c, device="cuda", generator=g).bfloat16()
    w = torch.randn(c, k, device="cuda", generator=g) * 0.5
    dy = torch.randn(n, c, device="cuda", generator=g).bfloat16()
    bounds = torch.linspace(0, n, 5).long().tolist()
    pos = torch.cat([torch.arange(b - a) for a, b in zip(bounds, bounds[1:])]).cuda()
    elem = x.element_size()

    rows, first = [], None
    configs = [
        dict(BT=bt, BC=bc, num_warps=nw)
        for bt, bc, nw in itertools.product((32, 64, 128), (64, 128, 256), (4, 8))
        if bt * bc <= 16384 and bt * bc // (32 * nw) >= 8
    ]
    for cfg, da in itertools.product(configs, (torch.float32, torch.bfloat16)):
        y = conv.conv_forward(x, w, pos, **cfg)
        dx, dw = conv.conv_backward(dy, x, w, pos, **cfg, da_dtype=da)
        if first is None:
            first = (y, dx, dw)
        diff = max(
            float((a.float() - b.float()).abs().max() / b.float().abs().max()) for a, b in zip((y, dx, dw), first)
        )
        t_f = timed(lambda: conv.conv_forward(x, w, pos, **cfg), reps=20)
        t_b = timed(lambda: conv.conv_backward(dy, x, w, pos, **cfg, da_dtype=da), reps=20)
        fwd_bytes = 2 * n * c * elem
        bwd_bytes = 3 * n * c * elem + 2 * n * c * torch.finfo(da).bits // 8
        rows.append(
            dict(
                impl="primerl",
                **cfg,
                da=str(da).split(".")[-1],
                fwd_ms=t_f * 1e3,
                bwd_ms=t_b * 1e3,
                fwd_gbs=fwd_bytes / t_f / 1e9,
                bwd_gbs=bwd_bytes / t_b / 1e9,
                rel_diff=diff,
            )
        )
        print(json.dumps(rows[-1]), flush=True)

    try:
        from fla.modules.causal_conv1d import causal_conv1d
    except ImportError:
        causal_conv1d = None
    if causal_conv1d is not None:
        cu = torch.tensor(bounds, device="cuda")
        xf, wf = x[None].clone().requires_grad_(), w.bfloat16().clone().requires_grad_()

        def fla_forward():
            return causal_conv1d(xf, wf, activation="silu", cu_seqlens=cu)[0]

        def fla_both():
            fla_forward().backward(dy[None])

        t_f, t_fb = timed(fla_forward, reps=20), timed(fla_both, reps=20)
        rows.append(dict(impl="fla causal_conv1d", fwd_ms=t_f * 1e3, bwd_ms=(t_fb - t_f) * 1e3))
        print(json.dumps(rows[-1]), flush=True)

    print(
        f"\n{n} tokens x {c} channels, {k} taps, bf16 x/y; floor at 4.0 TB/s: forward "
        f"{2 * n * c * elem / 4e12 * 1e3:.3f} ms, backward {3 * n * c * elem / 4e12 * 1e3:.3f} ms (no da round trip)"
    )
    print(
        f"{'impl':<18} {'BT':>4} {'BC':>4} {'warps':>5} {'da':<9} {'fwd ms':>7} {'bwd ms':>7} {'fwd GB/s':>9} "
        f"{'bwd GB/s':>9} {'rel diff':>9}"
    )
    for r in sorted(rows, key=lambda r: r["fwd_ms"] + r["bwd_ms"])[:25]:
        print(
            f"{r['impl']:<18} {r.get('BT', '-'):>4} {r.get('BC', '-'):>4} {r.get('num_warps', '-'):>5} "
            f"{r.get('da', '-'):<9} {r['fwd_ms']:>7.3f} {r['bwd_ms']:>7.3f} {r.get('fwd_gbs', 0):>9.0f} "
            f"{r.get('bwd_gbs', 0):>9.0f} {r.get('rel_diff', 0):>9.1e}"
        )
    best_f = min((r for r in rows if r["impl"] == "primerl"), key=lambda r: r["fwd_ms"])
    best_b = min((r for r in rows if r["impl"] == "primerl" and r["da"] == "float32"), key=lambda r: r["bwd_ms"])
    print(
        f"fastest forward: BT={best_f['BT']} BC={best_f['BC']} warps={best_f['num_warps']} {best_f['fwd_ms']:.3f} ms; "
        f"fastest fp32-da backward: BT={best_b['BT']} BC={best_b['BC']} warps={best_b['num_warps']} "
        f"{best_b['bwd_ms']:.3f} ms"
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
