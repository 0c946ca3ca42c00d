"""The Gated DeltaNet rule through flash-linear-attention's Triton kernels
(bf16 operands, fp32 accumulation, `cu_seqlens` for packed rows), the fast GPU path of
`linear_attention.GatedDeltaNetMixer`. Imported only on CUDA; fla (`fla-core`, pure Python +
Triton) is an optional dependency: `pip install primerl-models[cuda]`.

fla refuses its Gated DeltaNet backward on Hopper with Triton >= 3.4 and < 3.7.1 (fla issue
#640: one kernel, `chunk_bwd_dqkwg`, transposes a matmul accumulator in registers, which those
Triton versions compile wrongly, so dq, dk and dg come out wrong). torch 2.11 pins Triton 3.6.
This module registers its own kernel for that one step with fla's backend registry (fla's
extension point for replacing a kernel), used only on that combination: it reads the
transposed products from memory instead of transposing an accumulator (`primerl_dqkwg`).

    o_NHV = gated_delta_rule(q_NHK, k_NHK, v_NHV, g_NH, beta_NH, seqs, scale)

q and k come L2-normalised (the caller's compiled graph does it, fused with its neighbours:
two of fla's launches less a layer, each costing ~0.2 ms of host time where the forward is
host-bound), their heads may divide v's (GVA).

Legend: N tokens (the rows flattened), H value heads, Hk key heads, K key dim, V value dim,
C tokens per chunk.
"""

from __future__ import annotations

import functools
import re
from types import SimpleNamespace
from typing import Any

import torch

from primerl_models.kernels import compiler_disabled
from primerl_models.packing import PackedSeqs

CHUNK = 64
MAX_KEY_DIM = 128
"""The widest key head `primerl_dqkwg` holds in one block (Qwen3.5's are 128)."""
REPLACE_DQKWG = True
"""Use primerl's dq/dk/dg kernel where fla refuses its own (bench/gdn_kernels.py turns it off
to show fla's error)."""
KEEP_STATES = True
"""Keep the forward's WY factors, chunk states and corrected values for the backward
(_rule_forward) rather than recompute them as fla's own autograd Function does: ~8 ms of a
16k-token Qwen3.5-0.8B step on an H200 for ~260 MB a layer."""


_AVAILABLE: bool | None = None


@torch.compiler.assume_constant_result  # a constant to compiled layers, checked eagerly once
def available() -> bool:
    """fla and Triton importable (imported, and primerl's kernel registered, on the first call)."""
    global _AVAILABLE
    if _AVAILABLE is None:
        try:
            import fla.ops.gated_delta_rule  # noqa: F401  # pyright: ignore[reportMissingImports]
        except ImportError:
            _AVAILABLE = False
        else:
            _register_dqkwg()
            _AVAILABLE = True
    return _AVAILABLE


def usable(q_NHK: torch.Tensor, key_dim: int) -> bool:
    """The fast path applies: CUDA tensors, fla importable, a key head it was checked for."""
    return q_NHK.is_cuda and key_dim <= MAX_KEY_DIM and available()


def chunk_indices(seqs: PackedSeqs) -> tuple[torch.Tensor, torch.Tensor]:
    """(cu_seqlens int64, fla's chunk indices [L, 2]), kept on `seqs`: built before the compiled
    layers (GatedDeltaNetMixer.prepare), else here, eagerly (a host sync: a graph break)."""
    key = ("fla", CHUNK)
    if key not in seqs.chunk_layouts:
        _build_chunk_indices(seqs)
    return seqs.chunk_layouts[key]


@compiler_disabled  # a host sync (the number of chunks)
def _build_chunk_indices(seqs: PackedSeqs) -> None:
    from fla.ops.utils import prepare_chunk_indices  # pyright: ignore[reportMissingImports]

    cu = seqs.cu_seqlens.long()
    seqs.chunk_layouts[("fla", CHUNK)] = (cu, prepare_chunk_indices(cu, CHUNK))


def gated_delta_rule(q_NHK, k_NHK, v_NHV, g_NH, beta_NH, seqs: PackedSeqs, scale: float) -> torch.Tensor:
    """o [N, H, V] of the gated delta rule (linear_attention.gated_delta_rule's definition) of
    L2-normalised q and k, q scaled by `scale`; the state restarts at each document. Through
    the custom ops below: no graph break inside a compiled layer."""
    cu, indices = chunk_indices(seqs)
    q, k, v, g, beta = (t[None] for t in (q_NHK, k_NHK, v_NHV, g_NH.float(), beta_NH))
    if KEEP_STATES and stages_found():
        return _rule_forward(q, k, v, g, beta, cu, indices, scale)[0][0]
    return _fla_rule(q, k, v, g, beta, cu, indices, scale)[0]


