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
from typing import Any

import torch


def _scan_loop(a, x, keep_L, reverse: bool, transpose: bool) -> torch.Tensor:
    """Y_i = keep_i (X_i + A_i Y_prev) (A_i^T with `transpose`), prev = i - 1 (or i + 1
    reversed), Y_prev = 0 past the ends."""
    h, n, k, v = x.shape
    y = x.new_zeros(h, k, v)
    out = torch.empty_like(x)
    for i in range(n - 1, -1, -1) if reverse else range(n):
        a_i = a[:, i].transpose(-1, -2) if transpose else a[:, i]
        y = keep_L[i] * (x[:, i] + a_i @ y)
        out[:, i] = y
    return out


@functools.cache
def _triton_scan() -> tuple[Any, Any]:
    """(triton, the scan's JIT kernel), built on first use (Any: Triton's types, which the type
    checker cannot see without Triton)."""
    import triton  # pyright: ignore[reportMissingImports]
    import triton.language as tl  # pyright: ignore[reportMissingImports]

    @triton.jit
    def kernel(
        a_ptr,
        x_ptr,
        keep_ptr,
        y_ptr,
        n,
        K,
        V,
        s_ah,
        s_al,
        s_ar,
        s_ac,
        s_xh,
        s_xl,
        s_xk,
        s_xv,
        KP: tl.constexpr,
        BV: tl.constexpr,
        REVERSE: tl.constexpr,
        TRANSPOSE: tl.constexpr,
        SHIFT: tl.constexpr,
        PRECISION: tl.constexpr,
        STAGES: tl.constexpr,
    ):
        # One program per (head, block of BV value columns) walks the chunks in order, its
        # block of the state [K, BV] held in registers from step to step. The transitions do
        # not depend on the state, so their loads run STAGES steps ahead of the products.
        # SHIFT: step i reads A and X of chunk i - 1 (zeros at i = 0), Y_i = keep_i (X_{i-1} +
        # A_{i-1} Y_{i-1}), without a shifted copy of the inputs.
        h, vb = tl.program_id(0), tl.program_id(1)
        rk = tl.arange(0, KP)
        rv = vb * BV + tl.arange(0, BV)
        a_mask = (rk[:, None] < K) & (rk[None, :] < K)
        x_mask = (rk[:, None] < K) & (rv[None, :] < V)
        a_offs = h * s_ah + rk[:, None] * s_ar + rk[None, :] * s_ac
        x_offs = h * s_xh + rk[:, None] * s_xk + rv[None, :] * s_xv
        state = tl.zeros([KP, BV], dtype=tl.float32)
        for step in tl.range(0, n, num_stages=STAGES):
            i = n - 1 - step if REVERSE else step
            keep = tl.load(keep_ptr + i)
            j = i - SHIFT
            a = tl.load(a_ptr + a_offs + j * s_al, mask=a_mask & (j >= 0), other=0.0)
            x = tl.load(x_ptr + x_offs + j * s_xl, mask=x_mask & (j >= 0), other=0.0)
            if TRANSPOSE:
                a = tl.trans(a)
            state = keep * (x + tl.dot(a, state, input_precision=PRECISION))
            tl.store(y_ptr + x_offs + i * s_xl, state, mask=x_mask)

    return triton, kernel


SCAN_TUNING = {"bv": 16, "num_warps": 8, "stages": 1, "precision": "tf32x3"}
"""The GPU kernel's settings (bench/scan_kernel.py sweeps them): value columns per program
(16: 128 programs for 16 heads of 128), warps, loads in flight ahead, and the dots' precision.
"tf32x3" (three tensor-core products of the operands' high and low parts) keeps fp32's
accuracy within a few ulps; "ieee" (fp32 FMAs) spills the [K, K] transition out of registers
and is 5-60x slower on the H200 (bench/results/scan-kernel-*.json)."""


def _scan(a, x, keep_L, reverse: bool, transpose: bool, shift: bool = False) -> torch.Tensor:
    """Y_i = keep_i (X_j + A_j Y_prev), j = i (i - 1 with `shift`, forward only, zeros at 0)."""
    if not x.is_cuda:
        if shift:
            a, x = (torch.cat([torch.zeros_like(t[:, :1]), t[:, :-1]], dim=1) for t in (a, x))
        return _scan_loop(a, x, keep_L, reverse, transpose)
    triton, kernel = _triton_scan()
    h, n, k, v = x.shape
    x = x.contiguous()
    y = torch.empty_like(x)
    t = SCAN_TUNING
    kp = max(16, triton.next_power_of_2(k))
    kernel[(h, triton.cdiv(v, t["bv"]))](
        a,
        x,
        keep_L.contiguous(),
        y,
        n,
        k,
        v,
        *a.stride(),
        *x.stride(),
        KP=kp,
        BV=t["bv"],
        REVERSE=reverse,
        TRANSPOSE=transpose,
        SHIFT=int(shift),
        PRECISION=t["precision"],
        STAGES=t["stages"],
        num_warps=t["num_warps"],
    )
    return y


class _ChunkStates(torch.autograd.Function):
    @staticmethod
    def forward(ctx, m_HLKK, b_HLKV, keep_L):
        # S_i = keep_i (B_{i-1} + M_{i-1} S_{i-1}): the inputs shifted by one chunk
        states = _scan(m_HLKK, b_HLKV, keep_L, reverse=False, transpose=False, shift=True)
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
