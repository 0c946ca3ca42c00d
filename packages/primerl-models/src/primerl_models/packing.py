"""Packed rows: several documents end to end in one row, position ids restarting at 0 at each
document. Every block that mixes tokens (attention, the recurrent mixers, the vision tower's
positions) must keep to its document; `PackedSeqs.from_position_ids` finds the boundaries once
per forward and the blocks share what they derive from them (masks, layouts).

Legend: B batch, T tokens per row, S documents, M tokens of the longest, N = B*T.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class PackedSeqs:
    """Document boundaries of packed rows, shared by every layer of one forward."""

    doc_ids_BT: torch.Tensor
    """int32 [B, T]: document index of each token, unique across the batch."""
    cu_seqlens: torch.Tensor
    """int32 [S + 1]: document boundaries over the flattened N = B*T tokens."""
    max_seqlen: int
    single_doc: bool
    """Every row is one document (so plain causal attention is exact)."""
    block_masks: dict = field(default_factory=dict)
    """flex attention's block masks by window (None: whole documents), each built by the first
    layer that needs it."""
    padded: torch.Tensor | None = None
    """The padded layout's indices (see `padded_layout`), built by the first layer that needs it."""
    chunk_layouts: dict = field(default_factory=dict)
    """The recurrent mixers' chunk layouts by chunk size (linear_attention.chunk_layout), built
    once per forward: each costs a host sync."""
    selections: dict = field(default_factory=dict)
    """DSA's top-k selections (blocks/mla.Selection) by the layer that chose them, for
    the layers that reuse them (GLM-5's "shared" indexer layers)."""

    @property
    def num_docs(self) -> int:
        return len(self.cu_seqlens) - 1

    def padded_cheaper(self) -> bool:
        """One row per document (right-padded) multiplies fewer attention scores than the packed rows."""
        b, t = self.doc_ids_BT.shape
        return self.num_docs * self.max_seqlen**2 < b * t * t

    def padded_layout(self) -> torch.Tensor:
        """int64 [N]: where token n of the flattened rows sits in the [S * M] padded layout
        (document s's row is positions s*M .. s*M + M - 1, its tokens first)."""
        if self.padded is None:
            cu = self.cu_seqlens.long()
            doc_N = self.doc_ids_BT.flatten().long()
            self.padded = doc_N * self.max_seqlen + (torch.arange(len(doc_N), device=cu.device) - cu[doc_N])
        return self.padded

    @classmethod
    def from_position_ids(cls, position_ids_BT: torch.Tensor) -> PackedSeqs:
        b, t = position_ids_BT.shape
        starts_BT = position_ids_BT == 0
        starts_BT[:, 0] = True  # a row always starts a document
        doc_ids_BT = (starts_BT.flatten().cumsum(0) - 1).view(b, t).to(torch.int32)
        start_idx = starts_BT.flatten().nonzero().flatten()
        n = torch.tensor([b * t], device=start_idx.device)
        cu_seqlens = torch.cat([start_idx, n]).to(torch.int32)
        lengths = cu_seqlens[1:] - cu_seqlens[:-1]
        max_seqlen, num_docs = int(lengths.max()), len(lengths)  # one host sync per forward
        return cls(doc_ids_BT, cu_seqlens, max_seqlen, single_doc=num_docs == b)


def doc_positions(seqs: PackedSeqs) -> torch.Tensor:
    """int64 [N]: each token's position inside its document."""
    cu, doc_N = seqs.cu_seqlens.long(), seqs.doc_ids_BT.flatten().long()
    return torch.arange(len(doc_N), device=doc_N.device) - cu[doc_N]
