"""Context parallelism for attention, Ulysses style: a packed row is split into P contiguous
chunks, one per rank of a CP group; around attention, an all-to-all trades the token split for
a head split (each rank then holds every token of H / P query heads and G / P kv heads), the
attention of `primerl_models.attention` runs on whole documents with the document boundaries of
the whole row, and a second all-to-all trades back. Everything else in a layer (projections,
norms, RoPE at the row's own positions, MLP) is per token and runs on the local chunk.

    out_local = ulysses_attention(q_local, k_local, v_local, seqs_whole_row, backend, group)

Any attention back-end works unchanged (it sees whole rows). Needs H divisible by P; with fewer
kv heads than that allows (G not divisible by P), each kv head is repeated until it is. The
recurrent mixers (Gated DeltaNet, Mamba2) take the same all-to-alls around their conv and scan,
each rank carrying the state of its heads over whole rows (their key / value heads, or heads
and groups, divisible by P).

In the trainer (`row_logprobs`, used by engine.token_logprobs): each rank of the group runs
its chunk of the row (padded to a multiple of P with a separate document that trains nothing)
with the whole row's boundaries, then every rank gathers the whole row's logprobs, so the loss
and its normalisation (per token, per sequence) are computed on whole rows, the same on every
rank of the group. The gather's backward keeps this rank's chunk of the gradient (every rank
holds the same gradient of the same loss), and the attention all-to-alls carry it to the other
ranks' chunks: the group's parameter gradients sum to the whole row's.

Legend: B batch, T tokens per row, C = T / P tokens per rank, H query heads, G kv heads,
K head_dim, P ranks in the CP group.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from primerl_models.blocks.attention import Backend, attention
from primerl_models.packing import PackedSeqs

from primerl_trainer.distributed import all_to_all


def _tokens_to_heads(x_BCHK: torch.Tensor, p: int, group) -> torch.Tensor:
    """[B, C, H, K] (this rank's tokens, all heads) -> [B, P C, H / P, K] (all tokens, this rank's heads)."""
    b, c, h, k = x_BCHK.shape
    send = x_BCHK.view(b, c, p, h // p, k).permute(2, 0, 1, 3, 4).reshape(p, b * c * (h // p) * k)
    recv = all_to_all(send, [1] * p, [1] * p, group)  # row j: rank j's tokens of my heads
    return recv.view(p, b, c, h // p, k).permute(1, 0, 2, 3, 4).reshape(b, p * c, h // p, k)


def _heads_to_tokens(x_BTHK: torch.Tensor, p: int, group) -> torch.Tensor:
    """[B, T, H / P, K] (all tokens, this rank's heads) -> [B, T / P, H, K] (this rank's tokens, all heads)."""
    b, t, hp, k = x_BTHK.shape
    c = t // p
    send = x_BTHK.view(b, p, c, hp, k).permute(1, 0, 2, 3, 4).reshape(p, b * c * hp * k)
    recv = all_to_all(send, [1] * p, [1] * p, group)  # row j: my tokens of rank j's heads
    return recv.view(p, b, c, hp, k).permute(1, 2, 0, 3, 4).reshape(b, c, p * hp, k)


def ulysses_attention(
    q_BCHK: torch.Tensor,
    k_BCGK: torch.Tensor,
    v_BCGK: torch.Tensor,
    seqs: PackedSeqs,
    backend: Backend = "auto",
    group=None,
    window: int | None = None,
    sinks_H: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention within documents over a row split across `group` (rank r holds tokens
    [r C, (r + 1) C)); `seqs` are the boundaries of the whole row. Returns this rank's [B, C, H, K].
    A sliding window applies to the whole row; each rank takes the sinks of its heads."""
    p = dist.get_world_size(group)
    h, g = q_BCHK.shape[2], k_BCGK.shape[2]
    if h % p:
        raise ValueError(f"context parallelism over {p} ranks needs the query heads ({h}) divisible by {p}")
    if g % p:  # fewer kv heads than ranks: repeat each (query head i still reads kv head i // (h / g))
        r = p // math.gcd(g, p)
        k_BCGK, v_BCGK = k_BCGK.repeat_interleave(r, dim=2), v_BCGK.repeat_interleave(r, dim=2)
    q, k, v = (_tokens_to_heads(x, p, group) for x in (q_BCHK, k_BCGK, v_BCGK))
    if q.shape[1] != seqs.doc_ids_BT.shape[1]:
        raise ValueError(
            f"the chunks make rows of {q.shape[1]} tokens; the row's boundaries are for {seqs.doc_ids_BT.shape[1]}"
        )
    if sinks_H is not None:
        hp, r = h // p, dist.get_rank(group)
        sinks_H = sinks_H[r * hp : (r + 1) * hp]
    return _heads_to_tokens(attention(q, k, v, seqs, backend, window=window, sinks_H=sinks_H), p, group)


