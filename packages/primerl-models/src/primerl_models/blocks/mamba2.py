"""Mamba2 (Nemotron-H's "M" layers): the mixer and its state space scan in the chunked form
shared with Gated DeltaNet (recurrent.py), without the delta correction. No kernel of its own:
the scan's chunk-to-chunk recurrence is kernels/state_scan.py's.

Legend: N tokens (the rows flattened), H heads, P head dim, S state size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from primerl_models.args import Mamba2
from primerl_models.blocks.mixer import Mixer
from primerl_models.blocks.recurrent import CHUNK, Chunks, HeadSplit, causal_conv, segment_sums
from primerl_models.kernels.state_scan import chunk_states
from primerl_models.packing import PackedSeqs, doc_positions


def ssd_scan(c_NHS, b_NHS, v_NHP, a_NH, seqs: PackedSeqs, chunk: int = CHUNK) -> torch.Tensor:
    """y [N, H, P] of Mamba2's state space S_t = exp(a_t) S_{t-1} + b_t v_t^T, y_t = S_t^T c_t
    (S [state, P] per head), S = 0 at each document's first token: the gated delta rule's
    chunk form without the delta correction (inputs fp32; v = dt x, a = dt A)."""
    with torch.autocast(c_NHS.device.type, enabled=False):
        layout = Chunks(seqs, chunk)
        c, b, v, a = (layout.split(x) for x in (c_NHS, b_NHS, v_NHP, a_NH))
        G = a.cumsum(dim=-1)
        attn = (c @ b.transpose(-1, -2)) * segment_sums(a).exp()  # decays summed as in gated_delta_rule
        to_end = F.pad(a.flip(-1).cumsum(dim=-1).flip(-1)[..., 1:], (0, 1))
        eye = torch.eye(c.shape[-1], dtype=c.dtype, device=c.device)
        m = G[..., -1].exp()[..., None, None] * eye  # [H, L, S, S]: a scalar decay per chunk
        states = chunk_states(m, (b * to_end.exp()[..., None]).transpose(-1, -2) @ v, layout.starts_L)
        return layout.join((c * G.exp()[..., None]) @ states + attn @ v)


class _NormWeight(nn.Module):
    """The gated RMSNorm's weight alone (HF's `norm.weight`; the norm itself is in the forward)."""

    def __init__(self, size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))


class Mamba2Mixer(Mixer):
    """The layer (HF names): in_proj, conv1d (with bias), dt_bias, A_log, D, norm (RMSNorm per
    group of y * silu(z)), out_proj. A Mixer (mixer.py) that takes no positions."""

    def __init__(self, spec: Mamba2, dim: int, eps: float):
        super().__init__()
        self.spec, self.eps = spec, eps
        self.in_proj = nn.Linear(dim, spec.inner + spec.conv_dim + spec.num_heads, bias=False)
        self.conv1d = nn.Conv1d(
            spec.conv_dim, spec.conv_dim, spec.conv_kernel, groups=spec.conv_dim, bias=spec.conv_bias
        )
        self.dt_bias = nn.Parameter(torch.ones(spec.num_heads))
        self.A_log = nn.Parameter(torch.zeros(spec.num_heads))
        self.D = nn.Parameter(torch.ones(spec.num_heads))
        self.norm = _NormWeight(spec.inner)
        self.out_proj = nn.Linear(spec.inner, dim, bias=False)

    def forward(self, x_BTD, cos_BTR, sin_BTR, seqs: PackedSeqs, backend) -> torch.Tensor:
        s = self.spec
        b, t, _ = x_BTD.shape
        split = HeadSplit(backend)
        z, xbc, dt = self.in_proj(x_BTD).split([s.inner, s.conv_dim, s.num_heads], dim=-1)
        x, b_in, c_in = xbc.split([s.inner, s.n_groups * s.state_size, s.n_groups * s.state_size], dim=-1)
        x, b_in, c_in, dt = (
            split.heads(y.reshape(b, t, -1, d))
            for y, d in ((x, s.head_dim), (b_in, s.state_size), (c_in, s.state_size), (dt, 1))
        )
        rows, n_tokens = x.shape[0], x.shape[1]
        n, h, groups = rows * n_tokens, x.shape[2], b_in.shape[2]  # this rank's heads and groups
        w_x, w_b, w_c = self.conv1d.weight[:, 0].split([s.inner, s.n_groups * s.state_size, s.n_groups * s.state_size])
        w = torch.cat([split.part(w_x, s.num_heads), split.part(w_b, s.n_groups), split.part(w_c, s.n_groups)])
        bias = None
        if self.conv1d.bias is not None:
            c_x, c_b, c_c = self.conv1d.bias.split([s.inner, s.n_groups * s.state_size, s.n_groups * s.state_size])
            bias = torch.cat(
                [split.part(c_x, s.num_heads), split.part(c_b, s.n_groups), split.part(c_c, s.n_groups)]
            ).float()
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
