"""Mixers that carry a recurrent state along the sequence: Gated DeltaNet (Qwen3.5's linear
attention) and Mamba2 (Nemotron-H). Packed rows hold several documents, so the state and the short causal convolution
restart at every document boundary (`PackedSeqs`); a state leaking from one document into the
next would change every later token and no loss would show it.

The scan is the chunked form (exact in fp32, any device, differentiable): tokens are laid out
so that every document starts a chunk of C tokens (padding the tail of its last chunk), each
chunk is solved in parallel with a triangular system (the WY form of the delta rule) in
batched torch ops, and the state is carried from chunk to chunk by one recurrence
(state_scan.py: a Triton kernel on CUDA, a loop elsewhere), zeroed at every chunk that starts
a document.

Legend: N tokens (the rows flattened), L chunks, C tokens per chunk, H value heads,
K key dim, V value dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from primerl_models.common import conv_kernels, gdn_fla
from primerl_models.common.args import GatedDeltaNet, Mamba2
from primerl_models.common.attention import PackedSeqs
from primerl_models.common.state_scan import chunk_states

CHUNK = 64
FAST_KERNELS = True
"""Gated DeltaNet layers on CUDA: the conv through primerl's Triton kernels (conv_kernels.py)
and the rule through flash-linear-attention's bf16 kernels when fla is installed (gdn_fla.py);
False keeps the exact fp32 forms below (the tests' reference)."""


def doc_positions(seqs: PackedSeqs) -> torch.Tensor:
    """int64 [N]: each token's position inside its document."""
    cu, doc_N = seqs.cu_seqlens.long(), seqs.doc_ids_BT.flatten().long()
    return torch.arange(len(doc_N), device=doc_N.device) - cu[doc_N]


def causal_conv(x_NC: torch.Tensor, weight_CK: torch.Tensor, pos_N: torch.Tensor,
                bias_C: torch.Tensor | None = None) -> torch.Tensor:
    """Depthwise causal convolution over the flattened tokens that restarts at each document:
    out[n] = bias + sum_j weight[:, K-1-j] * x[n-j] over the j <= pos[n] (the document's own
    earlier tokens; torch's conv1d with K-1 zeros of left padding on each document alone)."""
    n, k = x_NC.shape[0], weight_CK.shape[1]
    out_NC = x_NC * weight_CK[:, k - 1]
    for j in range(1, k):
        shifted_NC = torch.cat([x_NC.new_zeros(min(j, n), x_NC.shape[1]), x_NC[: max(n - j, 0)]])
        out_NC = out_NC + shifted_NC * (pos_N >= j).to(x_NC.dtype)[:, None] * weight_CK[:, k - 1 - j]
    return out_NC if bias_C is None else out_NC + bias_C


def chunk_layout(seqs: PackedSeqs, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(slot_N, starts_L): where token n goes in the [L * C] layout in which every document
    starts a chunk, and which chunks start a document. Built once per forward (kept on `seqs`)."""
    if chunk not in seqs.chunk_layouts:
        cu = seqs.cu_seqlens.long()
        chunks_S = (cu[1:] - cu[:-1] + chunk - 1) // chunk
        first_S = chunks_S.cumsum(0) - chunks_S
        total = int(chunks_S.sum())  # the host sync: the number of chunks
        slot_N = first_S[seqs.doc_ids_BT.flatten().long()] * chunk + doc_positions(seqs)
        starts_L = torch.zeros(total, dtype=torch.bool, device=cu.device)
        starts_L[first_S] = True
        seqs.chunk_layouts[chunk] = (slot_N, starts_L)
    return seqs.chunk_layouts[chunk]


class _Chunks:
    """The layout in which every document starts a chunk (chunk_layout), both ways."""

    def __init__(self, seqs: PackedSeqs, chunk: int):
        self.chunk = chunk
        self.slot_N, self.starts_L = chunk_layout(seqs, chunk)

    def split(self, x: torch.Tensor) -> torch.Tensor:
        """[N, H, ...] -> [H, L, C, ...], zeros in the padding."""
        return _split(x, self.slot_N, len(self.starts_L), self.chunk)

    def join(self, y: torch.Tensor) -> torch.Tensor:
        """[H, L, C, ...] -> [N, H, ...], the padding dropped."""
        return _join(y, self.slot_N)


def segment_sums(g: torch.Tensor) -> torch.Tensor:
    """[..., C, C]: out[t, s] = sum of g over s < r <= t (0 on the diagonal), -inf above it."""
    c = g.shape[-1]
    terms = g[..., :, None].expand(*g.shape, c)  # terms[r, s] = g_r
    lower = torch.ones(c, c, dtype=torch.bool, device=g.device).tril(-1)
    sums = terms.masked_fill(~lower, 0.0).cumsum(dim=-2)  # over r <= t, keeping r > s
    return sums.masked_fill(~torch.ones(c, c, dtype=torch.bool, device=g.device).tril(), float("-inf"))


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
    q and k that gdn_fla.gated_delta_rule takes."""
    return l2norm(x.float()).to(x.dtype)


@torch.compiler.disable  # eager inside compiled layers: a host sync and a Triton kernel
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
    (state_scan.py); everything else is batched over heads and chunks."""
    with torch.autocast(q_NHK.device.type, enabled=False):  # the scan's products stay fp32
        return _gated_delta_rule(q_NHK, k_NHK, v_NHV, g_NH, beta_NH, seqs, chunk)


def _gated_delta_rule(q_NHK, k_NHK, v_NHV, g_NH, beta_NH, seqs: PackedSeqs, chunk: int) -> torch.Tensor:
    layout = _Chunks(seqs, chunk)
    fused = _fused if q_NHK.is_cuda else _plain
    strict, rhs, attn, q_decayed, k_to_end, g_end = fused(_delta_chunks)(
        q_NHK, k_NHK, v_NHV, g_NH, beta_NH, layout.slot_N, len(layout.starts_L), chunk)
    # U and Kc: one solve with both right-hand sides side by side
    UK = unit_lower_solve(strict, rhs)
    U, Kc = UK.split([v_NHV.shape[-1], k_NHK.shape[-1]], dim=-1)
    m, b = fused(_delta_transitions)(g_end, k_to_end, U, Kc)
    states = chunk_states(m, b, layout.starts_L)
    return fused(_delta_outputs)(q_decayed, attn, Kc, U, states, layout.slot_N)


def _delta_chunks(q_NHK, k_NHK, v_NHV, g_NH, beta_NH, slot_N, n_chunks: int, chunk: int):
    """Everything inside the chunks that does not need the state (see gated_delta_rule)."""
    q, k, v, g, beta = (_split(x, slot_N, n_chunks, chunk) for x in (q_NHK, k_NHK, v_NHV, g_NH, beta_NH))
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
    return _join(o, slot_N)


def _split(x: torch.Tensor, slot_N: torch.Tensor, n_chunks: int, chunk: int) -> torch.Tensor:
    """[N, H, ...] -> [H, L, C, ...] in the chunk layout, zeros in the padding."""
    padded = x.new_zeros((n_chunks * chunk, *x.shape[1:])).index_copy(0, slot_N, x)
    return padded.view(n_chunks, chunk, *x.shape[1:]).movedim(2, 0)


def _join(y: torch.Tensor, slot_N: torch.Tensor) -> torch.Tensor:
    """[H, L, C, ...] -> [N, H, ...], the padding dropped."""
    h, n_chunks, chunk = y.shape[:3]
    return y.movedim(0, 2).reshape(n_chunks * chunk, h, *y.shape[3:]).index_select(0, slot_N)


def _plain(fn):
    return fn


_COMPILED: dict = {}


def _fused(fn):
    """`fn` compiled (on CUDA): the chunks' elementwise work fused around the matmuls, which
    as separate kernels took half a layer's time (bench/scan_kernel.py's profile). Shapes
    marked dynamic: the number of chunks changes with every batch's documents."""
    if fn not in _COMPILED:
        _COMPILED[fn] = torch.compile(fn, dynamic=True)
    return _COMPILED[fn]


class GatedRMSNorm(nn.Module):
    """RMSNorm over each value head, times weight, times silu(z) (Qwen3.5's RMSNormGated)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)
        return (self.weight.to(x.dtype) * normed * F.silu(z.float())).to(x.dtype)


class GatedDeltaNetMixer(nn.Module):
    """The layer (HF names): in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, conv1d, dt_bias,
    A_log, norm, out_proj. Called like attention; positions are not used."""

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
        if FAST_KERNELS and device.type == "cuda" and gdn_fla.available():
            gdn_fla.chunk_indices(seqs)

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
            w = torch.cat([split.part(w_q, s.num_k_heads), split.part(w_k, s.num_k_heads),
                           split.part(w_v, s.num_v_heads)])
        hk, hv = hk // split.size, hv // split.size  # this rank's heads (all of them without CP)
        # the conv accumulates in fp32, one rounding after the SiLU: primerl's Triton kernels on
        # CUDA (conv_kernels.py), else the torch form
        if FAST_KERNELS and x_BTD.is_cuda:
            qkv_NC = conv_kernels.causal_conv_silu(qkv_NC, w, doc_positions(seqs))
        else:
            qkv_NC = F.silu(causal_conv(qkv_NC.float(), w.float(), doc_positions(seqs))).to(qkv_NC.dtype)
        # the rule through fla's bf16 kernels on CUDA (GVA inside; the L2 norms and v's copy to
        # contiguous memory here, in the compiled graph), else the exact fp32 form
        fast = FAST_KERNELS and gdn_fla.usable(x_BTD, dk)
        q, k, v = qkv_NC.split([hk * dk, hk * dk, hv * dv], dim=-1)
        q, k, v = q.reshape(n, hk, dk), k.reshape(n, hk, dk), v.reshape(n, hv, dv)
        beta_NH = torch.sigmoid(ba[..., 0].float()).reshape(n, hv)
        dt_bias, a_log = (split.part(p, s.num_v_heads).float() for p in (self.dt_bias, self.A_log))
        g_NH = -a_log.exp() * F.softplus(ba[..., 1].float().reshape(n, hv) + dt_bias)
        if fast:
            q, k, v = l2norm_rounded(q), l2norm_rounded(k), v.contiguous()
            o = gdn_fla.gated_delta_rule(q, k, v, g_NH, beta_NH.to(v.dtype), seqs, dk**-0.5)
        else:
            if hv > hk:  # each key head serves hv / hk value heads
                q, k = q.repeat_interleave(hv // hk, dim=1), k.repeat_interleave(hv // hk, dim=1)
            q = l2norm(q.float()) * dk**-0.5
            o = gated_delta_rule(q, l2norm(k.float()), v.float(), g_NH, beta_NH, seqs)
        o_BTHV = split.tokens(o.reshape(ba.shape[0], ba.shape[1], hv, dv))
        z_BTHV = self.in_proj_z(x_BTD).reshape(b, t, -1, dv)
        o_BTHV = self.norm(o_BTHV.to(z_BTHV.dtype), z_BTHV)
        return self.out_proj(o_BTHV.reshape(b, t, -1))


class HeadSplit:
    """Context parallelism around a recurrent mixer: when the attention back-end offers Ulysses'
    all-to-alls (`to_heads`, `to_tokens`, `rank`, `size`), each rank runs the conv and the scan
    over the whole rows for its share of the heads (its rows of the per-channel conv weights
    and of the per-head parameters); otherwise every head, on the rows given."""

    def __init__(self, backend):
        self.backend = backend if hasattr(backend, "to_heads") else None
        self.rank, self.size = (backend.rank, backend.size) if self.backend else (0, 1)

    def heads(self, x_BTHK: torch.Tensor) -> torch.Tensor:
        return x_BTHK if self.backend is None else self.backend.to_heads(x_BTHK)

    def tokens(self, x_BTHK: torch.Tensor) -> torch.Tensor:
        return x_BTHK if self.backend is None else self.backend.to_tokens(x_BTHK)

    def part(self, w: torch.Tensor, heads: int) -> torch.Tensor:
        """This rank's rows of `w`, whose rows are `heads` equal blocks, one per head."""
        if self.size == 1:
            return w
        if heads % self.size:
            raise ValueError(f"{heads} heads cannot be split over a context-parallel group of {self.size}")
        return w.reshape(self.size, -1, *w.shape[1:])[self.rank]


def ssd_scan(c_NHS, b_NHS, v_NHP, a_NH, seqs: PackedSeqs, chunk: int = CHUNK) -> torch.Tensor:
    """y [N, H, P] of Mamba2's state space S_t = exp(a_t) S_{t-1} + b_t v_t^T, y_t = S_t^T c_t
    (S [state, P] per head), S = 0 at each document's first token: the gated delta rule's
    chunk form without the delta correction (inputs fp32; v = dt x, a = dt A)."""
    with torch.autocast(c_NHS.device.type, enabled=False):
        layout = _Chunks(seqs, chunk)
        c, b, v, a = (layout.split(x) for x in (c_NHS, b_NHS, v_NHP, a_NH))
        G = a.cumsum(dim=-1)
        attn = (c @ b.transpose(-1, -2)) * segment_sums(a).exp()  # decays summed as in gated_delta_rule
        to_end = F.pad(a.flip(-1).cumsum(dim=-1).flip(-1)[..., 1:], (0, 1))
        eye = torch.eye(c.shape[-1], dtype=c.dtype, device=c.device)
        m = G[..., -1].exp()[..., None, None] * eye  # [H, L, S, S]: a scalar decay per chunk
        states = chunk_states(m, (b * to_end.exp()[..., None]).transpose(-1, -2) @ v, layout.starts_L)
        return layout.join((c * G.exp()[..., None]) @ states + attn @ v)


class Mamba2Mixer(nn.Module):
    """The layer (HF names): in_proj, conv1d (with bias), dt_bias, A_log, D, norm (RMSNorm per
    group of y * silu(z)), out_proj. Called like attention; positions are not used."""

    def __init__(self, spec: Mamba2, dim: int, eps: float):
        super().__init__()
        self.spec, self.eps = spec, eps
        self.in_proj = nn.Linear(dim, spec.inner + spec.conv_dim + spec.num_heads, bias=False)
        self.conv1d = nn.Conv1d(spec.conv_dim, spec.conv_dim, spec.conv_kernel, groups=spec.conv_dim,
                                bias=spec.conv_bias)
        self.dt_bias = nn.Parameter(torch.ones(spec.num_heads))
        self.A_log = nn.Parameter(torch.zeros(spec.num_heads))
        self.D = nn.Parameter(torch.ones(spec.num_heads))
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.ones(spec.inner))
        self.out_proj = nn.Linear(spec.inner, dim, bias=False)

    def forward(self, x_BTD, cos_BTR, sin_BTR, seqs: PackedSeqs, backend) -> torch.Tensor:
        s = self.spec
        b, t, _ = x_BTD.shape
        split = HeadSplit(backend)
        z, xbc, dt = self.in_proj(x_BTD).split([s.inner, s.conv_dim, s.num_heads], dim=-1)
        x, b_in, c_in = xbc.split([s.inner, s.n_groups * s.state_size, s.n_groups * s.state_size], dim=-1)
        x, b_in, c_in, dt = (split.heads(y.reshape(b, t, -1, d)) for y, d in
                             ((x, s.head_dim), (b_in, s.state_size), (c_in, s.state_size), (dt, 1)))
        rows, n_tokens = x.shape[0], x.shape[1]
        n, h, groups = rows * n_tokens, x.shape[2], b_in.shape[2]  # this rank's heads and groups
        w_x, w_b, w_c = self.conv1d.weight[:, 0].split([s.inner, s.n_groups * s.state_size, s.n_groups * s.state_size])
        w = torch.cat([split.part(w_x, s.num_heads), split.part(w_b, s.n_groups), split.part(w_c, s.n_groups)])
        bias = None
        if self.conv1d.bias is not None:
            c_x, c_b, c_c = self.conv1d.bias.split([s.inner, s.n_groups * s.state_size, s.n_groups * s.state_size])
            bias = torch.cat([split.part(c_x, s.num_heads), split.part(c_b, s.n_groups),
                              split.part(c_c, s.n_groups)]).float()
        xbc = torch.cat([x.reshape(n, -1), b_in.reshape(n, -1), c_in.reshape(n, -1)], dim=-1)
        xbc = F.silu(causal_conv(xbc.float(), w.float(), doc_positions(seqs), bias))
        x, b_in, c_in = xbc.split([h * s.head_dim, groups * s.state_size, groups * s.state_size], dim=-1)
        dt_bias, a_log, d_skip = (split.part(p, s.num_heads).float() for p in (self.dt_bias, self.A_log, self.D))
        dt_NH = F.softplus(dt.reshape(n, h).float() + dt_bias).clamp(min=s.dt_min)
        x_NHP = x.reshape(n, h, s.head_dim)
        per_group = h // groups  # heads sharing a group's B and C
        b_NHS = b_in.reshape(n, groups, s.state_size).repeat_interleave(per_group, dim=1)
        c_NHS = c_in.reshape(n, groups, s.state_size).repeat_interleave(per_group, dim=1)
        a_NH = -a_log.exp() * dt_NH
        y = ssd_scan(c_NHS, b_NHS, x_NHP * dt_NH[..., None], a_NH, seqs) + d_skip[:, None] * x_NHP
        y = split.tokens(y.reshape(rows, n_tokens, h, s.head_dim)).reshape(b * t, s.inner)
        # gate, then RMS over each group of inner / n_groups channels, in fp32
        y = (y * F.silu(z.reshape(b * t, -1).float())).view(b * t, s.n_groups, -1)
        y = (y * torch.rsqrt(y.pow(2).mean(dim=-1, keepdim=True) + self.eps)).view(b * t, s.inner)
        y = self.norm.weight.float() * y
        return self.out_proj(y.to(x_BTD.dtype).reshape(b, t, -1))
