"""The chunk-state scan (primerl_models/kernels/state_scan.py) on one GPU: the Triton kernel
under each setting of SCAN_TUNING against the loop of batched matmuls it replaces (the CPU
path, run on the GPU here), same inputs, same run; and the error of each against an fp64 loop.

Then the whole Gated DeltaNet rule (forward + backward) of one layer, with the share of its
time each kernel takes.

    python bench/scan_kernel.py --heads 16 --tokens 16384 --out scan.json

Rows: setting, ms forward (reverse=False), ms backward-shaped (reverse, transposed), max
error / max |y|. Needs a GPU; PYTHONPATH=packages/primerl-models/src.
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
from attention import timed as attention_timed
from primerl_models.blocks.recurrent import CHUNK
from primerl_models.kernels import state_scan


def timed(fn, reps: int = 20) -> float:
    """Median ms of `fn` (bench/attention.py's timer, which gives seconds)."""
    return attention_timed(fn, reps) * 1e3


def scan_rows(heads: int, chunks: int, dim: int) -> list[dict]:
    g = torch.Generator(device="cuda").manual_seed(0)
    # transitions like the delta rule's: contractions (decay times I minus a low-rank part)
    a = (
        0.9 * torch.eye(dim, device="cuda")
        - 0.1 * torch.randn(heads, chunks, dim, dim, device="cuda", generator=g) / dim**0.5
    )
    x = torch.randn(heads, chunks, dim, dim, device="cuda", generator=g)
    keep = torch.ones(chunks, device="cuda")
    keep[:: max(chunks // 4, 1)] = 0.0  # four documents
    refs = {d: state_scan._scan_loop(a.double(), x.double(), keep.double(), *d) for d in ((False, False), (True, True))}
    rows = []

    def row(name, scan):
        out = {"setting": name}
        for label, d in (("fwd", (False, False)), ("bwd", (True, True))):
            out[f"{label}_ms"] = timed(lambda: scan(a, x, keep, *d))
            ref = refs[d]
            out[f"{label}_rel_err"] = float((scan(a, x, keep, *d).double() - ref).abs().max() / ref.abs().max())
        rows.append(out)
        print(json.dumps(out), flush=True)

    row("loop (reference)", state_scan._scan_loop)
    settings = [*itertools.product((16, 32), (4, 8), (1, 2), ("tf32x3",)), (16, 8, 2, "ieee"), (32, 8, 2, "ieee")]
    for bv, warps, stages, precision in settings:
        state_scan.SCAN_TUNING.update(bv=bv, num_warps=warps, stages=stages, precision=precision)
        try:
            row(f"bv{bv} w{warps} s{stages} {precision}", state_scan._scan)
        except Exception as err:  # a setting the compiler refuses (shared memory) is a row too
            rows.append({"setting": f"bv{bv} w{warps} s{stages} {precision}", "error": str(err)[:200]})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def rule_profile(heads: int, tokens: int, dim: int, tf32: bool) -> dict:
    """One layer's gated delta rule, forward + backward, four documents: ms, and its top kernels
    (`tf32`: the chunks' fp32 matmuls on TF32 tensor cores, torch's global switch)."""
    torch.backends.cuda.matmul.allow_tf32 = tf32
    from primerl_models.blocks.gated_deltanet import gated_delta_rule, l2norm
    from primerl_models.packing import PackedSeqs
    from torch.profiler import ProfilerActivity, profile

    g = torch.Generator(device="cuda").manual_seed(1)
    q, k = (l2norm(torch.randn(tokens, heads, dim, device="cuda", generator=g)) for _ in range(2))
    v = torch.randn(tokens, heads, dim, device="cuda", generator=g)
    gate = -torch.rand(tokens, heads, device="cuda", generator=g)
    beta = torch.rand(tokens, heads, device="cuda", generator=g)
    for t in (q, k, v, gate, beta):
        t.requires_grad_(True)
    pos = torch.cat([torch.arange(tokens // 4)] * 4)[None].cuda()
    seqs = PackedSeqs.from_position_ids(pos)

    def step():
        o = gated_delta_rule(q * dim**-0.5, k, v, gate, beta, seqs)
        o.square().sum().backward()

    ms = timed(step, reps=10)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70)
    print(f"gated_delta_rule fwd+bwd, {heads} heads, {tokens} tokens, tf32 {tf32}: {ms:.2f} ms\n{table}", flush=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    return {"rule_ms": ms, "heads": heads, "tokens": tokens, "tf32": tf32}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rows = scan_rows(args.heads, args.tokens // CHUNK, args.dim)
    best = min(
        (r for r in rows[1:] if "fwd_ms" in r and r["fwd_rel_err"] < 1e-5), key=lambda r: r["fwd_ms"] + r["bwd_ms"]
    )
    print(
        f"\nbest: {best['setting']}: {rows[0]['fwd_ms'] / best['fwd_ms']:.1f}x the loop forward, "
        f"{rows[0]['bwd_ms'] / best['bwd_ms']:.1f}x backward"
    )
    bv, warps, stages, precision = best["setting"].split()
    state_scan.SCAN_TUNING.update(bv=int(bv[2:]), num_warps=int(warps[1:]), stages=int(stages[1:]), precision=precision)
    rule = [rule_profile(args.heads, args.tokens, args.dim, tf32) for tf32 in (False, True)]
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"scan": rows, "best": best, "rule": rule, "device": torch.cuda.get_device_name()}, f, indent=1)


if __name__ == "__main__":
    main()
