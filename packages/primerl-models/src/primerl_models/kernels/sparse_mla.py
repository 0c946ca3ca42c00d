"""GLM-5's sparse absorbed MLA attention as Triton kernels, forward and backward: the CUDA path
of blocks/mla.py's `sparse_mla`, replacing the chunked torch `_SparseMLA` there (which stays the
CPU path and the reference: the same contract and the same roundings, in another order):

    out_BCHL = sparse_mla_triton(q_BCHX, kv_BTX, index_BCS, valid_BCS, scale, v_dim=L)
    out[b, t, h] = sum_s softmax_s(q[b, t, h] . kv[b, idx[b, t, s]] * scale) kv[b, idx[b, t, s], :L]

over the valid slots s (an invalid slot's index is padding and is never read); lse [B, C, H]
(fp32, natural log) is kept for the backward. All heads of a query read the same selected rows,
so a program takes one query token and a block of its heads, and walks the query's S selected
keys BLOCK_S at a time, gathering each block's rows once for all its heads:

- forward, grid (C, cdiv(H, BLOCK_H), B): the program holds its heads' query [BLOCK_H, X] (as a
  latent part [BLOCK_H, BLOCK_L] and a rope part [BLOCK_H, BLOCK_R]), the running max and sum of
  an online softmax (base 2), and the output accumulator [BLOCK_H, BLOCK_L] fp32. Per block of
  keys: scores = q_l k_l^T + q_r k_r^T (fp32), p = exp2(scores - max), acc += p k_l.
- backward, the same grid at the backward's BLOCK_H: the program holds q, dO and the rows of
  O it needs for delta = sum(dO * O), and dq [BLOCK_H, X] fp32. Per block of keys it recomputes
  p = exp(scores - lse), dp = dO k_l^T, ds = p (dp - delta) scale; dq += ds k; the block's key
  gradient ds^T q (+ p^T dO on the first L columns) goes to an fp32 [B, T, X] buffer by atomic
  adds (many queries select the same key), cast to kv's dtype at the end.

Non-power-of-two sizes are padded with masks (heads to at least 16 and R to at least 16, the
smallest dot Triton takes). bf16 (or fp16) inputs take bf16 dots with fp32 accumulators, p and ds
rounded to the input dtype before their products as in `_SparseMLA`; fp32 inputs take exact fp32
("ieee") dots. Legend: B batch, C query tokens, T key tokens, H heads, L latent (value) width,
R rope width, X = L + R, S selected keys per query.
"""

from __future__ import annotations

import functools
import math
from typing import Any, TypedDict

import torch

from primerl_models.kernels import compiler_disabled


class Tiles(TypedDict):
    BLOCK_H: int
    BLOCK_S: int
    num_warps: int
    num_stages: int


FORWARD = Tiles(BLOCK_H=64, BLOCK_S=64, num_warps=8, num_stages=2)
BACKWARD = Tiles(BLOCK_H=32, BLOCK_S=32, num_warps=8, num_stages=1)
"""Heads and keys per step, warps and pipelining depth of the forward and of the backward (BLOCK_H
is capped at H rounded up to a power of two, at least 16). At GLM-5's size (H 64, L 512, R 64, bf16;
sm_90 builds read with cuobjdump, times on an H100 at S 2048, 4,096 queries and keys):
- forward: 4.3 ms (6.9 at BLOCK_S 32 with 3 stages, 5.0 at 64 with 3; the torch _SparseMLA 26).
  Its program holds the [64, 512] fp32 accumulator in registers (128 a thread at 8 warps; 255 used,
  88 bytes spilled) and, in shared memory, the query (72 KB) and two cp.async stages of gathered
  rows (2 x 72 KB): 216 KB of the 227 KB a block may have. 17 ms at 16,384 queries.
- backward: 35 ms (BLOCK_S 16: 47; BLOCK_H 16 with 4 warps: 58; the torch backward ~107). dq
  [32, 576] and one block's key gradient [32, 576] (fp32) in registers (255, 136 bytes spilled);
  q and dO twice each (the two operand layouts of the mma.sync dots) and the rows: 184 KB. At
  BLOCK_H 64 or BLOCK_S 64 the shared memory passes 260 KB (no launch). 155 ms at 16,384 queries,
  where the key gradient's atomic adds (vectorized, 4 floats each) dominate."""

