"""Gated DeltaNet (Qwen3.5's "linear_attention" layers): the mixer and the gated delta rule in
its chunked form (exact in fp32, any device, differentiable), the reference of the bf16 kernels
it takes on CUDA (kernels/gated_delta.py, through flash-linear-attention, and
kernels/causal_conv.py for the conv). The chunk layout and the conv's torch form are shared with
Mamba2 (recurrent.py).

Legend: N tokens (the rows flattened), L chunks, C tokens per chunk, H value heads,
K key dim, V value dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from primerl_models.args import GatedDeltaNet
from primerl_models.blocks.mixer import Mixer
from primerl_models.blocks.norms import GatedRMSNorm
from primerl_models.blocks.recurrent import (
    CHUNK,
    Chunks,
    HeadSplit,
    causal_conv,
    from_chunks,
    fused,
    plain,
    segment_sums,
    to_chunks,
)
from primerl_models.kernels import compiler_disabled, conv, gated_delta
from primerl_models.kernels.state_scan import chunk_states
from primerl_models.packing import PackedSeqs, doc_positions

FAST_KERNELS = True
"""Gated DeltaNet layers on CUDA: the conv through primerl's Triton kernels (kernels/conv.py)
and the rule through flash-linear-attention's bf16 kernels when fla is installed (kernels/gated_delta.py);
False keeps the exact fp32 forms below (the tests' reference)."""


class _UnitLowerSolve(torch.autograd.Function):
    """X = (I + tril(A, -1))^-1 R by the inverse T, which one triangular solve of C columns
    gives; the backward is products with T (dR = T^T dX, dA = -dR X^T below the diagonal)
    instead of a second solve: batched triangular solves are among the slowest kernels of a
    GPU step, and their cost grows with the right-hand side's columns (here 2 x 128 to 64)."""

    @staticmethod
    def forward(ctx, a, r):
        eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device).expand_as(a)
        t = torch.linalg.solve_triangular(a, eye, upper=False, unitriangular=True)
        x = t @ r
        ctx.save_for_backward(t, x)
        return x

    @staticmethod
    def backward(ctx, dx):
        t, x = ctx.saved_tensors
        dr = t.transpose(-1, -2) @ dx
        return -(dr @ x.transpose(-1, -2)).tril(-1), dr


