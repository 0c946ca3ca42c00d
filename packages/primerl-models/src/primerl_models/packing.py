"""Packed rows: several documents end to end in one row, position ids restarting at 0 at each
document. Every block that mixes tokens (attention, the recurrent mixers, the vision tower's
positions) must keep to its document; `PackedSeqs.from_position_ids` finds the boundaries once
per forward and the blocks share what they derive from them (masks, layouts).

Shared prompts (`PackedSeqs.from_segments`): a document may continue the first P tokens of an
earlier document of its row (its parent) instead of holding them itself: the completions of
one prompt, laid once. Its tokens sit at positions P, P + 1, ... and see the parent's first P
tokens and their own (causal); the parent sees nothing of them. Only softmax attention can
branch so (a recurrent state or a convolution would have to be forked at the prompt's end):
`branched` seqs are for models whose every mixer is attention (ModelArgs.prompt_sharing_problem).

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
    shared: SharedPrompts | None = None
    """Which documents continue another's prompt (from_segments); None: none do."""

    @property
    def branched(self) -> bool:
        """Some document continues another's prompt (see the module docstring)."""
        return self.shared is not None

    @property
    def num_docs(self) -> int:
        return len(self.cu_seqlens) - 1

    def padded_cheaper(self) -> bool:
        """One row per document (right-padded; with shared prompts, `shared.groups`) multiplies
        fewer attention scores than the packed rows."""
        b, t = self.doc_ids_BT.shape
        if self.shared is not None:
            return sum(g.num_docs * g.mq * g.mk for g in self.shared.groups) < b * t * t
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

    @classmethod
    def from_segments(cls, seq_lens, prefix_lens, parents, device: torch.device | str = "cpu") -> PackedSeqs:
        """One row (B = 1) of documents of `seq_lens` tokens; document s continues the first
        prefix_lens[s] tokens of document parents[s] (an earlier one without a prefix of its
        own; -1 and 0: none), as primerl_protocol's MicroBatch describes its samples. Host
        arrays (lists or numpy) in: the layouts are built on the host, no sync."""
        seq_S, prefix_S, parents_S = (torch.as_tensor(x, dtype=torch.int64) for x in (seq_lens, prefix_lens, parents))
        num_docs = len(seq_S)
        cu = torch.cat([seq_S.new_zeros(1), torch.cumsum(seq_S, 0)])
        doc_T = torch.repeat_interleave(torch.arange(num_docs), seq_S)
        seqs = cls(
            doc_T.to(torch.int32)[None].to(device),
            cu.to(torch.int32).to(device),
            int(seq_S.max()) if num_docs else 0,
            single_doc=num_docs == 1,
        )
        shared_S = prefix_S > 0
        if bool(shared_S.any()):
            bad = shared_S & ((parents_S < 0) | (parents_S >= torch.arange(num_docs)))
            if bool(bad.any()) or bool((prefix_S[parents_S[shared_S]] > 0).any()):
                raise ValueError("a document that shares a prompt needs an earlier document without one as its parent")
            longer = shared_S.nonzero().flatten()[prefix_S[shared_S] > seq_S[parents_S[shared_S]]].tolist()
            if longer:  # its prompt's copies would be read from the documents after the parent
                s = longer[0]
                raise ValueError(
                    f"document {s} shares the first {int(prefix_S[s])} tokens of document {int(parents_S[s])}, "
                    f"which has {int(seq_S[parents_S[s]])}"
                )
            seqs.shared = SharedPrompts.build(seq_S, prefix_S, torch.where(shared_S, parents_S, -1), cu, doc_T, device)
        return seqs


