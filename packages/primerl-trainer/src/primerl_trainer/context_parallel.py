"""Context parallelism for attention, Ulysses style: a packed row is split into P contiguous
chunks, one per rank of a CP group; around attention, an all-to-all trades the token split for
a head split (each rank then holds every token of H / P query heads and G / P kv heads), the
attention of `primerl_models.attention` runs on whole documents with the document boundaries of
the whole row, and a second all-to-all trades back. Everything else in a layer (projections,
norms, RoPE at the row's own positions, MLP) is per token and runs on the local chunk.

    out_local = ulysses_attention(q_local, k_local, v_local, seqs_whole_row, backend, group)

Any attention back-end works unchanged (it sees whole rows). Needs H and G divisible by P.

Status (issue 21): the attention exchange, proved against the whole row on gloo. Not yet: the
model wiring (the forward's PackedSeqs from the whole row, positions per chunk), the loss and
its normalisation over the row, the mesh from `trainer.parallel`.

Legend: B batch, T tokens per row, C = T / P tokens per rank, H query heads, G kv heads,
K head_dim, P ranks in the CP group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from primerl_models.common.attention import Backend, PackedSeqs, attention

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
) -> torch.Tensor:
    """Causal attention within documents over a row split across `group` (rank r holds tokens
    [r C, (r + 1) C)); `seqs` are the boundaries of the whole row. Returns this rank's [B, C, H, K]."""
    p = dist.get_world_size(group)
    h, g = q_BCHK.shape[2], k_BCGK.shape[2]
    if h % p or g % p:
        raise ValueError(f"context parallelism over {p} ranks needs query heads ({h}) and kv heads ({g}) divisible by {p}")
    q, k, v = (_tokens_to_heads(x, p, group) for x in (q_BCHK, k_BCGK, v_BCGK))
    if q.shape[1] != seqs.doc_ids_BT.shape[1]:
        raise ValueError(f"the chunks make rows of {q.shape[1]} tokens; the row's boundaries are for {seqs.doc_ids_BT.shape[1]}")
    return _heads_to_tokens(attention(q, k, v, seqs, backend), p, group)


class UlyssesAttention:
    """An attention back-end for `Transformer.attn_backend` (a callable the model's attention
    calls): Ulysses over `group` around the `backend` named. Set it, then feed the model each
    rank's chunk with `seqs=` the whole rows' boundaries (`chunk_of`)."""

    def __init__(self, group=None, backend: Backend = "auto"):
        self.group, self.backend = group, backend

    def __call__(self, q, k, v, seqs: PackedSeqs):
        return ulysses_attention(q, k, v, seqs, self.backend, self.group)


def chunk_of(x_BT: torch.Tensor, group=None) -> torch.Tensor:
    """This rank's contiguous chunk of packed rows [B, T] (T divisible by the group's size)."""
    p, r = dist.get_world_size(group), dist.get_rank(group)
    t = x_BT.shape[1]
    if t % p:
        raise ValueError(f"rows of {t} tokens cannot be split over a context-parallel group of {p}")
    return x_BT[:, r * (t // p):(r + 1) * (t // p)]
