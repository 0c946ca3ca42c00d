"""silu(depthwise causal conv) over packed rows as Triton kernels, the Gated DeltaNet's conv on
CUDA (linear_attention.GatedDeltaNetMixer's fast path):

    y_NC = causal_conv_silu(x_NC, weight_CK, pos_N)
         = silu(linear_attention.causal_conv(x, weight, pos))   (accumulated in fp32, x's dtype out)

A tap reaches back j tokens only where j <= pos[n] (the token's position in its document), so
the conv restarts at each document. The forward reads x once per tap and writes y; the backward
recomputes the pre-activation, writes its gradient (fp32) with the weight's per-tile partial
sums, then gathers dx from it. At 16k tokens x 6,144 channels on an H200 (bench/conv_kernels.py,
tile sizes below): 0.18 ms forward and 0.84 ms backward a layer, fla's causal_conv1d 0.42 and 1.48
in the same run. The backward moves 1.4 GB (the fp32 gradient of the pre-activation written and
read back) at ~1.7 TB/s; 0.15 ms is the floor of a backward without that round trip.
Legend: N tokens (rows flattened), C channels, K taps.
"""

from __future__ import annotations

import functools
from typing import Any, TypedDict

import torch


class Tiles(TypedDict):
    BT: int
    BC: int
    num_warps: int


FORWARD = Tiles(BT=32, BC=128, num_warps=4)
BACKWARD = Tiles(BT=128, BC=64, num_warps=4)
"""Tile sizes and warps of the forward and of the two backward kernels: the fastest of
bench/conv_kernels.py's sweep on an H200 (forward 0.18 ms vs 0.24 at 64 x 128; backward 0.84 vs
0.96)."""
WIDE_OFFSETS = 2**31
"""Element offsets in int64 from this many elements of x on (int32 below: fewer instructions)."""


@functools.cache
def _triton_kernels() -> tuple[Any, Any, Any, Any]:
    """(triton, forward, backward 1, backward 2) kernels, built on first use (CUDA torch only).
    Any: Triton's module and JIT functions (launched as kernel[grid](...)), which the type checker
    cannot see where Triton is not installed."""
    import triton  # pyright: ignore[reportMissingImports]
    import triton.language as tl  # pyright: ignore[reportMissingImports]

    @triton.jit
    def _offsets(rows, rc, C, WIDE: tl.constexpr):
        if WIDE:
            return rows.to(tl.int64)[:, None] * C + rc[None, :]
        return rows[:, None] * C + rc[None, :]

    @triton.jit
    def _pre_activation(
        x, w, pos, rt, rc, N, C, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, WIDE: tl.constexpr
    ):
        # sum_j w[c, j] x[t - (K - 1 - j), c] over the taps inside t's document, fp32
        m_t, m_c = rt < N, rc < C
        p = tl.load(pos + rt, mask=m_t, other=0)
        acc = tl.zeros([BT, BC], dtype=tl.float32)
        for j in tl.static_range(K):
            back = K - 1 - j
            ok = m_t & (p >= back)
            xv = tl.load(x + _offsets(rt - back, rc, C, WIDE), mask=ok[:, None] & m_c[None, :], other=0.0).to(
                tl.float32
            )
            wj = tl.load(w + rc * K + j, mask=m_c, other=0.0).to(tl.float32)
            acc += xv * wj[None, :]
        return acc

    # Triton resolves a called jit function among the module's globals, not this closure
    globals().update(_offsets=_offsets, _pre_activation=_pre_activation)

    @triton.jit
    def _forward(x, w, pos, y, N, C, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, WIDE: tl.constexpr):
        rt = tl.program_id(0) * BT + tl.arange(0, BT)
        rc = tl.program_id(1) * BC + tl.arange(0, BC)
        a = _pre_activation(x, w, pos, rt, rc, N, C, K, BT, BC, WIDE)
        mask = (rt < N)[:, None] & (rc < C)[None, :]
        tl.store(y + _offsets(rt, rc, C, WIDE), (a * tl.sigmoid(a)).to(y.dtype.element_ty), mask=mask)

    @triton.jit
    def _backward_pre(
        x, w, pos, dy, da, dw_part, N, C, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, WIDE: tl.constexpr
    ):
        # da = dy * silu'(a) (in da's dtype, kept for dx) and this tile's share of dw[c, j]
        rt = tl.program_id(0) * BT + tl.arange(0, BT)
        rc = tl.program_id(1) * BC + tl.arange(0, BC)
        m_t, m_c = rt < N, rc < C
        mask = m_t[:, None] & m_c[None, :]
        a = _pre_activation(x, w, pos, rt, rc, N, C, K, BT, BC, WIDE)
        s = tl.sigmoid(a)
        offs = _offsets(rt, rc, C, WIDE)
        g = tl.load(dy + offs, mask=mask, other=0.0).to(tl.float32) * s * (1.0 + a * (1.0 - s))
        tl.store(da + offs, g.to(da.dtype.element_ty), mask=mask)
        p = tl.load(pos + rt, mask=m_t, other=0)
        part = dw_part + tl.program_id(0).to(tl.int64) * C * K
        for j in tl.static_range(K):
            back = K - 1 - j
            ok = m_t & (p >= back)
            xv = tl.load(x + _offsets(rt - back, rc, C, WIDE), mask=ok[:, None] & m_c[None, :], other=0.0).to(
                tl.float32
            )
            tl.store(part + rc * K + j, tl.sum(g * xv, axis=0), mask=m_c)

    @triton.jit
    def _backward_x(w, pos, da, dx, N, C, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, WIDE: tl.constexpr):
        # dx[s, c] = sum_j w[c, j] da[s + (K - 1 - j), c] over the outputs in s's document
        rs = tl.program_id(0) * BT + tl.arange(0, BT)
        rc = tl.program_id(1) * BC + tl.arange(0, BC)
        m_s, m_c = rs < N, rc < C
        acc = tl.zeros([BT, BC], dtype=tl.float32)
        for j in tl.static_range(K):
            ahead = K - 1 - j
            rt = rs + ahead
            ok = m_s & (rt < N)
            ok = ok & (tl.load(pos + rt, mask=ok, other=0) >= ahead)
            g = tl.load(da + _offsets(rt, rc, C, WIDE), mask=ok[:, None] & m_c[None, :], other=0.0).to(tl.float32)
            wj = tl.load(w + rc * K + j, mask=m_c, other=0.0).to(tl.float32)
            acc += g * wj[None, :]
        tl.store(dx + _offsets(rs, rc, C, WIDE), acc.to(dx.dtype.element_ty), mask=m_s[:, None] & m_c[None, :])

    return triton, _forward, _backward_pre, _backward_x


