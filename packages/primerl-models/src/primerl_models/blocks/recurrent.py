"""What the mixers that carry a recurrent state along the sequence share: Gated DeltaNet
(gated_deltanet.py, Qwen3.5's linear attention) and Mamba2 (mamba2.py, Nemotron-H). Packed rows hold several documents, so the state and the short causal convolution
restart at every document boundary (`PackedSeqs`); a state leaking from one document into the
next would change every later token and no loss would show it.

The scan is the chunked form (exact in fp32, any device, differentiable): tokens are laid out
so that every document starts a chunk of C tokens (padding the tail of its last chunk), each
chunk is solved in parallel with a triangular system (the WY form of the delta rule) in
batched torch ops, and the state is carried from chunk to chunk by one recurrence
(kernels/state_scan.py: a Triton kernel on CUDA, a loop elsewhere), zeroed at every chunk that starts
a document.

Legend: N tokens (the rows flattened), L chunks, C tokens per chunk, H value heads,
K key dim, V value dim.
"""

from __future__ import annotations

import torch

from primerl_models.packing import PackedSeqs, doc_positions

CHUNK = 64


def causal_conv(
    x_NC: torch.Tensor, weight_CK: torch.Tensor, pos_N: torch.Tensor, bias_C: torch.Tensor | None = None
) -> torch.Tensor:
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


class Chunks:
    """The layout in which every document starts a chunk (chunk_layout), both ways."""

    def __init__(self, seqs: PackedSeqs, chunk: int):
        self.chunk = chunk
        self.slot_N, self.starts_L = chunk_layout(seqs, chunk)

    def split(self, x: torch.Tensor) -> torch.Tensor:
        """[N, H, ...] -> [H, L, C, ...], zeros in the padding."""
        return to_chunks(x, self.slot_N, len(self.starts_L), self.chunk)

    def join(self, y: torch.Tensor) -> torch.Tensor:
        """[H, L, C, ...] -> [N, H, ...], the padding dropped."""
        return from_chunks(y, self.slot_N)


def segment_sums(g: torch.Tensor) -> torch.Tensor:
    """[..., C, C]: out[t, s] = sum of g over s < r <= t (0 on the diagonal), -inf above it."""
    c = g.shape[-1]
    terms = g[..., :, None].expand(*g.shape, c)  # terms[r, s] = g_r
    lower = torch.ones(c, c, dtype=torch.bool, device=g.device).tril(-1)
    sums = terms.masked_fill(~lower, 0.0).cumsum(dim=-2)  # over r <= t, keeping r > s
    return sums.masked_fill(~torch.ones(c, c, dtype=torch.bool, device=g.device).tril(), float("-inf"))


def to_chunks(x: torch.Tensor, slot_N: torch.Tensor, n_chunks: int, chunk: int) -> torch.Tensor:
    """[N, H, ...] -> [H, L, C, ...] in the chunk layout, zeros in the padding."""
    padded = x.new_zeros((n_chunks * chunk, *x.shape[1:])).index_copy(0, slot_N, x)
    return padded.view(n_chunks, chunk, *x.shape[1:]).movedim(2, 0)


def from_chunks(y: torch.Tensor, slot_N: torch.Tensor) -> torch.Tensor:
    """[H, L, C, ...] -> [N, H, ...], the padding dropped."""
    h, n_chunks, chunk = y.shape[:3]
    return y.movedim(0, 2).reshape(n_chunks * chunk, h, *y.shape[3:]).index_select(0, slot_N)


def plain(fn):
    return fn


_COMPILED: dict = {}


def fused(fn):
    """`fn` compiled (on CUDA): the chunks' elementwise work fused around the matmuls, which
    as separate kernels took half a layer's time (bench/scan_kernel.py's profile). Shapes
    marked dynamic: the number of chunks changes with every batch's documents."""
    if fn not in _COMPILED:
        _COMPILED[fn] = torch.compile(fn, dynamic=True)
    return _COMPILED[fn]


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
