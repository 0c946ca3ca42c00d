"""silu(depthwise causal conv) over packed rows as Triton kernels, the Gated DeltaNet's conv on
CUDA (linear_attention.GatedDeltaNetMixer's fast path):

    y_NC = causal_conv_silu(x_NC, weight_CK, pos_N)
         = silu(linear_attention.causal_conv(x, weight, pos))   (accumulated in fp32, x's dtype out)

A tap reaches back j tokens only where j <= pos[n] (the token's position in its document), so
the conv restarts at each document. The forward reads x once per tap and writes y; the backward
recomputes the pre-activation, writes its gradient (fp32) with the weight's per-tile partial
sums, then gathers dx from it. At 16k tokens x 6,144 channels on an H200: 0.18 ms forward and
0.96 ms backward a layer, level with fla's conv (0.15 forward, run twice, and 0.85 backward),
but with no host-side work: the Qwen3.5-0.8B step gained 3.7% when it replaced fla's
(docs/benchmarks.md). Both are several times their memory traffic: a lever left.
Legend: N tokens (rows flattened), C channels, K taps.
"""

from __future__ import annotations

import functools

import torch

BLOCK_T, BLOCK_C = 64, 128


@functools.cache
def _triton_kernels():
    """(triton, forward, backward 1, backward 2) kernels, built on first use (CUDA torch only)."""
    import triton
    import triton.language as tl

    @triton.jit
    def _pre_activation(x, w, pos, rt, rc, N, C, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
        # sum_j w[c, j] x[t - (K - 1 - j), c] over the taps inside t's document, fp32
        m_t, m_c = rt < N, rc < C
        p = tl.load(pos + rt, mask=m_t, other=0)
        acc = tl.zeros([BT, BC], dtype=tl.float32)
        for j in tl.static_range(K):
            back = K - 1 - j
            ok = m_t & (p >= back)
            xv = tl.load(x + (rt - back).to(tl.int64)[:, None] * C + rc[None, :],
                         mask=ok[:, None] & m_c[None, :], other=0.0).to(tl.float32)
            wj = tl.load(w + rc * K + j, mask=m_c, other=0.0).to(tl.float32)
            acc += xv * wj[None, :]
        return acc

    # Triton resolves a called jit function among the module's globals, not this closure
    globals()["_pre_activation"] = _pre_activation

    @triton.jit
    def _forward(x, w, pos, y, N, C, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
        rt = tl.program_id(0) * BT + tl.arange(0, BT)
        rc = tl.program_id(1) * BC + tl.arange(0, BC)
        a = _pre_activation(x, w, pos, rt, rc, N, C, K, BT, BC)
        mask = (rt < N)[:, None] & (rc < C)[None, :]
        tl.store(y + rt.to(tl.int64)[:, None] * C + rc[None, :], (a * tl.sigmoid(a)).to(y.dtype.element_ty),
                 mask=mask)

    @triton.jit
    def _backward_pre(x, w, pos, dy, da, dw_part, N, C, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
        # da = dy * silu'(a) (fp32, kept for dx) and this tile's share of dw[c, j]
        rt = tl.program_id(0) * BT + tl.arange(0, BT)
        rc = tl.program_id(1) * BC + tl.arange(0, BC)
        m_t, m_c = rt < N, rc < C
        mask = m_t[:, None] & m_c[None, :]
        a = _pre_activation(x, w, pos, rt, rc, N, C, K, BT, BC)
        s = tl.sigmoid(a)
        offs = rt.to(tl.int64)[:, None] * C + rc[None, :]
        g = tl.load(dy + offs, mask=mask, other=0.0).to(tl.float32) * s * (1.0 + a * (1.0 - s))
        tl.store(da + offs, g, mask=mask)
        p = tl.load(pos + rt, mask=m_t, other=0)
        part = dw_part + tl.program_id(0).to(tl.int64) * C * K
        for j in tl.static_range(K):
            back = K - 1 - j
            ok = m_t & (p >= back)
            xv = tl.load(x + (rt - back).to(tl.int64)[:, None] * C + rc[None, :],
                         mask=ok[:, None] & m_c[None, :], other=0.0).to(tl.float32)
            tl.store(part + rc * K + j, tl.sum(g * xv, axis=0), mask=m_c)

    @triton.jit
    def _backward_x(w, pos, da, dx, N, C, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
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
            g = tl.load(da + rt.to(tl.int64)[:, None] * C + rc[None, :], mask=ok[:, None] & m_c[None, :], other=0.0)
            wj = tl.load(w + rc * K + j, mask=m_c, other=0.0).to(tl.float32)
            acc += g * wj[None, :]
        tl.store(dx + rs.to(tl.int64)[:, None] * C + rc[None, :], acc.to(dx.dtype.element_ty),
                 mask=m_s[:, None] & m_c[None, :])

    return triton, _forward, _backward_pre, _backward_x


class _CausalConvSilu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_NC, weight_CK, pos_N):
        triton, forward, _, _ = _triton_kernels()
        (n, c), k = x_NC.shape, weight_CK.shape[1]
        y_NC = torch.empty_like(x_NC)
        grid = (triton.cdiv(n, BLOCK_T), triton.cdiv(c, BLOCK_C))
        if n:
            forward[grid](x_NC, weight_CK, pos_N, y_NC, n, c, K=k, BT=BLOCK_T, BC=BLOCK_C, num_warps=4)
        ctx.save_for_backward(x_NC, weight_CK, pos_N)
        return y_NC

    @staticmethod
    def backward(ctx, dy_NC):
        x_NC, weight_CK, pos_N = ctx.saved_tensors
        triton, _, backward_pre, backward_x = _triton_kernels()
        (n, c), k = x_NC.shape, weight_CK.shape[1]
        grid = (triton.cdiv(n, BLOCK_T), triton.cdiv(c, BLOCK_C))
        da_NC = torch.empty(n, c, dtype=torch.float32, device=x_NC.device)
        dw_part = torch.zeros(grid[0], c, k, dtype=torch.float32, device=x_NC.device)
        dx_NC = torch.empty_like(x_NC)
        if n:
            backward_pre[grid](x_NC, weight_CK, pos_N, dy_NC.contiguous(), da_NC, dw_part, n, c, K=k, BT=BLOCK_T,
                               BC=BLOCK_C, num_warps=4)
            backward_x[grid](weight_CK, pos_N, da_NC, dx_NC, n, c, K=k, BT=BLOCK_T, BC=BLOCK_C, num_warps=4)
        return dx_NC, dw_part.sum(0).to(weight_CK.dtype), None


@torch.compiler.disable  # Triton kernels behind an autograd.Function: eager inside compiled layers
def causal_conv_silu(x_NC: torch.Tensor, weight_CK: torch.Tensor, pos_N: torch.Tensor) -> torch.Tensor:
    """silu(causal_conv(x, weight, pos)) [N, C] in x's dtype; gradients to x and weight."""
    if x_NC.ndim != 2 or weight_CK.shape[0] != x_NC.shape[1] or pos_N.shape != x_NC.shape[:1]:
        raise ValueError(f"x must be [N, C], weight [C, K], pos [N]; got {tuple(x_NC.shape)}, "
                         f"{tuple(weight_CK.shape)}, {tuple(pos_N.shape)}")
    return _CausalConvSilu.apply(x_NC.contiguous(), weight_CK.contiguous(), pos_N.contiguous())
