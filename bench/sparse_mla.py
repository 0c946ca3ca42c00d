"""GLM-5's attention block (MLA + DSA, blocks/mla.py) on one GPU: forward + backward of the
block at its real head and latent sizes, one packed row, against the other ways to run it.

    python bench/sparse_mla.py --seq 16384 --out bench/results/glm5-sparse-mla.json

Runs (each the whole block: projections, indexer and top-k, attention, o_proj; bf16 autocast
over fp32 weights):
- sparse:  ours, the absorbed form over the gathered latent rows of the selected keys, by the
           Triton kernels (kernels/sparse_mla.py);
- sparse-split, sparse-stored, sparse-one-pass: the same with the kernels' backward in that
           form (kernels.BACKWARD_FORM; "sparse" runs the default);
- sparse-torch: the same by the chunked torch `_SparseMLA` (the CPU path);
- oracle:  ours, every head's keys and values under a dense [T, T] mask of the selection (SDPA);
- flex:    the same selection as flex attention's block mask (the blocks any query of a block
           selects, a mask_mod reading the [T, T] selection) over every head's own q, k, v: the
           other GPU route the issue names, built here for the measurement only.
"kernels" times the sparse MLA kernels alone on the indexer's selection (inputs of the block's
sizes, bf16): the forward, each backward form whole, and the split and stored forms' dq pass (no
atomic adds) and key-gradient pass (one atomic add per query and key) apart.
"indexer" times the indexer and its top-k alone (forward; it is not differentiated), by the
Triton kernel (kernels/dsa_index.py, bf16 dots); "indexer-torch" by the torch forms (fp32).
Attention TFLOP/s count 6 (qk + v) H FLOPs per selected (query, key) pair, the model's FLOPs
(args.MLA.mixing_flops without the indexer), whatever a path computes.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from primerl_models import PackedSeqs
from primerl_models.args import MLA, DSAIndexer, Rope
from primerl_models.blocks import mla
from primerl_models.blocks.rope import apply_rope, inv_freq, rope_cos_sin
from primerl_models.kernels import sparse_mla as kernels

CUDA = "cuda"


def timed(fn, reps: int) -> float:
    for _ in range(2):
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


def glm5_spec(topk: int) -> MLA:
    """zai-org/GLM-5's attention (transformers 5.19's GlmMoeDsaConfig defaults, which are its)."""
    return MLA(
        num_heads=64,
        q_lora_rank=2048,
        kv_lora_rank=512,
        qk_nope_head_dim=192,
        qk_rope_head_dim=64,
        v_head_dim=256,
        rope=Rope(rotary_dim=64, theta=1e6, interleaved=True),
        indexer=DSAIndexer(num_heads=32, head_dim=128, topk=topk),
    )


def flex_block(block: mla.MLAttention, chosen: mla.Selection):
    """The block's attention through flex attention with the selection as its block mask."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    assert chosen.index_BCS is not None and chosen.valid_BCS is not None
    t = chosen.index_BCS.shape[1]
    sel = torch.zeros(t, t, dtype=torch.long, device=CUDA)
    sel = sel.scatter_add(-1, chosen.index_BCS[0], chosen.valid_BCS[0].long()) > 0

    def mask_mod(b, h, q, kv):
        return sel[q, kv]

    block_mask = create_block_mask(mask_mod, None, None, t, t, device=CUDA)
    attend = torch.compile(flex_attention)
    spec = block.spec
    h, nope, rope_dim, lat = spec.num_heads, spec.qk_nope_head_dim, spec.qk_rope_head_dim, spec.kv_lora_rank

    def forward(x, cos, sin):
        b = x.shape[0]
        q = block.q_b_proj(block.q_a_layernorm(block.q_a_proj(x))).view(b, t, h, -1)
        q_nope, q_rope = q.split([nope, rope_dim], dim=-1)
        latent, k_rope = block.kv_a_proj_with_mqa(x).split([lat, rope_dim], dim=-1)
        k_nope, v = block.kv_b_proj(block.kv_a_layernorm(latent)).view(b, t, h, -1).split([nope, spec.v_head_dim], -1)
        q_rope = apply_rope(q_rope, cos, sin, interleaved=True)
        k_rope = apply_rope(k_rope[:, :, None], cos, sin, interleaved=True).expand(b, t, h, rope_dim)
        qq, kk, vv = (y.transpose(1, 2) for y in (torch.cat([q_nope, q_rope], -1), torch.cat([k_nope, k_rope], -1), v))
        out = attend(qq, kk.to(qq.dtype), vv, block_mask=block_mask, scale=spec.scale)
        return block.o_proj(out.transpose(1, 2).reshape(b, t, -1))

    return forward, float(block_mask.sparsity())