@compiler_disabled  # fla's own autograd Function
def _fla_rule(q, k, v, g, beta, cu, indices, scale):
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # pyright: ignore[reportMissingImports]

    o, _ = chunk_gated_delta_rule(
        q,
        k,
        v,
        g,
        beta,
        scale=scale,
        use_qk_l2norm_in_kernel=False,
        cu_seqlens=cu,
        chunk_indices=indices,
        chunk_size=CHUNK,
    )
    return o


@torch.compiler.assume_constant_result
def stages_found() -> bool:
    return _stages() is not None


@functools.cache
def _stages():
    """fla's stage functions of the chunked rule (fla 0.6's layout), or None where they moved:
    then fla's public function runs."""
    try:
        from fla.ops.common.chunk_delta_h import (  # pyright: ignore[reportMissingImports]
            chunk_gated_delta_rule_bwd_dhu,
            chunk_gated_delta_rule_fwd_h,
        )
        from fla.ops.common.chunk_o import (  # pyright: ignore[reportMissingImports]
            chunk_bwd_dqkwg,
            chunk_bwd_dv_local,
            chunk_fwd_o,
        )
        from fla.ops.gated_delta_rule.chunk_fwd import (  # pyright: ignore[reportMissingImports]
            chunk_gated_delta_rule_fwd_intra,
        )
        from fla.ops.gated_delta_rule.wy_fast import prepare_wy_repr_bwd  # pyright: ignore[reportMissingImports]
        from fla.ops.utils import chunk_local_cumsum  # pyright: ignore[reportMissingImports]
        from fla.ops.utils.constant import RCP_LN2  # pyright: ignore[reportMissingImports]
    except ImportError:
        return None
    return SimpleNamespace(
        bwd_dhu=chunk_gated_delta_rule_bwd_dhu,
        fwd_h=chunk_gated_delta_rule_fwd_h,
        dqkwg=chunk_bwd_dqkwg,
        dv_local=chunk_bwd_dv_local,
        fwd_o=chunk_fwd_o,
        fwd_intra=chunk_gated_delta_rule_fwd_intra,
        wy_bwd=prepare_wy_repr_bwd,
        cumsum=chunk_local_cumsum,
        rcp_ln2=RCP_LN2,
    )


# The rule through fla's stages as two custom ops, [1, N, heads, dim] operands (one packed row,
# q and k L2-normalised), so that a compiled layer holds them without a graph break (each break
# costs the host a compiled region's entry and exit, where the forward is host-bound). Forward:
# the chunk-local decay sums (log2), the WY factors, the chunk states with the corrected values,
# the output; it returns those intermediates too, kept for the backward (fla's own autograd
# Function recomputes them: ~8 ms of a 16k-token Qwen3.5-0.8B step on an H200). Backward: the
# states' gradients, dq/dk/dw/dg, the WY factors' backward, the decay sums' reverse.
Tensor = torch.Tensor


@torch.library.custom_op("primerl::gated_delta_rule_fwd", mutates_args=())
def _rule_forward(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, cu: Tensor, indices: Tensor, scale: float
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(o, g's chunk sums, A, w, h, v_new)."""
    f = _stages()
    assert f is not None, "gated_delta_rule calls this op only when stages_found()"
    q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))
    span = dict(cu_seqlens=cu, chunk_indices=indices)
    g = f.cumsum(g, chunk_size=CHUNK, scale=f.rcp_ln2, **span)
    w, u, a = f.fwd_intra(k=k, v=v, g=g, beta=beta, chunk_size=CHUNK, **span)
    h, v_new, _ = f.fwd_h(k=k, w=w, u=u, g=g, initial_state=None, output_final_state=False, chunk_size=CHUNK, **span)
    o = f.fwd_o(q=q, k=k, v=v_new, h=h, g=g, scale=scale, chunk_size=CHUNK, **span)
    return o.to(v.dtype), g.float(), a.to(k.dtype), w.to(k.dtype), h.to(k.dtype), v_new.to(v.dtype)


