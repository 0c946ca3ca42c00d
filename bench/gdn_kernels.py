"""One Gated DeltaNet layer's rule, forward + backward, on one GPU, three ways on the same packed
row (documents of unequal lengths, starting mid-chunk):

- `fla`: flash-linear-attention's bf16 kernels, as the model runs them (gated_delta.py), with
  primerl's dq/dk/dg kernel where fla refuses its own (Hopper, 3.4 <= Triton < 3.7.1);
- `fla, its own dqkwg`: the same with fla's kernel for that step, its guard lifted (fla #640):
  what the refusal protects from;
- `torch fp32`: primerl's exact chunked form (gated_deltanet.gated_delta_rule), the reference.

Rows: ms forward + backward (median), and each output's largest error against the reference
over the reference's largest magnitude (o and the gradients of q, k, v, g, beta; the fla rows
take bf16 q, k, v, beta, the reference the same values in fp32).

    PYTHONPATH=packages/primerl-models/src:$FLA python bench/gdn_kernels.py --out gdn.json
"""

from __future__ import annotations

import argparse
import json

import torch
from attention import timed
from primerl_models.blocks.gated_deltanet import gated_delta_rule, l2norm, l2norm_rounded
from primerl_models.kernels import gated_delta
from primerl_models.packing import PackedSeqs

NAMES = ("o", "dq", "dk", "dv", "dg", "dbeta")


def inputs(lengths: list[int], key_heads: int, heads: int, dim: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    n = sum(lengths)
    q = torch.randn(n, key_heads, dim, device="cuda", generator=g).bfloat16()
    k = torch.randn(n, key_heads, dim, device="cuda", generator=g).bfloat16()
    v = torch.randn(n, heads, dim, device="cuda", generator=g).bfloat16()
    # Qwen3.5's decays: -exp(A_log) softplus(a + dt_bias), a few hundredths to a few units
    gate = -torch.nn.functional.softplus(torch.randn(n, heads, device="cuda", generator=g) - 2.0) * 2.0
    beta = torch.rand(n, heads, device="cuda", generator=g).bfloat16()
    pos = torch.cat([torch.arange(m) for m in lengths])[None].cuda()
    weights = torch.randn(n, heads, dim, device="cuda", generator=g).bfloat16()
    return (q, k, v, gate, beta), PackedSeqs.from_position_ids(pos), weights


def run_fla(x, seqs, weights, scale):
    leaves = [t.clone().requires_grad_() for t in x]
    q, k, *rest = leaves  # the norms as the model takes them: fp32, one rounding to bf16
    o = gated_delta.gated_delta_rule(l2norm_rounded(q), l2norm_rounded(k), *rest, seqs, scale)
    (o.float() * weights.float()).sum().backward()
    return [o.detach(), *(t.grad for t in leaves)]


def run_torch(x, seqs, weights, scale):
    leaves = [t.float().clone().requires_grad_() for t in x]
    q, k, v, g, beta = leaves
    rep = v.shape[1] // q.shape[1]
    qn = l2norm(q).repeat_interleave(rep, dim=1) * scale
    kn = l2norm(k).repeat_interleave(rep, dim=1)
    o = gated_delta_rule(qn, kn, v, g, beta, seqs)
    (o * weights.float()).sum().backward()
    return [o.detach(), *(t.grad for t in leaves)]


def errors(got, ref) -> dict:
    return {name: float((a.float() - b).abs().max() / b.abs().max()) for name, a, b in zip(NAMES, got, ref)}


def case(lengths, key_heads, heads, dim) -> list[dict]:
    x, seqs, weights = inputs(lengths, key_heads, heads, dim)
    scale = dim**-0.5
    ref = run_torch(x, seqs, weights, scale)
    shape = {"tokens": sum(lengths), "docs": lengths, "key_heads": key_heads, "heads": heads, "dim": dim}
    rows = [{**shape, "impl": "torch fp32", "ms": timed(lambda: run_torch(x, seqs, weights, scale)) * 1e3}]
    ours = run_fla(x, seqs, weights, scale)
    rows.append(
        {**shape, "impl": "fla", "ms": timed(lambda: run_fla(x, seqs, weights, scale)) * 1e3, **errors(ours, ref)}
    )
    if gated_delta.triton_miscompiles_dqkwg():
        import fla.ops.common.chunk_o as chunk_o

        gated_delta.REPLACE_DQKWG, lifted = False, chunk_o.TRITON_ABOVE_3_7_1
        chunk_o.TRITON_ABOVE_3_7_1 = True  # lifts fla's refusal, for this row only
        try:
            own = run_fla(x, seqs, weights, scale)
            # how far fla's own kernel lands from primerl's (0: the same bits)
            apart = {
                f"{n} vs primerl": float((a.float() - b.float()).abs().max() / b.float().abs().max())
                for n, a, b in zip(NAMES[1:], own[1:], ours[1:])
            }
            rows.append(
                {
                    **shape,
                    "impl": "fla, its own dqkwg",
                    "ms": timed(lambda: run_fla(x, seqs, weights, scale)) * 1e3,
                    **errors(own, ref),
                    **apart,
                }
            )
        finally:
            gated_delta.REPLACE_DQKWG, chunk_o.TRITON_ABOVE_3_7_1 = True, lifted
    for r in rows:
        print(json.dumps(r), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    assert gated_delta.available(), "flash-linear-attention (fla-core) is not importable"
    rows = case([5000, 3001, 6200, 2183], 16, 16, 128)  # Qwen3.5-0.8B's heads, 16k tokens
    rows += case([4000, 100, 4092], 16, 32, 128)  # Qwen3.5-35B-A3B's: two value heads per key head
    print(f"\n{'tokens':>6} {'heads':>6} {'impl':<20} {'ms':>7} " + " ".join(f"{n:>8}" for n in NAMES))
    for r in rows:
        errs = " ".join(f"{r[n]:>8.1e}" if n in r else f"{'ref':>8}" for n in NAMES)
        print(f"{r['tokens']:>6} {r['key_heads']:>3}/{r['heads']:<2} {r['impl']:<20} {r['ms']:>7.2f} {errs}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"rows": rows, "device": torch.cuda.get_device_name()}, f, indent=1)


if __name__ == "__main__":
    main()