def kernel_times(spec: MLA, chosen: mla.Selection, reps: int) -> dict[str, float]:
    """Seconds of each sparse MLA kernel alone on this selection (random bf16 q, kv and dout)."""
    assert chosen.index_BCS is not None and chosen.valid_BCS is not None
    index, valid = chosen.index_BCS.contiguous(), chosen.valid_BCS.contiguous()
    b, t, _ = index.shape
    lat, x_dim = spec.kv_lora_rank, spec.kv_lora_rank + spec.qk_rope_head_dim
    q = torch.randn(b, t, spec.num_heads, x_dim, device=CUDA, dtype=torch.bfloat16)
    kv = torch.randn(b, t, x_dim, device=CUDA, dtype=torch.bfloat16)
    dout = torch.randn(b, t, spec.num_heads, lat, device=CUDA, dtype=torch.bfloat16)
    scale = spec.scale
    out, lse = kernels.sparse_mla_forward(q, kv, index, valid, scale, lat)
    form = kernels.BACKWARD_FORM

    def backward(form_now: str, passes=(True, True)):
        kernels.BACKWARD_FORM = form_now
        try:
            kernels.sparse_mla_backward(dout, q, kv, index, valid, out, lse, scale, passes=passes)
        finally:
            kernels.BACKWARD_FORM = form

    times = {"forward_s": timed(lambda: kernels.sparse_mla_forward(q, kv, index, valid, scale, lat), reps)}
    for name in ("one-pass", "split", "stored"):
        times[f"backward_{name}_s"] = timed(lambda: backward(name), reps)
    for name in ("split", "stored"):
        times[f"backward_{name}_dq_pass_s"] = timed(lambda: backward(name, (True, False)), reps)
        times[f"backward_{name}_dkv_pass_s"] = timed(lambda: backward(name, (False, True)), reps)
    for which, (heads, keys, warps, stages) in OTHER_TILES:  # a pass at other tiles (no launch: printed)
        attr = "BACKWARD_DKV_STORED"
        default = getattr(kernels, attr)
        setattr(kernels, attr, kernels.Tiles(BLOCK_H=heads, BLOCK_S=keys, num_warps=warps, num_stages=stages))
        name = f"backward_{which}_dkv_pass_s{keys}_w{warps}_st{stages}_s"
        try:
            times[name] = timed(lambda: backward(which, (False, True)), reps)
        except Exception as e:  # out of shared memory or registers: say so, go on
            print(f"{name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
        finally:
            setattr(kernels, attr, default)
    return times


OTHER_TILES = [
    ("stored", (64, 16, 8, 1)),
    ("stored", (64, 64, 8, 1)),
    ("stored", (64, 32, 4, 1)),
    ("stored", (64, 32, 8, 2)),
]
"""The stored form's key-gradient pass at other (BLOCK_H, BLOCK_S, warps, stages), which the
"kernels" run also times."""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq", type=int, default=16384)
    parser.add_argument("--topk", type=int, default=2048)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--runs", default="indexer,sparse,sparse-torch,flex,oracle")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    spec = glm5_spec(args.topk)
    dim, t = 6144, args.seq
    block = mla.MLAttention(spec, dim=dim, eps=1e-6).to(CUDA)
    for p in block.indexer.parameters() if block.indexer is not None else []:
        p.requires_grad_(False)
    pos = torch.arange(t, device=CUDA)[None]
    cos, sin = rope_cos_sin(pos, inv_freq(spec.rope), interleaved=True)
    x = torch.randn(1, t, dim, device=CUDA, requires_grad=True)
    pairs = sum(min(i + 1, args.topk) for i in range(t))
    attn_flops = 6 * spec.num_heads * (spec.qk_head_dim + spec.v_head_dim) * pairs
    rows = []
    form_default = kernels.BACKWARD_FORM

    def step(forward):
        with torch.autocast(CUDA, dtype=torch.bfloat16):
            out = forward()
        out.float().square().mean().backward()

    for run in args.runs.split(","):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        row: dict = {"run": run, "seq": t, "topk": args.topk}
        try:
            if run in ("indexer", "indexer-torch"):
                mla.INDEX_KERNEL = run == "indexer"
                with torch.no_grad(), torch.autocast(CUDA, dtype=torch.bfloat16):
                    q_latent = block.q_a_layernorm(block.q_a_proj(x))
                    seqs = PackedSeqs.from_position_ids(pos)
                    row["s"] = timed(lambda: block._choose(x, q_latent, cos, sin, seqs, 0, None, True), args.reps)
                mla.INDEX_KERNEL = True
            elif run in ("sparse", "sparse-one-pass", "sparse-split", "sparse-stored", "sparse-torch", "oracle"):
                mla.FAST_PATH, mla.KERNEL = run != "oracle", run.startswith("sparse") and run != "sparse-torch"
                if run in ("sparse-one-pass", "sparse-split", "sparse-stored"):
                    kernels.BACKWARD_FORM = run.removeprefix("sparse-")
                row["s"] = timed(
                    lambda: step(lambda: block(x, cos, sin, PackedSeqs.from_position_ids(pos), "auto")), args.reps
                )
                mla.FAST_PATH = mla.KERNEL = True
                kernels.BACKWARD_FORM = form_default
            elif run == "kernels":
                with torch.no_grad(), torch.autocast(CUDA, dtype=torch.bfloat16):
                    q_latent = block.q_a_layernorm(block.q_a_proj(x))
                    chosen = block._choose(x, q_latent, cos, sin, PackedSeqs.from_position_ids(pos), 0, None, True)
                row |= kernel_times(spec, chosen, args.reps)
            elif run == "flex":
                with torch.no_grad(), torch.autocast(CUDA, dtype=torch.bfloat16):
                    q_latent = block.q_a_layernorm(block.q_a_proj(x))
                    chosen = block._choose(x, q_latent, cos, sin, PackedSeqs.from_position_ids(pos), 0, None, True)
                forward, sparsity = flex_block(block, chosen)
                row["block_mask_sparsity"] = sparsity
                row["s"] = timed(lambda: step(lambda: forward(x, cos, sin)), args.reps)
            row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
            if not run.startswith("indexer") and "s" in row:
                row["attn_tflops_counted"] = attn_flops / row["s"] / 1e12
        except torch.OutOfMemoryError:
            row["oom"] = True
        except Exception as e:  # a path that cannot run at this shape: say why, go on
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        print(json.dumps(row), flush=True)
        rows.append(row)
    print(f"\n{'run':<18} {'ms':>8} {'attn TFLOP/s':>13} {'peak GiB':>9}")
    for r in rows:
        if r["run"] == "kernels" and "forward_s" in r:
            print("kernels: " + ", ".join(f"{k[:-2]} {v * 1e3:.1f} ms" for k, v in r.items() if k.endswith("_s")))
        elif "s" in r:
            print(f"{r['run']:<18} {r['s'] * 1e3:>8.1f} {r.get('attn_tflops_counted', 0):>13.0f} {r['peak_gib']:>9.1f}")
        else:
            print(f"{r['run']:<18} {'OOM' if r.get('oom') else r.get('error', '')[:60]}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