def conv_forward(x_NC, weight_CK, pos_N, BT: int, BC: int, num_warps: int) -> torch.Tensor:
    """y = silu(conv) by the forward kernel at these tile sizes (bench/conv_kernels.py calls it too)."""
    triton, forward, _, _ = _triton_kernels()
    (n, c), k = x_NC.shape, weight_CK.shape[1]
    y_NC = torch.empty_like(x_NC)
    if n:
        forward[(triton.cdiv(n, BT), triton.cdiv(c, BC))](
            x_NC,
            weight_CK,
            pos_N,
            y_NC,
            n,
            c,
            K=k,
            BT=BT,
            BC=BC,
            WIDE=x_NC.numel() >= WIDE_OFFSETS,
            num_warps=num_warps,
        )
    return y_NC


def conv_backward(
    dy_NC, x_NC, weight_CK, pos_N, BT: int, BC: int, num_warps: int, da_dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dw fp32) by the two backward kernels at these tile sizes, the pre-activation's
    gradient held in `da_dtype` between them."""
    triton, _, backward_pre, backward_x = _triton_kernels()
    (n, c), k = x_NC.shape, weight_CK.shape[1]
    grid = (triton.cdiv(n, BT), triton.cdiv(c, BC))
    da_NC = torch.empty(n, c, dtype=da_dtype, device=x_NC.device)
    dw_part = torch.zeros(grid[0], c, k, dtype=torch.float32, device=x_NC.device)
    dx_NC = torch.empty_like(x_NC)
    if n:
        wide = x_NC.numel() >= WIDE_OFFSETS
        backward_pre[grid](
            x_NC, weight_CK, pos_N, dy_NC, da_NC, dw_part, n, c, K=k, BT=BT, BC=BC, WIDE=wide, num_warps=num_warps
        )
        backward_x[grid](weight_CK, pos_N, da_NC, dx_NC, n, c, K=k, BT=BT, BC=BC, WIDE=wide, num_warps=num_warps)
    return dx_NC, dw_part.sum(0)


# The kernels as custom ops: a compiled layer holds them without a graph break.
Tensor = torch.Tensor


@torch.library.custom_op("primerl::causal_conv_silu", mutates_args=())
def _conv_op(x_NC: Tensor, weight_CK: Tensor, pos_N: Tensor) -> Tensor:
    return conv_forward(x_NC.contiguous(), weight_CK.contiguous(), pos_N.contiguous(), **FORWARD)


@_conv_op.register_fake
def _(x_NC, weight_CK, pos_N):
    return x_NC.new_empty(x_NC.shape)  # contiguous, as the kernel writes it


@torch.library.custom_op("primerl::causal_conv_silu_bwd", mutates_args=())
def _conv_backward_op(dy_NC: Tensor, x_NC: Tensor, weight_CK: Tensor, pos_N: Tensor) -> tuple[Tensor, Tensor]:
    dx_NC, dw_CK = conv_backward(
        dy_NC.contiguous(), x_NC.contiguous(), weight_CK.contiguous(), pos_N.contiguous(), **BACKWARD
    )
    return dx_NC, dw_CK.to(weight_CK.dtype)


@_conv_backward_op.register_fake
def _(dy_NC, x_NC, weight_CK, pos_N):
    return x_NC.new_empty(x_NC.shape), weight_CK.new_empty(weight_CK.shape)


def _conv_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _conv_grad(ctx, dy_NC):
    x_NC, weight_CK, pos_N = ctx.saved_tensors
    dx_NC, dw_CK = _conv_backward_op(dy_NC, x_NC, weight_CK, pos_N)
    return dx_NC, dw_CK, None


_conv_op.register_autograd(_conv_grad, setup_context=_conv_setup)


def causal_conv_silu(x_NC: torch.Tensor, weight_CK: torch.Tensor, pos_N: torch.Tensor) -> torch.Tensor:
    """silu(causal_conv(x, weight, pos)) [N, C] in x's dtype; gradients to x and weight."""
    if x_NC.ndim != 2 or weight_CK.shape[0] != x_NC.shape[1] or pos_N.shape != x_NC.shape[:1]:
        raise ValueError(
            f"x must be [N, C], weight [C, K], pos [N]; got {tuple(x_NC.shape)}, "
            f"{tuple(weight_CK.shape)}, {tuple(pos_N.shape)}"
        )
    return _conv_op(x_NC, weight_CK, pos_N)