def unit_lower_solve(a: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """(I + A)^-1 R for A's part below the diagonal (its diagonal and upper part are not read)."""
    return _UnitLowerSolve.apply(a, r)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def l2norm_rounded(x: torch.Tensor) -> torch.Tensor:
    """l2norm in fp32, rounded once to x's dtype (fla's own l2norm kernel's arithmetic): the
    q and k that gated_delta.gated_delta_rule takes."""
    return l2norm(x.float()).to(x.dtype)


@compiler_disabled  # eager inside compiled layers: a host sync and a Triton kernel
def gated_delta_rule(q_NHK, k_NHK, v_NHV, g_NH, beta_NH, seqs: PackedSeqs, chunk: int = CHUNK) -> torch.Tensor:
    """o [N, H, V] of S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,
    o_t = S_t^T q_t, with S = 0 at each document's first token. Inputs fp32 (q already scaled).

    Within a chunk, with G the cumulative sum of g from the chunk's start and S_0 the state
    entering it, the state after token t is exp(G_t) S_0 + sum_{s<=t} exp(G_t - G_s) k_s w_s^T,
    where the corrections w solve the unit lower-triangular system
    (I + A) W = beta V - beta exp(G) K S_0, A[t, s] = beta_t exp(G_t - G_s) k_t.k_s (s < t):
    W = U - Kc S_0 with U, Kc solved once for all chunks. Then
    O = exp(G) Q S_0 + (Q K^T * exp(G_t - G_s), s <= t) W, and the state leaving the chunk is
    exp(G_C) S_0 + (exp(G_C - G) K)^T W. The chunks' entering states come from one scan
    (kernels/state_scan.py); everything else is batched over heads and chunks."""
    with torch.autocast(q_NHK.device.type, enabled=False):  # the scan's products stay fp32
        return _gated_delta_rule(q_NHK, k_NHK, v_NHV, g_NH, beta_NH, seqs, chunk)


def _gated_delta_rule(q_NHK, k_NHK, v_NHV, g_NH, beta_NH, seqs: PackedSeqs, chunk: int) -> torch.Tensor:
    layout = Chunks(seqs, chunk)
    run = fused if q_NHK.is_cuda else plain
    strict, rhs, attn, q_decayed, k_to_end, g_end = run(_delta_chunks)(
        q_NHK, k_NHK, v_NHV, g_NH, beta_NH, layout.slot_N, len(layout.starts_L), chunk
    )
    # U and Kc: one solve with both right-hand sides side by side
    UK = unit_lower_solve(strict, rhs)
    U, Kc = UK.split([v_NHV.shape[-1], k_NHK.shape[-1]], dim=-1)
    m, b = run(_delta_transitions)(g_end, k_to_end, U, Kc)
    states = chunk_states(m, b, layout.starts_L)
    return run(_delta_outputs)(q_decayed, attn, Kc, U, states, layout.slot_N)


def _delta_chunks(q_NHK, k_NHK, v_NHV, g_NH, beta_NH, slot_N, n_chunks: int, chunk: int):
    """Everything inside the chunks that does not need the state (see gated_delta_rule)."""
    q, k, v, g, beta = (to_chunks(x, slot_N, n_chunks, chunk) for x in (q_NHK, k_NHK, v_NHV, g_NH, beta_NH))
    G = g.cumsum(dim=-1)  # [H, L, C]: log-decay from the chunk's start through t
    # exp(G_t - G_s) for s <= t, 0 above the diagonal. The exponent is summed directly over
    # s < r <= t (every term <= 0), never as G_t - G_s: with strong decays |G| reaches
    # thousands and the difference would lose the exponent's low digits (1e-4 errors in fp32).
    decay_CC = segment_sums(g).exp()
    # exp(G_C - G_t): the log-decay after t to the chunk's end, summed the same way
    to_end = F.pad(g.flip(-1).cumsum(dim=-1).flip(-1)[..., 1:], (0, 1))
    k_beta = k * beta[..., None]
    strict = (k_beta @ k.transpose(-1, -2)) * decay_CC  # A; its diagonal is ignored
    rhs = torch.cat([v * beta[..., None], k_beta * G.exp()[..., None]], dim=-1)
    attn = (q @ k.transpose(-1, -2)) * decay_CC
    return strict, rhs, attn, q * G.exp()[..., None], k * to_end.exp()[..., None], G[..., -1]


def _delta_transitions(g_end, k_to_end, U, Kc):
    """Over a whole chunk the state goes S -> M S + B: M = exp(G_C) I - (k_to_end)^T Kc,
    B = (k_to_end)^T U."""
    eye = torch.eye(Kc.shape[-1], dtype=Kc.dtype, device=Kc.device)
    m = g_end.exp()[..., None, None] * eye - k_to_end.transpose(-1, -2) @ Kc  # [H, L, K, K]
    return m, k_to_end.transpose(-1, -2) @ U  # B [H, L, K, V]


def _delta_outputs(q_decayed, attn, Kc, U, states, slot_N):
    o = (q_decayed - attn @ Kc) @ states + attn @ U  # [H, L, C, V]
    return from_chunks(o, slot_N)


class GatedDeltaNetMixer(Mixer):
    """The layer (HF names): in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, conv1d, dt_bias,
    A_log, norm, out_proj. A Mixer (mixer.py) that takes no positions."""

    def __init__(self, spec: GatedDeltaNet, dim: int, eps: float):
        super().__init__()
        self.spec = spec
        value = spec.num_v_heads * spec.head_v_dim
        self.in_proj_qkv = nn.Linear(dim, spec.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(dim, value, bias=False)
        self.in_proj_b = nn.Linear(dim, spec.num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(dim, spec.num_v_heads, bias=False)
        self.conv1d = nn.Conv1d(spec.conv_dim, spec.conv_dim, spec.conv_kernel, groups=spec.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(spec.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(spec.num_v_heads))
        self.norm = GatedRMSNorm(spec.head_v_dim, eps)
        self.out_proj = nn.Linear(value, dim, bias=False)

    def prepare(self, seqs: PackedSeqs, device: torch.device) -> None:
        """Build, before the compiled layers, the chunk layout fla's kernels read (a host sync),
        so that none happens inside them."""
        if FAST_KERNELS and device.type == "cuda" and gated_delta.available():
            gated_delta.chunk_indices(seqs)

    def forward(self, x_BTD, cos_BTR, sin_BTR, seqs: PackedSeqs, backend) -> torch.Tensor:
        s = self.spec
        b, t, _ = x_BTD.shape
        split = HeadSplit(backend)
        hv, hk, dk, dv = s.num_v_heads, s.num_k_heads, s.head_k_dim, s.head_v_dim
        key = hk * dk
        qkv_BTC = self.in_proj_qkv(x_BTD)
        ba = split.heads(torch.stack([self.in_proj_b(x_BTD), self.in_proj_a(x_BTD)], dim=-1))  # [B, T', hv', 2]
        n = ba.shape[0] * ba.shape[1]
        if split.size == 1:  # every head on the rows given: the projection's channels as they are
            qkv_NC, w = qkv_BTC.reshape(n, -1), self.conv1d.weight[:, 0]
        else:  # this rank's heads of q, k and v over the whole rows, and their conv weights
            q, k, v = qkv_BTC.split([key, key, hv * dv], dim=-1)
            q, k, v = (split.heads(y.reshape(b, t, -1, d)) for y, d in ((q, dk), (k, dk), (v, dv)))
            qkv_NC = torch.cat([q.reshape(n, -1), k.reshape(n, -1), v.reshape(n, -1)], dim=-1)
            w_q, w_k, w_v = self.conv1d.weight[:, 0].split([key, key, s.num_v_heads * dv])
            w = torch.cat(
                [split.part(w_q, s.num_k_heads), split.part(w_k, s.num_k_heads), split.part(w_v, s.num_v_heads)]
            )
        hk, hv = hk // split.size, hv // split.size  # this rank's heads (all of them without CP)
        # the conv accumulates in fp32, one rounding after the SiLU: primerl's Triton kernels on
        # CUDA (kernels/conv.py), else the torch form
        if FAST_KERNELS and x_BTD.is_cuda:
            qkv_NC = conv.causal_conv_silu(qkv_NC, w, doc_positions(seqs))
        else:
            qkv_NC = F.silu(causal_conv(qkv_NC.float(), w.float(), doc_positions(seqs))).to(qkv_NC.dtype)
        # the rule through fla's bf16 kernels on CUDA (GVA inside; the L2 norms and v's copy to
        # contiguous memory here, in the compiled graph), else the exact fp32 form
        fast = FAST_KERNELS and gated_delta.usable(x_BTD, dk)
        q, k, v = qkv_NC.split([hk * dk, hk * dk, hv * dv], dim=-1)
        q, k, v = q.reshape(n, hk, dk), k.reshape(n, hk, dk), v.reshape(n, hv, dv)
        beta_NH = torch.sigmoid(ba[..., 0].float()).reshape(n, hv)
        dt_bias, a_log = (split.part(p, s.num_v_heads).float() for p in (self.dt_bias, self.A_log))
        g_NH = -a_log.exp() * F.softplus(ba[..., 1].float().reshape(n, hv) + dt_bias)
        if fast:
            q, k, v = l2norm_rounded(q), l2norm_rounded(k), v.contiguous()
            o = gated_delta.gated_delta_rule(q, k, v, g_NH, beta_NH.to(v.dtype), seqs, dk**-0.5)
        else:
            if hv > hk:  # each key head serves hv / hk value heads
                q, k = q.repeat_interleave(hv // hk, dim=1), k.repeat_interleave(hv // hk, dim=1)
            q = l2norm(q.float()) * dk**-0.5
            o = gated_delta_rule(q, l2norm(k.float()), v.float(), g_NH, beta_NH, seqs)
        o_BTHV = split.tokens(o.reshape(ba.shape[0], ba.shape[1], hv, dv))
        z_BTHV = self.in_proj_z(x_BTD).reshape(b, t, -1, dv)
        o_BTHV = self.norm(o_BTHV.to(z_BTHV.dtype), z_BTHV)
        return self.out_proj(o_BTHV.reshape(b, t, -1))