BACKWARD_FORM = "stored"
"""How the backward runs:
- "one-pass": `_backward` at BACKWARD, dq and the key gradient together, an atomic add per key
  for each block of heads (two at GLM-5's 64 heads at BLOCK_H 32).
- "split": dq first (`_backward` without the key gradient, at BACKWARD_DQ: no atomics), then the
  key gradient with one program a query summing every head's share before its atomic adds
  (`_backward_dkv` at BACKWARD_DKV, the scores and dp recomputed once more).
- "stored": the dq pass also writes the p and ds it rounds (bf16, [2, B, chunk, H, S] for a
  chunk of queries at a time, STORED_BYTES at most), and `_backward_dkv_stored` reads them: the
  key gradient's three dots and its atomic adds only, every head of a query in one program
  (BLOCK_H >= H; above 64 heads it runs as "split").
At GLM-5's size, 16,384 queries, one H100 (bench/sparse_mla.py --runs kernels, 2026-12-06):
one-pass 145.2 ms, split 142.8 (dq 29.8 + key gradient 113.6), stored 81.3 (dq and the stores
34.8 + key gradient 47.0; 38.0 with 2 stages), for 1 GiB more at the peak (the chunk's p and ds):
the default."""
BACKWARD_DQ = Tiles(BLOCK_H=64, BLOCK_S=64, num_warps=8, num_stages=1)
"""The dq pass at GLM-5's size, 16,384 queries, H100 (bench/sparse_mla.py --runs kernels): 28.4 ms
(BLOCK_H 32, BLOCK_S 32: 76.7; 64, 32: 37.5; 64, 32 with 2 stages: 49.8)."""
BACKWARD_DKV = Tiles(BLOCK_H=32, BLOCK_S=32, num_warps=8, num_stages=1)
"""The split's key-gradient pass: 113.9 ms there (BLOCK_S 64: 512; BLOCK_H 16, BLOCK_S 64: 294)."""
BACKWARD_DKV_STORED = Tiles(BLOCK_H=64, BLOCK_S=32, num_warps=8, num_stages=2)
"""The stored form's key-gradient pass (its BLOCK_H is every head): 38.0 ms there (1 stage: 47.0;
BLOCK_S 16: 47.9; 4 warps: 64.6)."""
STORED_BYTES = 1 << 30
"""The most the stored form's p and ds of one chunk of queries may take."""