@dataclass
class PaddedDocs:
    """Documents attended in rows of their own (sdpa's padded layout, with shared prompts): each
    one's queries (its own tokens) in a row of `mq` slots, its keys and values (its shared
    prompt's tokens, then its own) in a row of `mk`; query i of document r sees keys j <= prefix[r] + i."""

    tokens: torch.Tensor
    """int64 [n]: the documents' tokens (flattened row index)."""
    q_slots: torch.Tensor
    """int64 [n]: their query slots in [num_docs * mq]."""
    kv_tokens: torch.Tensor
    """int64 [c]: the tokens whose keys and values fill the rows (prompt copies and own tokens)."""
    kv_slots: torch.Tensor
    """int64 [c]: their slots in [num_docs * mk]."""
    prefix: torch.Tensor
    """int64 [num_docs]: each document's shared prompt length (its first token's position)."""
    num_docs: int
    mq: int
    mk: int

    @classmethod
    def build(cls, docs, seq_S, prefix_S, parent_S, cu, device) -> PaddedDocs:
        lens, pre = seq_S[docs], prefix_S[docs]
        mq, mk = int(lens.max()), int((lens + pre).max())
        rank_T = torch.repeat_interleave(torch.arange(len(docs)), lens)
        offset_T = torch.arange(len(rank_T)) - torch.repeat_interleave(torch.cumsum(lens, 0) - lens, lens)
        tokens = cu[docs][rank_T] + offset_T
        rank_C = torch.repeat_interleave(torch.arange(len(docs)), pre)
        offset_C = torch.arange(len(rank_C)) - torch.repeat_interleave(torch.cumsum(pre, 0) - pre, pre)
        copies = cu[parent_S[docs].clamp(min=0)][rank_C] + offset_C
        kv_tokens = torch.cat([tokens, copies])
        kv_slots = torch.cat([rank_T * mk + pre[rank_T] + offset_T, rank_C * mk + offset_C])
        on = lambda x: x.to(device)  # noqa: E731
        return cls(on(tokens), on(rank_T * mq + offset_T), on(kv_tokens), on(kv_slots), on(pre), len(docs), mq, mk)


@dataclass
class SharedPrompts:
    """The documents of a row that continue another's prompt (PackedSeqs.from_segments): per
    token, what flex attention's mask_mod reads (and sdpa's dense mask); per group of documents,
    sdpa's padded layouts: those without a prompt (square rows, plain causal attention), and
    those with one (their own queries over their prompt's keys and their own: no query is spent
    on a prompt's copy)."""

    parent_BT: torch.Tensor
    """int32 [B, T]: the document whose prompt each token's document continues (-1: none)."""
    prefix_end_BT: torch.Tensor
    """int32 [B, T]: where in the row that prompt ends: the token sees its parent's tokens before it."""
    positions_BT: torch.Tensor
    """int32 [B, T]: each token's position in its sample (a sliding window counts positions;
    the prompt is not next to the document in the row)."""
    groups: list[PaddedDocs]

    @classmethod
    def build(cls, seq_S, prefix_S, parent_S, cu, doc_T, device) -> SharedPrompts:
        shared_S = prefix_S > 0
        prefix_end_S = torch.where(shared_S, cu[parent_S.clamp(min=0)] + prefix_S, 0)
        positions_T = torch.arange(len(doc_T)) - cu[doc_T] + prefix_S[doc_T]
        groups = [
            PaddedDocs.build(docs, seq_S, prefix_S, parent_S, cu, device)
            for docs in ((~shared_S).nonzero().flatten(), shared_S.nonzero().flatten())
        ]
        parent_BT, prefix_end_BT, positions_BT = (
            x.to(torch.int32)[None].to(device) for x in (parent_S[doc_T], prefix_end_S[doc_T], positions_T)
        )
        return cls(parent_BT, prefix_end_BT, positions_BT, groups)


def doc_positions(seqs: PackedSeqs) -> torch.Tensor:
    """int64 [N]: each token's position inside its document."""
    cu, doc_N = seqs.cu_seqlens.long(), seqs.doc_ids_BT.flatten().long()
    return torch.arange(len(doc_N), device=doc_N.device) - cu[doc_N]