class UlyssesAttention:
    """An attention back-end for `Transformer.attn_backend` (a callable the model's attention
    calls): Ulysses over `group` around the `backend` named. Set it, then feed the model each
    rank's chunk with `seqs=` the whole rows' boundaries (`chunk_of`)."""

    def __init__(self, group=None, backend: Backend = "auto"):
        self.group = group
        self.backend: Backend = backend

    def __call__(self, q, k, v, seqs: PackedSeqs, window: int | None = None, sinks_H=None):
        return ulysses_attention(q, k, v, seqs, self.backend, self.group, window, sinks_H)

    # The same all-to-alls for the recurrent mixers (Gated DeltaNet, Mamba2: their `HeadSplit`),
    # which run their conv and scan over whole rows for this rank's heads.
    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    @property
    def size(self) -> int:
        return dist.get_world_size(self.group)

    def to_heads(self, x_BCHK: torch.Tensor) -> torch.Tensor:
        return _tokens_to_heads(x_BCHK, self.size, self.group)

    def to_tokens(self, x_BTHK: torch.Tensor) -> torch.Tensor:
        return _heads_to_tokens(x_BTHK, self.size, self.group)

    # MLA (blocks/mla.py) keeps its queries local and gathers the whole row's shared rows.
    def gather(self, x_BC: torch.Tensor) -> torch.Tensor:
        """Every rank's chunk [B, C, ...] -> the whole rows [B, P C, ...], differentiable: the
        backward sums the ranks' gradients of the rows and keeps this rank's chunk."""
        out = _GatherTokens.apply(x_BC, self.group)
        assert isinstance(out, torch.Tensor)
        return out


def chunk_of(x_BT: torch.Tensor, group=None) -> torch.Tensor:
    """This rank's contiguous chunk of packed rows [B, T] (T divisible by the group's size)."""
    p, r = dist.get_world_size(group), dist.get_rank(group)
    t = x_BT.shape[1]
    if t % p:
        raise ValueError(f"rows of {t} tokens cannot be split over a context-parallel group of {p}")
    return x_BT[:, r * (t // p) : (r + 1) * (t // p)]


class _GatherTokens(torch.autograd.Function):
    """Chunks [B, C, ...] -> rows [B, P C, ...]; each rank's rows feed its own queries, so a
    chunk's gradient is the sum over the ranks of their gradients for it (all-reduce, then slice)."""

    @staticmethod
    def forward(ctx, x_BC: torch.Tensor, group) -> torch.Tensor:
        p, ctx.rank, ctx.c, ctx.group = dist.get_world_size(group), dist.get_rank(group), x_BC.shape[1], group
        parts = [torch.empty_like(x_BC) for _ in range(p)]
        dist.all_gather(parts, x_BC.contiguous(), group=group)
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx, grad_BT: torch.Tensor):
        grad_BT = grad_BT.contiguous()
        dist.all_reduce(grad_BT, group=ctx.group)
        return grad_BT[:, ctx.rank * ctx.c : (ctx.rank + 1) * ctx.c], None


class _GatherRow(torch.autograd.Function):
    """Every rank's chunk [B, C] -> the whole rows [B, P C]; the backward keeps this rank's chunk
    of the gradient (the loss computed from the gathered rows is the same on every rank)."""

    @staticmethod
    def forward(ctx, x_BC: torch.Tensor, group) -> torch.Tensor:
        p, ctx.rank, ctx.c = dist.get_world_size(group), dist.get_rank(group), x_BC.shape[1]
        parts = [torch.empty_like(x_BC) for _ in range(p)]
        dist.all_gather(parts, x_BC.contiguous(), group=group)
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx, grad_BT: torch.Tensor):
        return grad_BT[:, ctx.rank * ctx.c : (ctx.rank + 1) * ctx.c], None


def row_logprobs(model, ids_BT, pos_BT, targets_BT, temps_BT, group) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprobs, entropy) [B, T] of whole rows, the model (Ulysses as its attention back-end)
    run over the ranks of `group`, each on its chunk; the same on every rank of the group."""
    p = dist.get_world_size(group)
    t = ids_BT.shape[1]
    if pad := -t % p:  # a document of its own at the end, cut off again below
        b = ids_BT.shape[0]
        ids_BT, targets_BT = (torch.cat([x, x.new_zeros(b, pad)], dim=1) for x in (ids_BT, targets_BT))
        pos_BT = torch.cat([pos_BT, torch.arange(pad, device=pos_BT.device).expand(b, pad)], dim=1)
        temps_BT = torch.cat([temps_BT, temps_BT.new_ones(b, pad)], dim=1)
    seqs = PackedSeqs.from_position_ids(pos_BT)
    logprobs, entropy = model(*(chunk_of(x, group) for x in (ids_BT, pos_BT, targets_BT, temps_BT)), seqs=seqs)
    return _GatherRow.apply(logprobs, group)[:, :t], _GatherRow.apply(entropy, group)[:, :t]