@functools.cache
def _triton_kernels() -> tuple[Any, Any, Any, Any, Any]:
    """(triton, forward, backward, the split backward's dkv and the stored backward's dkv)
    kernels, built on first use (Triton comes with CUDA torch only).
    Any: Triton's module and JIT functions, which the type checker cannot see without Triton."""
    import triton  # pyright: ignore[reportMissingImports]
    import triton.language as tl  # pyright: ignore[reportMissingImports]

    @triton.jit
    def _gather(kv_b, index, valid, row, s0, S, rl, rr, L: tl.constexpr, R: tl.constexpr, BLOCK_S: tl.constexpr):
        # one block of the query's selected rows: (ok [BS], idx [BS], k_l [BS, BL], k_r [BS, BR]),
        # invalid slots and padding neither read nor counted
        X: tl.constexpr = L + R
        rs = s0 + tl.arange(0, BLOCK_S)
        m_s = rs < S
        idx = tl.load(index + row * S + rs, mask=m_s, other=0).to(tl.int64)
        ok = m_s & (tl.load(valid + row * S + rs, mask=m_s, other=0) != 0)
        k_row = kv_b + idx * X
        k_l = tl.load(k_row[:, None] + rl[None, :], mask=ok[:, None] & (rl < L)[None, :], other=0.0)
        k_r = tl.load(k_row[:, None] + L + rr[None, :], mask=ok[:, None] & (rr < R)[None, :], other=0.0)
        return ok, idx, k_l, k_r

    # Triton resolves a called jit function among the module's globals, not this closure
    globals().update(_gather=_gather)

    @triton.jit
    def _forward(
        q,
        kv,
        index,
        valid,
        out,
        lse,
        C,
        T,
        H,
        S,
        scale_log2,
        L: tl.constexpr,
        R: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_S: tl.constexpr,
        BLOCK_L: tl.constexpr,
        BLOCK_R: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        X: tl.constexpr = L + R
        t, hb, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        row = b.to(tl.int64) * C + t  # the query's row of [B * C]
        rh = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        rl = tl.arange(0, BLOCK_L)
        rr = tl.arange(0, BLOCK_R)
        m_h = rh < H
        q_h = q + row * H * X + rh[:, None] * X
        q_l = tl.load(q_h + rl[None, :], mask=m_h[:, None] & (rl < L)[None, :], other=0.0)
        q_r = tl.load(q_h + L + rr[None, :], mask=m_h[:, None] & (rr < R)[None, :], other=0.0)
        kv_b = kv + b.to(tl.int64) * T * X
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)  # running max of the scores (base 2)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_L], tl.float32)
        for s0 in range(0, S, BLOCK_S):
            ok, idx, k_l, k_r = _gather(kv_b, index, valid, row, s0, S, rl, rr, L, R, BLOCK_S)
            scores = tl.dot(q_l, tl.trans(k_l), input_precision=PRECISION)
            scores = tl.dot(q_r, tl.trans(k_r), scores, input_precision=PRECISION)
            scores = tl.where(ok[None, :], scores * scale_log2, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, axis=1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # no valid key seen yet: p = 0
            alpha = tl.exp2(m_i - m_use)
            p = tl.exp2(scores - m_use[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = tl.dot(p.to(k_l.dtype), k_l, acc * alpha[:, None], input_precision=PRECISION)
            m_i = m_new
        acc = acc / l_i[:, None]
        o_h = out + row * H * L + rh[:, None] * L
        tl.store(o_h + rl[None, :], acc.to(out.dtype.element_ty), mask=m_h[:, None] & (rl < L)[None, :])
        tl.store(lse + row * H + rh, (m_i + tl.log2(l_i)) * 0.6931471805599453, mask=m_h)

    @triton.jit
    def _backward(
        q,
        kv,
        index,
        valid,
        out,
        dout,
        lse,
        dq,
        dkv,
        delta_out,
        C,
        T,
        H,
        S,
        scale,
        L: tl.constexpr,
        R: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_S: tl.constexpr,
        BLOCK_L: tl.constexpr,
        BLOCK_R: tl.constexpr,
        PRECISION: tl.constexpr,
        KEY_GRAD: tl.constexpr,
        ps_out,
        t0,
        CH,
        B_CH_H_S,
        STORE_PS: tl.constexpr,
    ):
        # KEY_GRAD False: the split backward's first pass, dq alone; it leaves delta = sum(dO * O)
        # [B * C, H] in delta_out for the second pass (`_backward_dkv`) and adds nothing to dkv.
        # STORE_PS: it also writes the rounded p and ds of its queries t0 .. t0 + CH to ps_out
        # [2, B, CH, H, S] for `_backward_dkv_stored` (the grid's first axis is then CH)
        X: tl.constexpr = L + R
        LOG2E: tl.constexpr = 1.4426950408889634
        tc, hb, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        t = t0 + tc
        row = b.to(tl.int64) * C + t
        rh = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        rl = tl.arange(0, BLOCK_L)
        rr = tl.arange(0, BLOCK_R)
        m_h = rh < H
        m_hl = m_h[:, None] & (rl < L)[None, :]
        m_hr = m_h[:, None] & (rr < R)[None, :]
        q_h = q + row * H * X + rh[:, None] * X
        q_l = tl.load(q_h + rl[None, :], mask=m_hl, other=0.0)
        q_r = tl.load(q_h + L + rr[None, :], mask=m_hr, other=0.0)
        o_offs = row * H * L + rh[:, None] * L + rl[None, :]
        do = tl.load(dout + o_offs, mask=m_hl, other=0.0)
        o = tl.load(out + o_offs, mask=m_hl, other=0.0)
        delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), axis=1)
        if not KEY_GRAD:
            tl.store(delta_out + row * H + rh, delta, mask=m_h)
        lse_2 = tl.load(lse + row * H + rh, mask=m_h, other=0.0) * LOG2E
        kv_b = kv + b.to(tl.int64) * T * X
        dkv_b = dkv + b.to(tl.int64) * T * X
        dq_l = tl.zeros([BLOCK_H, BLOCK_L], tl.float32)
        dq_r = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
        for s0 in range(0, S, BLOCK_S):
            ok, idx, k_l, k_r = _gather(kv_b, index, valid, row, s0, S, rl, rr, L, R, BLOCK_S)
            scores = tl.dot(q_l, tl.trans(k_l), input_precision=PRECISION)
            scores = tl.dot(q_r, tl.trans(k_r), scores, input_precision=PRECISION)
            p = tl.where(m_h[:, None] & ok[None, :], tl.exp2(scores * (scale * LOG2E) - lse_2[:, None]), 0.0)
            dp = tl.dot(do, tl.trans(k_l), input_precision=PRECISION)
            ds = (p * (dp - delta[:, None]) * scale).to(q_l.dtype)
            pc = p.to(q_l.dtype)
            dq_l = tl.dot(ds, k_l, dq_l, input_precision=PRECISION)
            dq_r = tl.dot(ds, k_r, dq_r, input_precision=PRECISION)
            if STORE_PS:
                rs = s0 + tl.arange(0, BLOCK_S)
                ps = ps_out + ((b.to(tl.int64) * CH + tc) * H + rh[:, None]) * S + rs[None, :]
                m_ps = m_h[:, None] & (rs < S)[None, :]
                tl.store(ps, pc, mask=m_ps)
                tl.store(ps + B_CH_H_S, ds, mask=m_ps)
            if KEY_GRAD:
                dk_l = tl.dot(tl.trans(ds), q_l, input_precision=PRECISION)
                dk_l = tl.dot(tl.trans(pc), do, dk_l, input_precision=PRECISION)
                dk_r = tl.dot(tl.trans(ds), q_r, input_precision=PRECISION)
                k_row = dkv_b + idx * X
                m_kl = ok[:, None] & (rl < L)[None, :]
                tl.atomic_add(k_row[:, None] + rl[None, :], dk_l, mask=m_kl, sem="relaxed")
                tl.atomic_add(
                    k_row[:, None] + L + rr[None, :], dk_r, mask=ok[:, None] & (rr < R)[None, :], sem="relaxed"
                )
        dq_h = dq + row * H * X + rh[:, None] * X
        tl.store(dq_h + rl[None, :], dq_l.to(dq.dtype.element_ty), mask=m_hl)
        tl.store(dq_h + L + rr[None, :], dq_r.to(dq.dtype.element_ty), mask=m_hr)

    @triton.jit
    def _backward_dkv(
        q,
        kv,
        index,
        valid,
        dout,
        lse,
        delta_in,
        dkv,
        C,
        T,
        H,
        S,
        scale,
        L: tl.constexpr,
        R: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_S: tl.constexpr,
        BLOCK_L: tl.constexpr,
        BLOCK_R: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        # the split backward's second pass, grid (C, 1, B): one program a query takes every head,
        # BLOCK_H at a time, and sums the key gradient of a block of its selected keys over all
        # of them before one atomic add a key (`_backward` adds once per head block)
        X: tl.constexpr = L + R
        LOG2E: tl.constexpr = 1.4426950408889634
        t, b = tl.program_id(0), tl.program_id(2)
        row = b.to(tl.int64) * C + t
        rl = tl.arange(0, BLOCK_L)
        rr = tl.arange(0, BLOCK_R)
        kv_b = kv + b.to(tl.int64) * T * X
        dkv_b = dkv + b.to(tl.int64) * T * X
        for s0 in range(0, S, BLOCK_S):
            ok, idx, k_l, k_r = _gather(kv_b, index, valid, row, s0, S, rl, rr, L, R, BLOCK_S)
            dk_l = tl.zeros([BLOCK_S, BLOCK_L], tl.float32)
            dk_r = tl.zeros([BLOCK_S, BLOCK_R], tl.float32)
            for h0 in range(0, H, BLOCK_H):
                rh = h0 + tl.arange(0, BLOCK_H)
                m_h = rh < H
                m_hl = m_h[:, None] & (rl < L)[None, :]
                q_h = q + row * H * X + rh[:, None] * X
                q_l = tl.load(q_h + rl[None, :], mask=m_hl, other=0.0)
                q_r = tl.load(q_h + L + rr[None, :], mask=m_h[:, None] & (rr < R)[None, :], other=0.0)
                do = tl.load(dout + row * H * L + rh[:, None] * L + rl[None, :], mask=m_hl, other=0.0)
                delta = tl.load(delta_in + row * H + rh, mask=m_h, other=0.0)
                lse_2 = tl.load(lse + row * H + rh, mask=m_h, other=0.0) * LOG2E
                scores = tl.dot(q_l, tl.trans(k_l), input_precision=PRECISION)
                scores = tl.dot(q_r, tl.trans(k_r), scores, input_precision=PRECISION)
                p = tl.where(m_h[:, None] & ok[None, :], tl.exp2(scores * (scale * LOG2E) - lse_2[:, None]), 0.0)
                dp = tl.dot(do, tl.trans(k_l), input_precision=PRECISION)
                ds = (p * (dp - delta[:, None]) * scale).to(q_l.dtype)
                pc = p.to(q_l.dtype)
                dk_l = tl.dot(tl.trans(ds), q_l, dk_l, input_precision=PRECISION)
                dk_l = tl.dot(tl.trans(pc), do, dk_l, input_precision=PRECISION)
                dk_r = tl.dot(tl.trans(ds), q_r, dk_r, input_precision=PRECISION)
            k_row = dkv_b + idx * X
            tl.atomic_add(k_row[:, None] + rl[None, :], dk_l, mask=ok[:, None] & (rl < L)[None, :], sem="relaxed")
            tl.atomic_add(k_row[:, None] + L + rr[None, :], dk_r, mask=ok[:, None] & (rr < R)[None, :], sem="relaxed")

    @triton.jit
    def _backward_dkv_stored(
        q,
        index,
        valid,
        dout,
        ps,
        dkv,
        C,
        T,
        H,
        S,
        t0,
        CH,
        B_CH_H_S,
        L: tl.constexpr,
        R: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_S: tl.constexpr,
        BLOCK_L: tl.constexpr,
        BLOCK_R: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        # the stored backward's second pass, grid (CH, 1, B), BLOCK_H >= H: one program a query
        # of t0 .. t0 + CH holds every head's q and dO (read once) and, per block of its keys,
        # reads the p and ds the dq pass stored instead of recomputing them: the key gradient
        # ds^T q (+ p^T dO on the first L columns), summed over the heads, one atomic add a key
        X: tl.constexpr = L + R
        tc, b = tl.program_id(0), tl.program_id(2)
        t = t0 + tc
        row = b.to(tl.int64) * C + t
        rh = tl.arange(0, BLOCK_H)
        rl = tl.arange(0, BLOCK_L)
        rr = tl.arange(0, BLOCK_R)
        m_h = rh < H
        m_hl = m_h[:, None] & (rl < L)[None, :]
        q_h = q + row * H * X + rh[:, None] * X
        q_l = tl.load(q_h + rl[None, :], mask=m_hl, other=0.0)
        q_r = tl.load(q_h + L + rr[None, :], mask=m_h[:, None] & (rr < R)[None, :], other=0.0)
        do = tl.load(dout + row * H * L + rh[:, None] * L + rl[None, :], mask=m_hl, other=0.0)
        dkv_b = dkv + b.to(tl.int64) * T * X
        ps_row = ps + ((b.to(tl.int64) * CH + tc) * H + rh[:, None]) * S
        for s0 in range(0, S, BLOCK_S):
            rs = s0 + tl.arange(0, BLOCK_S)
            m_s = rs < S
            idx = tl.load(index + row * S + rs, mask=m_s, other=0).to(tl.int64)
            ok = m_s & (tl.load(valid + row * S + rs, mask=m_s, other=0) != 0)
            m_ps = m_h[:, None] & m_s[None, :]
            pc = tl.load(ps_row + rs[None, :], mask=m_ps, other=0.0)
            ds = tl.load(ps_row + B_CH_H_S + rs[None, :], mask=m_ps, other=0.0)
            dk_l = tl.dot(tl.trans(ds), q_l, input_precision=PRECISION)
            dk_l = tl.dot(tl.trans(pc), do, dk_l, input_precision=PRECISION)
            dk_r = tl.dot(tl.trans(ds), q_r, input_precision=PRECISION)
            k_row = dkv_b + idx * X
            tl.atomic_add(k_row[:, None] + rl[None, :], dk_l, mask=ok[:, None] & (rl < L)[None, :], sem="relaxed")
            tl.atomic_add(k_row[:, None] + L + rr[None, :], dk_r, mask=ok[:, None] & (rr < R)[None, :], sem="relaxed")

    return triton, _forward, _backward, _backward_dkv, _backward_dkv_stored


def _pow2(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(n, 1))))


def _blocks(h: int, lat: int, rope: int, tiles: Tiles) -> dict[str, int]:
    return dict(
        BLOCK_H=min(tiles["BLOCK_H"], max(16, _pow2(h))),
        BLOCK_S=tiles["BLOCK_S"],
        BLOCK_L=max(16, _pow2(lat)),
        BLOCK_R=max(16, _pow2(rope)),
    )


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # "tf32" is ignored by 16-bit dots


def sparse_mla_forward(
    q_BCHX, kv_BTX, index_BCS, valid_BCS, scale: float, v_dim: int, tiles: Tiles = FORWARD
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, C, H, L] in q's dtype, lse [B, C, H] fp32) by the forward kernel; inputs contiguous."""
    triton, forward, *_ = _triton_kernels()
    b, c, h, x = q_BCHX.shape
    t, s = kv_BTX.shape[1], index_BCS.shape[-1]
    out_BCHV = q_BCHX.new_empty(b, c, h, v_dim)
    lse_BCH = torch.empty(b, c, h, dtype=torch.float32, device=q_BCHX.device)
    blocks = _blocks(h, v_dim, x - v_dim, tiles)
    if out_BCHV.numel():
        forward[(c, triton.cdiv(h, blocks["BLOCK_H"]), b)](
            q_BCHX,
            kv_BTX,
            index_BCS,
            valid_BCS.view(torch.uint8),
            out_BCHV,
            lse_BCH,
            c,
            t,
            h,
            s,
            scale * math.log2(math.e),
            L=v_dim,
            R=x - v_dim,
            PRECISION=_precision(q_BCHX.dtype),
            num_warps=tiles["num_warps"],
            num_stages=tiles["num_stages"],
            **blocks,
        )
    return out_BCHV, lse_BCH


def sparse_mla_backward(
    dout_BCHV,
    q_BCHX,
    kv_BTX,
    index_BCS,
    valid_BCS,
    out_BCHV,
    lse_BCH,
    scale: float,
    tiles: Tiles = BACKWARD,
    passes: tuple[bool, bool] = (True, True),
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dq in q's dtype, dkv fp32 [B, T, X]) by the backward kernels in BACKWARD_FORM's way;
    inputs contiguous, dout in q's dtype. `passes`: which of the split and stored forms' two
    passes run (bench/sparse_mla.py times them apart; a skipped one leaves its gradient unfinished)."""
    triton, _, backward, backward_dkv, backward_dkv_stored = _triton_kernels()
    b, c, h, x = q_BCHX.shape
    t, s = kv_BTX.shape[1], index_BCS.shape[-1]
    v_dim = out_BCHV.shape[-1]
    dq_BCHX = torch.empty_like(q_BCHX)
    dkv_BTX = torch.zeros(kv_BTX.shape, dtype=torch.float32, device=kv_BTX.device)
    if not dq_BCHX.numel():
        return dq_BCHX, dkv_BTX
    inputs = (q_BCHX, kv_BTX, index_BCS, valid_BCS.view(torch.uint8))
    sizes = dict(L=v_dim, R=x - v_dim, PRECISION=_precision(q_BCHX.dtype))
    form = BACKWARD_FORM
    heads_at_once = max(16, _pow2(h))  # the stored form's key-gradient pass: every head in one program
    if form == "stored" and heads_at_once > 64:
        form = "split"

    def dq_pass(grid_c: int, delta_BCH, store=False, ps=None, t0=0, ch=c):
        blocks = _blocks(h, v_dim, x - v_dim, BACKWARD_DQ)
        backward[(grid_c, triton.cdiv(h, blocks["BLOCK_H"]), b)](
            *inputs, out_BCHV, dout_BCHV, lse_BCH, dq_BCHX, dkv_BTX, delta_BCH, c, t, h, s, scale,
            KEY_GRAD=False, ps_out=dkv_BTX if ps is None else ps, t0=t0, CH=ch, B_CH_H_S=b * ch * h * s,
            STORE_PS=store, num_warps=BACKWARD_DQ["num_warps"], num_stages=BACKWARD_DQ["num_stages"],
            **sizes, **blocks,
        )  # fmt: skip

    if form == "one-pass":
        blocks = _blocks(h, v_dim, x - v_dim, tiles)
        backward[(c, triton.cdiv(h, blocks["BLOCK_H"]), b)](
            *inputs,
            out_BCHV,
            dout_BCHV,
            lse_BCH,
            dq_BCHX,
            dkv_BTX,
            lse_BCH,
            c,
            t,
            h,
            s,
            scale,
            KEY_GRAD=True,
            ps_out=dkv_BTX,
            t0=0,
            CH=c,
            B_CH_H_S=0,
            STORE_PS=False,
            num_warps=tiles["num_warps"],
            num_stages=tiles["num_stages"],
            **sizes,
            **blocks,
        )  # fmt: skip  (delta_out = lse: not written when KEY_GRAD)
    elif form == "split":
        delta_BCH = torch.empty(b, c, h, dtype=torch.float32, device=q_BCHX.device)
        if passes[0]:
            dq_pass(c, delta_BCH)
        if passes[1]:
            blocks = _blocks(h, v_dim, x - v_dim, BACKWARD_DKV)
            backward_dkv[(c, 1, b)](
                *inputs, dout_BCHV, lse_BCH, delta_BCH, dkv_BTX, c, t, h, s, scale,
                num_warps=BACKWARD_DKV["num_warps"], num_stages=BACKWARD_DKV["num_stages"], **sizes, **blocks,
            )  # fmt: skip
    elif form == "stored":
        delta_BCH = torch.empty(b, c, h, dtype=torch.float32, device=q_BCHX.device)
        ch = max(1, min(c, STORED_BYTES // (2 * b * h * s * q_BCHX.element_size())))
        ps = torch.empty(2, b, ch, h, s, dtype=q_BCHX.dtype, device=q_BCHX.device)
        blocks = _blocks(h, v_dim, x - v_dim, BACKWARD_DKV_STORED) | {"BLOCK_H": heads_at_once}
        for t0 in range(0, c, ch):
            n = min(ch, c - t0)
            if passes[0]:
                dq_pass(n, delta_BCH, store=True, ps=ps, t0=t0, ch=ch)
            if passes[1]:
                backward_dkv_stored[(n, 1, b)](
                    q_BCHX, index_BCS, inputs[3], dout_BCHV, ps, dkv_BTX, c, t, h, s, t0, ch, b * ch * h * s,
                    num_warps=BACKWARD_DKV_STORED["num_warps"], num_stages=BACKWARD_DKV_STORED["num_stages"],
                    **sizes, **blocks,
                )  # fmt: skip
    else:
        raise ValueError(f"BACKWARD_FORM must be 'one-pass', 'split' or 'stored', got {form!r}")
    return dq_BCHX, dkv_BTX


class SparseMLA(torch.autograd.Function):
    """`_SparseMLA` (blocks/mla.py) by the kernels: the same inputs, output and gradients."""

    @staticmethod
    def forward(ctx, q_BCHX, kv_BTX, index_BCS, valid_BCS, scale: float, v_dim: int):
        ctx.kv_dtype = kv_BTX.dtype
        q_BCHX, kv_BTX = q_BCHX.contiguous(), kv_BTX.to(q_BCHX.dtype).contiguous()
        index_BCS, valid_BCS = index_BCS.contiguous(), valid_BCS.contiguous()
        out_BCHV, lse_BCH = sparse_mla_forward(q_BCHX, kv_BTX, index_BCS, valid_BCS, scale, v_dim)
        ctx.save_for_backward(q_BCHX, kv_BTX, index_BCS, valid_BCS, out_BCHV, lse_BCH)
        ctx.scale = scale
        ctx.mark_non_differentiable(lse_BCH)
        return out_BCHV, lse_BCH

    @staticmethod
    def backward(ctx, *grads):
        dout_BCHV = grads[0]
        q_BCHX, kv_BTX, index_BCS, valid_BCS, out_BCHV, lse_BCH = ctx.saved_tensors
        dout_BCHV = dout_BCHV.to(q_BCHX.dtype).contiguous()
        dq_BCHX, dkv_BTX = sparse_mla_backward(
            dout_BCHV, q_BCHX, kv_BTX, index_BCS, valid_BCS, out_BCHV, lse_BCH, ctx.scale
        )
        return dq_BCHX, dkv_BTX.to(ctx.kv_dtype), None, None, None, None


@compiler_disabled  # eager inside compiled layers: Triton launches
def sparse_mla_with_lse(
    q_BCHX, kv_BTX, index_BCS, valid_BCS, scale: float, v_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, C, H, v_dim], lse [B, C, H] fp32, not differentiated) by the kernels."""
    out_BCHV, lse_BCH = SparseMLA.apply(q_BCHX, kv_BTX, index_BCS, valid_BCS, scale, v_dim)
    return out_BCHV, lse_BCH


def sparse_mla_triton(q_BCHX, kv_BTX, index_BCS, valid_BCS, scale: float, v_dim: int) -> torch.Tensor:
    """`_SparseMLA.apply`'s contract by the kernels: out [B, C, H, v_dim] in q's dtype, with
    gradients to q and kv. v_dim must be kv's latent width L (the values are kv[..., :L])."""
    return sparse_mla_with_lse(q_BCHX, kv_BTX, index_BCS, valid_BCS, scale, v_dim)[0]