def _like(x: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """A contiguous tensor of x's shape (the ops' outputs are contiguous whatever their inputs' strides)."""
    return x.new_empty(x.shape, dtype=dtype or x.dtype)


@_rule_forward.register_fake
def _(q, k, v, g, beta, cu, indices, scale):
    (_, n, heads, dv), dk = v.shape, k.shape[-1]
    return (
        _like(v),
        _like(g, torch.float32),
        k.new_empty(1, n, heads, CHUNK),
        k.new_empty(1, n, heads, dk),
        k.new_empty(1, indices.shape[0], heads, dk, dv),
        _like(v),
    )


@torch.library.custom_op("primerl::gated_delta_rule_bwd", mutates_args=())
def _rule_backward(
    do: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    a: Tensor,
    w: Tensor,
    h: Tensor,
    v_new: Tensor,
    cu: Tensor,
    indices: Tensor,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv, dg, dbeta) from the forward's kept intermediates (g: its chunk sums)."""
    f = _stages()
    assert f is not None, "the backward of _rule_forward, which ran with fla's stages"
    q, k, v, beta, do = (t.contiguous() for t in (q, k, v, beta, do))
    span = dict(cu_seqlens=cu, chunk_indices=indices, chunk_size=CHUNK)
    dv = f.dv_local(q=q, k=k, g=g, do=do, scale=scale, **span)
    dh, _, dv = f.bwd_dhu(q=q, k=k, w=w, g=g, h0=None, dht=None, do=do, dv=dv, scale=scale, **span)
    dq, dk, dw, dg = f.dqkwg(q=q, k=k, v=v_new, w=w, g=g, h=h, dv=dv, do=do, dh=dh, scale=scale, **span)
    dk2, dv, db, dg2 = f.wy_bwd(k=k, v=v, beta=beta, g=g, A=a, dw=dw, du=dv, cu_seqlens=cu, chunk_indices=indices)
    dk.add_(dk2)
    dg.add_(dg2)
    dg = f.cumsum(dg, reverse=True, **span)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dg.float(), db.to(beta.dtype)


@_rule_backward.register_fake
def _(do, q, k, v, g, beta, a, w, h, v_new, cu, indices, scale):
    return _like(q), _like(k), _like(v), _like(g, torch.float32), _like(beta)


def _rule_setup(ctx, inputs, output):
    q, k, v, _, beta, cu, indices, scale = inputs
    _, g, a, w, h, v_new = output
    ctx.mark_non_differentiable(g, a, w, h, v_new)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(q, k, v, g, beta, a, w, h, v_new, cu, indices)
    ctx.scale = scale


def _rule_grad(ctx, do, *_):
    dq, dk, dv, dg, db = _rule_backward(do, *ctx.saved_tensors, ctx.scale)
    return dq, dk, dv, dg, db, None, None, None


_rule_forward.register_autograd(_rule_grad, setup_context=_rule_setup)


@functools.cache
def triton_miscompiles_dqkwg() -> bool:
    """Hopper with 3.4 <= Triton < 3.7.1: fla's own dq/dk/dg kernel is refused there (#640)."""
    import triton  # pyright: ignore[reportMissingImports]

    version = tuple(int(part) for part in re.findall(r"\d+", triton.__version__)[:3])
    return torch.cuda.get_device_capability()[0] == 9 and (3, 4, 0) <= version < (3, 7, 1)


def _register_dqkwg() -> None:
    from fla.backends import BaseBackend, register  # pyright: ignore[reportMissingImports]

    class PrimerlDqkwg(BaseBackend):
        backend_type = "primerl"
        priority = 4  # before fla's TileLang replacement of the same kernel, when both apply

        @classmethod
        def is_available(cls) -> bool:
            return REPLACE_DQKWG and triton_miscompiles_dqkwg()

        def chunk_bwd_dqkwg_verifier(
            self,
            q,
            k,
            v,
            do,
            h,
            dh,
            w=None,
            g=None,
            g_gamma=None,
            dv=None,
            scale=None,
            state_v_first=False,
            cu_seqlens=None,
            chunk_size=64,
            chunk_indices=None,
        ):
            if g is None or g_gamma is not None or w is None or dv is None or state_v_first:
                return False, "primerl's dqkwg kernel covers the gated delta rule only"
            if k.shape[-1] > MAX_KEY_DIM:
                return False, f"primerl's dqkwg kernel holds key heads of up to {MAX_KEY_DIM}"
            return True, None

        def chunk_bwd_dqkwg(
            self,
            q,
            k,
            v,
            do,
            h,
            dh,
            w=None,
            g=None,
            g_gamma=None,
            dv=None,
            scale=None,
            state_v_first=False,
            cu_seqlens=None,
            chunk_size=64,
            chunk_indices=None,
        ):
            return dqkwg(q, k, v, do, h, dh, w, g, dv, scale, cu_seqlens, chunk_size, chunk_indices)

    register("common")(PrimerlDqkwg)


def dqkwg(q, k, v, do, h, dh, w, g, dv, scale, cu_seqlens, chunk_size, chunk_indices):
    """The gradients of one chunked step of the gated delta rule's backward, given the states
    entering each chunk h [L, H, K, V] and their gradients dh, the corrected values v (U - W h),
    their gradient dv and g, the log2-decay summed from each chunk's start:

        dq = exp2(g) * scale * do h^T + dS k          dS[t, s] = scale exp2(g_t - g_s) do_t.v_s, s <= t
        dk = exp2(g_C - g) * v dh^T + dS^T q          (g_C: the chunk's last token)
        dw = -dv h^T
        dg = rowsum(dq * q) - rowsum(dk * k), plus sum(h * dh) exp2(g_C) + sum(dk_state * k)
             at the chunk's last token (dk_state: dk's first term)

    dq and dk per value head, then summed over the value heads that share a key head. Shapes are
    fla's: [B, T, heads, dim], one row when `cu_seqlens` is given."""
    from fla.ops.utils import prepare_chunk_indices  # pyright: ignore[reportMissingImports]

    kernel = _dqkwg_triton()
    q, k, v, do, h, dh, w, g, dv = (x.contiguous() for x in (q, k, v, do, h, dh, w, g, dv))
    b, t, hk, kd = k.shape
    hv, vd = v.shape[2], v.shape[3]
    if cu_seqlens is None:  # B rows of T tokens: the same as one row of B documents
        cu_seqlens = torch.arange(0, (b + 1) * t, t, device=k.device, dtype=torch.long)
        chunk_indices = None
    if chunk_indices is None:
        chunk_indices = prepare_chunk_indices(cu_seqlens, chunk_size)
    n_chunks = len(chunk_indices)
    dq = q.new_empty(b, t, hv, kd)
    dk = k.new_empty(b, t, hv, kd)
    dw = torch.empty_like(w)
    dg = torch.empty(b, t, hv, dtype=torch.float32, device=g.device)
    block_k = max(16, 1 << (kd - 1).bit_length())
    kernel[(n_chunks, hv)](
        q,
        k,
        v,
        do,
        h,
        dh,
        dv,
        g,
        dq,
        dk,
        dw,
        dg,
        cu_seqlens,
        chunk_indices,
        scale,
        HK=hk,
        HV=hv,
        K=kd,
        V=vd,
        BT=chunk_size,
        BK=block_k,
        BV=64,
    )
    if hk != hv:
        dq = dq.view(b, t, hk, hv // hk, kd).sum(3)
        dk = dk.view(b, t, hk, hv // hk, kd).sum(3)
    return dq, dk, dw, dg


@functools.cache
def _dqkwg_triton() -> Any:
    """The autotuned JIT kernel (Any: Triton's types, which the checker cannot see without Triton)."""
    import triton  # pyright: ignore[reportMissingImports]
    import triton.language as tl  # pyright: ignore[reportMissingImports]

    @triton.autotune(
        configs=[triton.Config({}, num_warps=w, num_stages=s) for w in (4, 8) for s in (1, 2, 3)],
        key=["HK", "HV", "K", "V", "BT"],
    )
    @triton.jit
    def primerl_dqkwg(
        q,
        k,
        v,
        do,
        h,
        dh,
        dv,
        g,
        dq,
        dk,
        dw,
        dg,
        cu_seqlens,
        chunk_indices,
        scale,
        HK: tl.constexpr,
        HV: tl.constexpr,
        K: tl.constexpr,
        V: tl.constexpr,
        BT: tl.constexpr,
        BK: tl.constexpr,
        BV: tl.constexpr,
    ):
        # One program per (chunk, value head). Every product whose transpose is needed is
        # computed as such from memory (v do^T beside do v^T; h and dh read as [V, K]), so no
        # accumulator is transposed in registers: that is what Triton 3.4-3.7.0 miscompiles on
        # Hopper (fla #640).
        i_c, i_h = tl.program_id(0), tl.program_id(1)
        doc = tl.load(chunk_indices + i_c * 2).to(tl.int64)
        part = tl.load(chunk_indices + i_c * 2 + 1).to(tl.int64)
        start = tl.load(cu_seqlens + doc).to(tl.int64) + part * BT
        end = tl.load(cu_seqlens + doc + 1).to(tl.int64)
        n_valid = tl.minimum(end - start, BT)
        rt = tl.arange(0, BT)
        rk = tl.arange(0, BK)
        m_t = rt < n_valid
        m_k = rk < K
        tok = start + rt  # this chunk's tokens
        i_hk = i_h // (HV // HK)

        state = (i_c * HV + i_h).to(tl.int64) * K * V  # h, dh: [L, HV, K, V]
        acc_dq = tl.zeros([BT, BK], dtype=tl.float32)
        acc_dk = tl.zeros([BT, BK], dtype=tl.float32)
        acc_dw = tl.zeros([BT, BK], dtype=tl.float32)
        ds = tl.zeros([BT, BT], dtype=tl.float32)  # do v^T
        ds_t = tl.zeros([BT, BT], dtype=tl.float32)  # v do^T
        h_dh = tl.zeros([1], dtype=tl.float32)  # sum(h * dh)
        for v0 in range(0, V, BV):
            rv = v0 + tl.arange(0, BV)
            m_v = rv < V
            tv = tok[:, None] * (HV * V) + i_h * V + rv[None, :]  # [BT, BV]
            vt = tok[None, :] * (HV * V) + i_h * V + rv[:, None]  # [BV, BT]
            m_tv = m_t[:, None] & m_v[None, :]
            m_vt = m_v[:, None] & m_t[None, :]
            b_v = tl.load(v + tv, mask=m_tv, other=0.0)
            b_do = tl.load(do + tv, mask=m_tv, other=0.0)
            b_dv = tl.load(dv + tv, mask=m_tv, other=0.0)
            b_vt = tl.load(v + vt, mask=m_vt, other=0.0)
            b_dot = tl.load(do + vt, mask=m_vt, other=0.0)
            hv_offs = state + rk[None, :] * V + rv[:, None]  # [BV, BK]: h^T
            m_vk = m_v[:, None] & m_k[None, :]
            b_ht = tl.load(h + hv_offs, mask=m_vk, other=0.0)
            b_dht = tl.load(dh + hv_offs, mask=m_vk, other=0.0)
            h_dh += tl.sum(b_ht.to(tl.float32) * b_dht.to(tl.float32))
            ds = tl.dot(b_do, b_vt, ds)
            ds_t = tl.dot(b_v, b_dot, ds_t)
            acc_dq = tl.dot(b_do, b_ht.to(b_do.dtype), acc_dq)
            acc_dk = tl.dot(b_v, b_dht.to(b_v.dtype), acc_dk)
            acc_dw = tl.dot(b_dv.to(b_v.dtype), b_ht.to(b_v.dtype), acc_dw)

        tk_out = tok[:, None] * (HV * K) + i_h * K + rk[None, :]
        m_tk = m_t[:, None] & m_k[None, :]
        tl.store(dw + tk_out, (-acc_dw).to(dw.dtype.element_ty), mask=m_tk)

        tk_in = tok[:, None] * (HK * K) + i_hk * K + rk[None, :]
        b_q = tl.load(q + tk_in, mask=m_tk, other=0.0)
        b_k = tl.load(k + tk_in, mask=m_tk, other=0.0)
        b_g = tl.load(g + tok * HV + i_h, mask=m_t, other=0.0)
        g_last = tl.load(g + (start + n_valid - 1) * HV + i_h)

        b_dq = acc_dq * tl.exp2(b_g)[:, None] * scale
        b_dk = acc_dk * tl.where(m_t, tl.exp2(g_last - b_g), 0.0)[:, None]
        dg_last = tl.sum(h_dh) * tl.exp2(g_last) + tl.sum(b_dk * b_k.to(tl.float32))

        valid = m_t[:, None] & m_t[None, :]
        lower = (rt[:, None] >= rt[None, :]) & valid  # [t, s], s <= t
        upper = (rt[:, None] <= rt[None, :]) & valid  # [s, t], s <= t
        b_ds = tl.where(lower, ds * tl.exp2(b_g[:, None] - b_g[None, :]), 0.0) * scale
        b_ds_t = tl.where(upper, ds_t * tl.exp2(b_g[None, :] - b_g[:, None]), 0.0) * scale
        b_dq = tl.dot(b_ds.to(b_k.dtype), b_k, b_dq)
        b_dk = tl.dot(b_ds_t.to(b_q.dtype), b_q, b_dk)

        b_dg = tl.sum(b_dq * b_q.to(tl.float32), axis=1) - tl.sum(b_dk * b_k.to(tl.float32), axis=1)
        b_dg = tl.where(rt == n_valid - 1, b_dg + dg_last, b_dg)
        tl.store(dq + tk_out, b_dq.to(dq.dtype.element_ty), mask=m_tk)
        tl.store(dk + tk_out, b_dk.to(dk.dtype.element_ty), mask=m_tk)
        tl.store(dg + tok * HV + i_h, b_dg, mask=m_t)

    return primerl_dqkwg
