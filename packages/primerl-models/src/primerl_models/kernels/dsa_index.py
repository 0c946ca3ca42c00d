"""DSA's indexer scores and their top-k keys as one Triton kernel: the CUDA path of blocks/mla.py's
`index_scores` + `document_causal` + `order_keys` for the sparse path (which stay the CPU path and
the reference):

    keys_BcT = index_keys_triton(q_BcIK, w_BcI, k_BTK, doc_BT, start, dtype)
    score(t, s) = sum_j w_tj relu(q_tj . k_s)
    keys[b, t, s] = order(score(t, s)) << 32 | s    where s may be read by t, else int64's minimum

for the queries start .. start + c of the row (t is the row position start + its index) and its
keys 0 .. T (T = k's length); "may be read" is document_causal's rule: s <= t and the same
document. `order` maps a float's bits to an int32 of the same order (-0.0 as 0.0), so that one
torch.topk over these keys takes the best scores and, of equal ones, the later key (mla.py's
`top_keys`). Nothing of size [c, I, T] is made: the torch form writes the dots, their ReLU and
the weighted sum as fp32 [c, I, T] tensors (32 heads at 16k: 0.5 GiB each a 256-query chunk), which is
most of its time.

A program takes BLOCK_C queries and all their I heads as the BLOCK_C * I rows of one tile
(q [BLOCK_C * I, K], read once) and walks the keys BLOCK_T at a time up to its last query:
dots = q k^T (fp32 accumulator), relu, times w, summed over the heads (a reshape to
[BLOCK_C, I, BLOCK_T]). Keys after the block's last query are never computed: the output is
filled with the minimum first. `dtype` is the dots' operand type: bf16 (the trainer's autocast;
fp32 accumulation, as the anchor's FP8 indexer is coarser still) or fp32 (exact "ieee" dots: the
tests). Legend: B batch, c queries, T keys, I indexer heads, K their width.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch

from primerl_models.kernels import compiler_disabled

TILE_ROWS = 128
"""Query rows (queries x heads) a program holds: BLOCK_C = TILE_ROWS / I (rounded up to a power of two)."""
BLOCK_T = 128
NUM_WARPS = 8
NONE = torch.iinfo(torch.int64).min
"""The key of a pair the query may not read: below every score's key."""


@functools.cache
def _triton_kernel() -> tuple[Any, Any]:
    """(triton, the kernel), built on first use. Any: Triton's module and JIT function."""
    import triton  # pyright: ignore[reportMissingImports]
    import triton.language as tl  # pyright: ignore[reportMissingImports]

    @triton.jit
    def _index_keys(
        q,
        w,
        k,
        doc,
        out,
        C,
        T,
        start,
        HEADS: tl.constexpr,
        K: tl.constexpr,
        BLOCK_I: tl.constexpr,
        BLOCK_K: tl.constexpr,
        BLOCK_C: tl.constexpr,
        BLOCK_T: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        cb, b = tl.program_id(0), tl.program_id(1)
        ROWS: tl.constexpr = BLOCK_C * BLOCK_I
        r = tl.arange(0, ROWS)
        c_r = cb * BLOCK_C + r // BLOCK_I  # each row's query (in this chunk) and head
        i_r = r % BLOCK_I
        m_r = (c_r < C) & (i_r < HEADS)
        rk = tl.arange(0, BLOCK_K)
        row_r = b.to(tl.int64) * C + c_r
        qt = tl.load(
            q + (row_r * HEADS + i_r)[:, None] * K + rk[None, :], mask=m_r[:, None] & (rk < K)[None, :], other=0.0
        )
        w_r = tl.load(w + row_r * HEADS + i_r, mask=m_r, other=0.0)
        rc = cb * BLOCK_C + tl.arange(0, BLOCK_C)
        m_c = rc < C
        pos_c = start + rc  # the queries' row positions
        doc_b = doc + b.to(tl.int64) * T
        doc_c = tl.load(doc_b + pos_c, mask=m_c, other=-1)
        out_c = out + (b.to(tl.int64) * C + rc)[:, None] * T
        last = tl.minimum(start + cb * BLOCK_C + BLOCK_C, start + C)  # one past the block's last query
        for s0 in range(0, tl.minimum(last, T), BLOCK_T):
            rs = s0 + tl.arange(0, BLOCK_T)
            m_s = rs < T
            kt = tl.load(
                k + (b.to(tl.int64) * T + rs)[:, None] * K + rk[None, :],
                mask=m_s[:, None] & (rk < K)[None, :],
                other=0.0,
            )
            dots = tl.dot(qt, tl.trans(kt), input_precision=PRECISION)
            weighted = tl.maximum(dots, 0.0) * w_r[:, None]
            score = tl.sum(tl.reshape(weighted, [BLOCK_C, BLOCK_I, BLOCK_T]), axis=1)
            bits = tl.where(score == 0.0, 0.0, score).to(tl.int32, bitcast=True)  # -0.0 as 0.0
            ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64)
            key = (ordered << 32) | rs[None, :].to(tl.int64)
            doc_s = tl.load(doc_b + rs, mask=m_s, other=-2)
            allowed = (rs[None, :] <= pos_c[:, None]) & (doc_s[None, :] == doc_c[:, None])
            key = tl.where(allowed, key, -9223372036854775808)
            tl.store(out_c + rs[None, :], key, mask=m_c[:, None] & m_s[None, :])

    return triton, _index_keys


def _pow2(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(n, 1))))


@compiler_disabled  # eager inside compiled layers: a Triton launch
def index_keys_triton(
    q_BcIK: torch.Tensor, w_BcI: torch.Tensor, k_BTK: torch.Tensor, doc_BT: torch.Tensor, start: int, dtype: torch.dtype
) -> torch.Tensor:
    """int64 [B, c, T] keys of the queries start .. start + c against k's T keys (the module
    docstring), the dots in `dtype` (bf16 / fp16 operands with fp32 accumulation, or exact fp32);
    w is used in fp32. doc_BT: the row's document ids, at least T long."""
    triton, kernel = _triton_kernel()
    b, c, heads, width = q_BcIK.shape
    t = k_BTK.shape[1]
    keys_BcT = torch.full((b, c, t), NONE, dtype=torch.int64, device=q_BcIK.device)
    if not keys_BcT.numel():
        return keys_BcT
    block_i = _pow2(heads)
    block_c = max(1, TILE_ROWS // block_i)
    if block_c * block_i < 16:  # the smallest dot Triton takes
        block_c = 16 // block_i
    kernel[(triton.cdiv(c, block_c), b)](
        q_BcIK.to(dtype).contiguous(),
        w_BcI.float().contiguous(),
        k_BTK.to(dtype).contiguous(),
        doc_BT[:, :t].contiguous(),
        keys_BcT,
        c,
        t,
        start,
        HEADS=heads,
        K=width,
        BLOCK_I=block_i,
        BLOCK_K=max(16, _pow2(width)),
        BLOCK_C=block_c,
        BLOCK_T=BLOCK_T,
        PRECISION="ieee" if dtype == torch.float32 else "tf32",
        num_warps=NUM_WARPS,
    )
    return keys_BcT
