"""The chunk-to-chunk recurrence of a linear-attention state, Y_i = keep_i (X_i + A_i Y_prev),
over L chunks: sequential by nature, so one GPU kernel walks the chunks (Triton, imported only
on CUDA) instead of launching a few small kernels per chunk; elsewhere a loop of matmuls,
which is also the tests' reference.

    states = chunk_states(M, B, starts)   # S_i entering chunk i; S_i = 0 where starts[i]

with S_{i+1} = M_i S_i + B_i: M [H, L, K, K], B [H, L, K, V], fp32. Gradients flow to M and B
(the backward is the same recurrence run backwards with M transposed).

Legend: H heads, L chunks, K key dim, V value dim.
"""

from __future__ import annotations

import functools

import torch


def _scan_loop(a, x, keep_L, reverse: bool, transpose: bool) -> torch.Tensor:
    """Y_i = keep_i (X_i + A_i Y_prev) (A_i^T with `transpose`), prev = i - 1 (or i + 1
    reversed), Y_prev = 0 past the ends."""
    h, n, k, v = x.shape
    y = x.new_zeros(h, k, v)
    out = torch.empty_like(x)
    for i in (range(n - 1, -1, -1) if reverse else range(n)):
        a_i = a[:, i].transpose(-1, -2) if transpose else a[:, i]
        y = keep_L[i] * (x[:, i] + a_i @ y)
        out[:, i] = y
    return out


@functools.cache
def _triton_scan():
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(a_ptr, x_ptr, keep_ptr, y_ptr, n, K, V, s_ah, s_al, s_ar, s_ac, s_xh, s_xl, s_xk, s_xv,
               KP: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, REVERSE: tl.constexpr):
        # One program per (head, block of BV value columns) walks the chunks in order. The
        # state block [K, BV] is re-read each step from the previous step's output (in L2): a
        # whole [K, K] transition in registers would spill. Blocks of BK x BK keep the tiles small.
        h, vb = tl.program_id(0), tl.program_id(1)
        rv = vb * BV + tl.arange(0, BV)
        for step in tl.range(0, n):
            if REVERSE:
                i = n - 1 - step
                prev = i + 1
            else:
                i = step
                prev = i - 1
            has_prev = step > 0
            keep = tl.load(keep_ptr + i)
            for rb in tl.static_range(0, KP, BK):
                rr = rb + tl.arange(0, BK)
                out_mask = (rr[:, None] < K) & (rv[None, :] < V)
                offs = h * s_xh + i * s_xl + rr[:, None] * s_xk + rv[None, :] * s_xv
                acc = tl.load(x_ptr + offs, mask=out_mask, other=0.0)
                for kb in tl.static_range(0, KP, BK):
                    rk = kb + tl.arange(0, BK)
                    a = tl.load(a_ptr + h * s_ah + i * s_al + rr[:, None] * s_ar + rk[None, :] * s_ac,
                                mask=(rr[:, None] < K) & (rk[None, :] < K), other=0.0)
                    y_prev = tl.load(y_ptr + h * s_xh + prev * s_xl + rk[:, None] * s_xk + rv[None, :] * s_xv,
                                     mask=has_prev & (rk[:, None] < K) & (rv[None, :] < V), other=0.0,
                                     cache_modifier=".cg")
                    acc += tl.dot(a, y_prev, input_precision="ieee")
                tl.store(y_ptr + offs, keep * acc, mask=out_mask)
            tl.debug_barrier()  # this step's rows are the next step's input

    return triton, kernel


def _scan(a, x, keep_L, reverse: bool, transpose: bool) -> torch.Tensor:
    if not x.is_cuda:
        return _scan_loop(a, x, keep_L, reverse, transpose)
    triton, kernel = _triton_scan()
    h, n, k, v = x.shape
    x = x.contiguous()
    y = torch.empty_like(x)
    s_ah, s_al, s_ar, s_ac = a.stride()
    if transpose:
        s_ar, s_ac = s_ac, s_ar
    bk, bv = 32, 32
    kernel[(h, triton.cdiv(v, bv))](a, x, keep_L.contiguous(), y, n, k, v, s_ah, s_al, s_ar, s_ac, *x.stride(),
                                    KP=triton.cdiv(k, bk) * bk, BK=bk, BV=bv, REVERSE=reverse)
    return y


class _ChunkStates(torch.autograd.Function):
    @staticmethod
    def forward(ctx, m_HLKK, b_HLKV, keep_L):
        # S_i = keep_i (B_{i-1} + M_{i-1} S_{i-1}): the inputs shifted by one chunk
        a = torch.cat([torch.zeros_like(m_HLKK[:, :1]), m_HLKK[:, :-1]], dim=1)
        x = torch.cat([torch.zeros_like(b_HLKV[:, :1]), b_HLKV[:, :-1]], dim=1)
        states = _scan(a, x, keep_L, reverse=False, transpose=False)
        ctx.save_for_backward(m_HLKK, keep_L, states)
        return states

    @staticmethod
    def backward(ctx, grad_states):
        m, keep_L, states = ctx.saved_tensors
        # R_i = keep_i (dS_i + M_i^T R_{i+1}): the gradient of S_i before its reset
        r = _scan(m, grad_states.to(m.dtype), keep_L, reverse=True, transpose=True)
        r_next = torch.cat([r[:, 1:], torch.zeros_like(r[:, :1])], dim=1)  # R_{i+1}; none after the last
        grad_m = r_next @ states.transpose(-1, -2)  # dM_i = R_{i+1} S_i^T
        return grad_m, r_next, None


def chunk_states(m_HLKK: torch.Tensor, b_HLKV: torch.Tensor, starts_L: torch.Tensor) -> torch.Tensor:
    """[H, L, K, V]: the state entering each chunk, zero at the chunks in `starts_L` (and the first)."""
    keep_L = (~starts_L).to(b_HLKV.dtype)
    return _ChunkStates.apply(m_HLKK, b_HLKV, keep_L)
