"""Multi-head Latent Attention (MLA: DeepSeek-V3, GLM-5) and DeepSeek Sparse Attention's
indexer (DSA: GLM-5, DeepSeek-V3.2). The spec is args.MLA (and args.DSAIndexer).

    q      = q_b_proj(RMSNorm(q_a_proj(x)))          (or q_proj(x) without q_lora_rank)
    latent, k_rope = kv_a_proj_with_mqa(x)           [kv_lora_rank], [qk_rope_head_dim]
    k_nope, v = kv_b_proj(RMSNorm(latent))           per head
    q = [q_nope, rope(q_rope)], k = [k_nope, rope(k_rope)] (k_rope shared by the heads)
    out = o_proj(softmax(q k^T * scale + mask) v)

RoPE turns interleaved pairs (x0, x1), (x2, x3), ... of the rope part (the model's cos and sin
of an interleaved `Rope`). transformers writes each rotated pair back de-interleaved (the pairs'
first members, then their second members); q and k are permuted alike, so every q.k, and the
attention, is the same.

With DSA, each query attends only to the `topk` keys of its document that its indexer scores
highest (fewer when the document has fewer before it):

    score(t, s) = sum_j w_tj * relu(q_tj . k_s / sqrt(index_head_dim)),  w_t = weights_proj(x_t) / sqrt(H_i)

q_t from the query latent (wq_b), k_s = LayerNorm(wk(x_s)), RoPE on the first qk_rope_head_dim of
both. The indexer chooses and is not differentiated (as in transformers; DSA trains it with its own
loss, which post-training does not have): its weights are frozen (requires_grad False), so that
optimizers and gradient norms leave them out, as the anchor (prime-rl) does. A "shared" layer (`reuse_topk`) attends to the keys the
layer that wrote its `topk_slot` chose, kept for the forward in `PackedSeqs.selections`.

Two paths compute the same thing:
- the oracle (`FAST_PATH = False`): the scores and the attention computed densely under a
  [B, C, T] mask of the selected keys, with every head's own keys and values (as transformers);
- the sparse path (default): MLA in its absorbed form. Every head's key is kv_b's key part applied
  to the one shared latent, so q_nope . k_nope = (q_nope W_uk) . latent: each head's query moves to
  the latent space and all heads read the same [latent | k_rope] row (X = L + R wide) of each
  selected key, gathered once per query (`topk` rows, not T); the values likewise are the latent
  (L wide), taken back to v_head_dim by kv_b's value part after the softmax. The indexer's scores
  and top-k are computed a chunk of queries at a time against the keys up to the chunk's end.
  Forward and backward (`_SparseMLA`) go a chunk of queries at a time, recomputing the gathered
  rows in the backward (as flash attention does its tiles): memory is O(C topk) per chunk, not
  O(T^2). It attends to topk keys per query where the oracle pays for T.

Context parallelism: with a CP back-end (the trainer's Ulysses), each rank keeps its chunk's
queries and gathers the whole row's shared rows (the [latent | k_rope] row and the indexer key,
X + K_i numbers a token, not H heads of them): `backend.gather(x)`, whose backward sums the
ranks' gradients of the gathered rows and keeps this rank's chunk.

Legend: B batch, T tokens of the whole row, C tokens of this rank's chunk (T without CP), D hidden,
H heads, Q q latent, L kv latent, R rope dims, X = L + R, I indexer heads, K indexer head_dim,
Vd value head_dim, S selected keys per query (topk, or fewer).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from primerl_models.args import MLA, DSAIndexer
from primerl_models.blocks.mixer import Mixer
from primerl_models.blocks.norms import RMSNorm
from primerl_models.blocks.rope import apply_rope
from primerl_models.kernels.dsa_index import index_keys_triton
from primerl_models.kernels.sparse_mla import sparse_mla_triton
from primerl_models.packing import PackedSeqs

FAST_PATH = True
"""The sparse absorbed path; False: the dense oracle (tests compare the two)."""
KERNEL = True
"""The Triton kernel on CUDA (kernels/sparse_mla.py); False: the chunked torch _SparseMLA."""
INDEX_KERNEL = True
"""The sparse path's indexer scores and keys by the Triton kernel on CUDA (kernels/dsa_index.py),
its dots in the compute dtype (bf16 under autocast or bf16 weights; fp32 otherwise); False: the
torch `index_scores` in fp32."""
CHUNK_BYTES = 1 << 30
"""Bytes of the largest temporary a chunk of queries may make (gathered rows, index scores)."""


@dataclass
class Selection:
    """The keys each query of this rank's chunk attends to: the oracle's bool [B, C, T] mask, or
    the sparse path's indices [B, C, S] into the row with `valid` [B, C, S] (a query with fewer
    than S keys in its document has invalid ones)."""

    mask_BCT: torch.Tensor | None = None
    index_BCS: torch.Tensor | None = None
    valid_BCS: torch.Tensor | None = None


def document_causal(seqs: PackedSeqs, start: int = 0, length: int | None = None) -> torch.Tensor:
    """bool [B, C, T]: key s is in query t's document and not after it, for the queries
    start .. start + length of the row (all of them by default)."""
    doc_BT = seqs.doc_ids_BT
    t = doc_BT.shape[1]
    c = t - start if length is None else length
    q_C = torch.arange(start, start + c, device=doc_BT.device)
    causal_CT = q_C[:, None] >= torch.arange(t, device=doc_BT.device)[None, :]
    return (doc_BT[:, start : start + c, None] == doc_BT[:, None, :]) & causal_CT


def topk_keys(scores_BCT: torch.Tensor, allowed_BCT: torch.Tensor, topk: int) -> torch.Tensor:
    """The oracle's choice, bool [B, C, T]: each query's `topk` best-scored allowed keys (all of
    them when it has fewer). Equal scores are common (the ReLU's zeros: a key no head scores above
    0) and go to the later key, so that a document's choice does not depend on where it sits in a
    packed row (torch.topk leaves ties unspecified; on CPU it too took the later keys in our tests)."""
    t = scores_BCT.shape[-1]
    latest_first_BCT = scores_BCT.masked_fill(~allowed_BCT, float("-inf")).flip(-1)
    order_BCk = latest_first_BCT.sort(dim=-1, descending=True, stable=True).indices[..., : min(topk, t)]
    chosen_BCT = torch.zeros_like(allowed_BCT).scatter(-1, t - 1 - order_BCk, True)
    return chosen_BCT & allowed_BCT  # a query with fewer than topk keys also "chose" masked ones


def order_keys(scores_BCT: torch.Tensor, allowed_BCT: torch.Tensor) -> torch.Tensor:
    """int64 [B, C, T]: each allowed pair's score as an order-preserving int above its key's
    position (the score's bits, -0.0 as 0.0, then the key), all distinct so that the later of
    equal scores ranks first; int64's minimum where not allowed."""
    bits = (scores_BCT.float() + 0.0).view(torch.int32).long()
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # a float's order as a signed int
    t = scores_BCT.shape[-1]
    keys = (ordered << 32) | torch.arange(t, device=scores_BCT.device)
    return keys.masked_fill(~allowed_BCT, torch.iinfo(torch.int64).min)


def top_keys(keys_BCT: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(indices, valid) [B, C, min(topk, T)] of the `topk` largest `order_keys` keys: one
    torch.topk, no sort."""
    top = keys_BCT.topk(min(topk, keys_BCT.shape[-1]), dim=-1, sorted=False).values
    return top & 0xFFFFFFFF, top != torch.iinfo(torch.int64).min


def topk_indices(scores_BCT: torch.Tensor, allowed_BCT: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The sparse path's choice, the same keys as `topk_keys` as (indices, valid) [B, C, S]:
    one torch.topk over `order_keys`' int64 keys, so that the later of equal scores wins without
    a sort. -0.0 counts as 0.0."""
    return top_keys(order_keys(scores_BCT, allowed_BCT), topk)


class Indexer(nn.Module):
    """DSA's indexer (HF's `self_attn.indexer`): scores every (query, key) pair."""

    def __init__(self, spec: DSAIndexer, dim: int, q_lora_rank: int):
        super().__init__()
        self.spec = spec
        self.wq_b = nn.Linear(q_lora_rank, spec.num_heads * spec.head_dim, bias=False)
        self.wk = nn.Linear(dim, spec.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(spec.head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(dim, spec.num_heads, bias=False)

    def queries(self, x_BCD, q_latent_BCQ, cos_BCR, sin_BCR) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 (q [B, C, I, K] scaled by 1 / sqrt(K), w [B, C, I] scaled by 1 / sqrt(I))."""
        b, c, _ = x_BCD.shape
        heads, k = self.spec.num_heads, self.spec.head_dim
        q_BCIK = apply_rope(self.wq_b(q_latent_BCQ).view(b, c, heads, k), cos_BCR, sin_BCR, interleaved=True)
        return q_BCIK.float() * k**-0.5, self.weights_proj(x_BCD).float() * heads**-0.5

    def keys(self, x_BCD, cos_BCR, sin_BCR) -> torch.Tensor:
        """fp32 [B, C, K]: one key per token."""
        return apply_rope(self.k_norm(self.wk(x_BCD))[:, :, None], cos_BCR, sin_BCR, interleaved=True)[:, :, 0].float()


def index_scores(q_BcIK: torch.Tensor, w_BcI: torch.Tensor, k_BTK: torch.Tensor) -> torch.Tensor:
    """fp32 [B, c, T]: score(t, s) = sum_j w_tj relu(q_tj . k_s) for these queries and keys."""
    dots_BcIT = torch.einsum("bcik,bsk->bcis", q_BcIK, k_BTK)
    return torch.einsum("bci,bcis->bcs", w_BcI, F.relu(dots_BcIT))


def _rows(per_row_bytes: int, c: int) -> int:
    return max(1, min(c, CHUNK_BYTES // max(per_row_bytes, 1)))


def _bmm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b with fp32 results (bf16 inputs keep an fp32 accumulator's result on CUDA)."""
    if a.is_cuda and a.dtype in (torch.bfloat16, torch.float16):
        return torch.bmm(a, b, out_dtype=torch.float32)
    return torch.bmm(a, b).float()


class _SparseMLA(torch.autograd.Function):
    """out[t, h] = sum_s softmax_s(q[t, h] . kv[idx[t, s]] * scale) kv[idx[t, s], :Vd] over the
    valid s, a chunk of queries at a time; q [B, C, H, X], kv [B, T, X] (all heads share a row)."""

    @staticmethod
    def forward(ctx, q_BCHX, kv_BTX, index_BCS, valid_BCS, scale: float, v_dim: int):
        b, c, h, x = q_BCHX.shape
        s = index_BCS.shape[-1]
        out_BCHV = q_BCHX.new_empty(b, c, h, v_dim)
        lse_BCH = torch.empty(b, c, h, dtype=torch.float32, device=q_BCHX.device)
        step = _rows(s * x * kv_BTX.element_size() + 2 * h * s * 4, c)
        for i in range(b):
            for t0 in range(0, c, step):
                rows = slice(t0, t0 + step)
                kv_cSX = kv_BTX[i][index_BCS[i, rows]]
                logits_cHS = _bmm_fp32(q_BCHX[i, rows], kv_cSX.transpose(1, 2)) * scale
                logits_cHS.masked_fill_(~valid_BCS[i, rows, None, :], float("-inf"))
                lse_cH = logits_cHS.logsumexp(-1)
                p_cHS = (logits_cHS - lse_cH[..., None]).exp_()
                out_BCHV[i, rows] = torch.bmm(p_cHS.to(kv_BTX.dtype), kv_cSX[..., :v_dim])
                lse_BCH[i, rows] = lse_cH
        ctx.save_for_backward(q_BCHX, kv_BTX, index_BCS, valid_BCS, out_BCHV, lse_BCH)
        ctx.scale, ctx.v_dim, ctx.step = scale, v_dim, step
        return out_BCHV

    @staticmethod
    def backward(ctx, *grads):
        (dout_BCHV,) = grads
        q_BCHX, kv_BTX, index_BCS, valid_BCS, out_BCHV, lse_BCH = ctx.saved_tensors
        scale, v, step = ctx.scale, ctx.v_dim, ctx.step
        b, c = q_BCHX.shape[:2]
        dq_BCHX = torch.empty_like(q_BCHX)
        dkv_BTX = torch.zeros(kv_BTX.shape, dtype=torch.float32, device=kv_BTX.device)
        dout_BCHV = dout_BCHV.to(q_BCHX.dtype)
        delta_BCH = (dout_BCHV.float() * out_BCHV.float()).sum(-1)
        for i in range(b):
            for t0 in range(0, c, step):
                rows = slice(t0, t0 + step)
                index_cS = index_BCS[i, rows]
                kv_cSX = kv_BTX[i][index_cS]
                q_cHX, do_cHV = q_BCHX[i, rows], dout_BCHV[i, rows]
                logits_cHS = _bmm_fp32(q_cHX, kv_cSX.transpose(1, 2)) * scale
                logits_cHS.masked_fill_(~valid_BCS[i, rows, None, :], float("-inf"))
                p_cHS = (logits_cHS - lse_BCH[i, rows, :, None]).exp_()
                dp_cHS = _bmm_fp32(do_cHV, kv_cSX[..., :v].transpose(1, 2))
                ds_cHS = (p_cHS * (dp_cHS - delta_BCH[i, rows, :, None]) * scale).to(q_BCHX.dtype)
                dq_BCHX[i, rows] = torch.bmm(ds_cHS, kv_cSX)
                dkv_cSX = _bmm_fp32(ds_cHS.transpose(1, 2), q_cHX)
                dkv_cSX[..., :v] += _bmm_fp32(p_cHS.to(q_BCHX.dtype).transpose(1, 2), do_cHV)
                dkv_BTX[i].index_add_(0, index_cS.flatten(), dkv_cSX.flatten(0, 1))
        return dq_BCHX, dkv_BTX.to(kv_BTX.dtype), None, None, None, None


def sparse_mla(q_BCHX, kv_BTX, index_BCS, valid_BCS, scale: float, v_dim: int) -> torch.Tensor:
    """`_SparseMLA` under autocast: q and kv in autocast's dtype, the chunks' matmuls in it."""
    device = q_BCHX.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        q_BCHX, kv_BTX = q_BCHX.to(dtype), kv_BTX.to(dtype)
    else:
        kv_BTX = kv_BTX.to(q_BCHX.dtype)
    with torch.autocast(device, enabled=False):
        if KERNEL and q_BCHX.is_cuda:
            out = sparse_mla_triton(q_BCHX, kv_BTX, index_BCS, valid_BCS, scale, v_dim)
        else:
            out = _SparseMLA.apply(q_BCHX, kv_BTX, index_BCS, valid_BCS, scale, v_dim)
    assert isinstance(out, torch.Tensor)
    return out


class MLAttention(Mixer):
    """The MLA block (HF's `self_attn`), with DSA's selection when its spec is sparse."""

    def __init__(self, spec: MLA, dim: int, eps: float, zero_centered: bool = False):
        super().__init__()
        self.spec, self.rope = spec, spec.rope
        h, r = spec.num_heads, spec.kv_lora_rank
        if spec.q_lora_rank is None:
            self.q_proj = nn.Linear(dim, h * spec.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(dim, spec.q_lora_rank, bias=spec.bias)
            self.q_a_layernorm = RMSNorm(spec.q_lora_rank, spec.latent_eps, zero_centered)
            self.q_b_proj = nn.Linear(spec.q_lora_rank, h * spec.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(dim, r + spec.qk_rope_head_dim, bias=spec.bias)
        self.kv_a_layernorm = RMSNorm(r, spec.latent_eps, zero_centered)
        self.kv_b_proj = nn.Linear(r, h * (spec.qk_nope_head_dim + spec.v_head_dim), bias=False)
        self.o_proj = nn.Linear(h * spec.v_head_dim, dim, bias=spec.bias)
        self.indexer = None
        if spec.indexer is not None:
            assert spec.q_lora_rank is not None, "MLA refuses an indexer without q_lora_rank"
            self.indexer = Indexer(spec.indexer, dim, spec.q_lora_rank)
            self.indexer.requires_grad_(False)  # frozen: nothing differentiates it (module docstring)

    def forward(self, x_BCD, cos_BCR, sin_BCR, seqs: PackedSeqs, backend) -> torch.Tensor:
        assert cos_BCR is not None and sin_BCR is not None, "the model gives each RoPE's cos and sin"
        spec = self.spec
        b, c, _ = x_BCD.shape
        h, nope, rope_dim, lat = spec.num_heads, spec.qk_nope_head_dim, spec.qk_rope_head_dim, spec.kv_lora_rank
        cp = backend if callable(backend) else None
        if cp is not None and not hasattr(cp, "gather"):
            raise ValueError("MLA attention under context parallelism needs a back-end that gathers the row (gather)")
        start = cp.rank * c if cp is not None else 0  # pyright: ignore[reportAttributeAccessIssue]
        q_latent_BCQ = None
        if spec.q_lora_rank is None:
            q = self.q_proj(x_BCD)
        else:
            q_latent_BCQ = self.q_a_layernorm(self.q_a_proj(x_BCD))
            q = self.q_b_proj(q_latent_BCQ)
        q_nope_BCHN, q_rope_BCHR = q.view(b, c, h, spec.qk_head_dim).split([nope, rope_dim], dim=-1)
        q_rope_BCHR = apply_rope(q_rope_BCHR, cos_BCR, sin_BCR, interleaved=True)
        latent_BCL, k_rope_BCR = self.kv_a_proj_with_mqa(x_BCD).split([lat, rope_dim], dim=-1)
        k_rope_BCR = apply_rope(k_rope_BCR[:, :, None], cos_BCR, sin_BCR, interleaved=True)[:, :, 0]
        latent_BCL = self.kv_a_layernorm(latent_BCL)
        kv_BCX = torch.cat([latent_BCL, k_rope_BCR.to(latent_BCL.dtype)], dim=-1)  # the row every head reads
        kv_BTX = cp.gather(kv_BCX) if cp is not None else kv_BCX  # pyright: ignore[reportAttributeAccessIssue]
        sparse = FAST_PATH and spec.sparse
        chosen = self._select(x_BCD, q_latent_BCQ, cos_BCR, sin_BCR, seqs, start, cp, sparse)
        w_kv = self.kv_b_proj.weight.view(h, nope + spec.v_head_dim, lat)
        if sparse:  # absorbed: each head's query in the latent space, values the latent
            if type(self.kv_b_proj) is not nn.Linear:
                raise ValueError(
                    "the sparse MLA path reads kv_b_proj's weight, and kv_b_proj is adapted (LoRA): "
                    "leave kv_b_proj out of trainer.lora.targets"
                )
            assert chosen.index_BCS is not None and chosen.valid_BCS is not None
            q_BCHX = torch.cat([torch.einsum("bchn,hnl->bchl", q_nope_BCHN, w_kv[:, :nope]), q_rope_BCHR], dim=-1)
            out_BCHL = sparse_mla(q_BCHX, kv_BTX, chosen.index_BCS, chosen.valid_BCS, spec.scale, lat)
            out_BCHV = torch.einsum("bchl,hvl->bchv", out_BCHL, w_kv[:, nope:].to(out_BCHL.dtype))
        else:  # the oracle: every head's keys and values over the whole row, under the mask
            assert chosen.mask_BCT is not None
            t = kv_BTX.shape[1]
            k_nope_BTHN, v_BTHV = self.kv_b_proj(kv_BTX[..., :lat]).view(b, t, h, -1).split([nope, spec.v_head_dim], -1)
            k_rope_BTHR = kv_BTX[:, :, None, lat:].expand(b, t, h, rope_dim).to(k_nope_BTHN.dtype)
            q_BCHK = torch.cat([q_nope_BCHN, q_rope_BCHR], dim=-1)
            k_BTHK = torch.cat([k_nope_BTHN, k_rope_BTHR], dim=-1)
            q, k, v = (y.transpose(1, 2) for y in (q_BCHK, k_BTHK, v_BTHV))
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=chosen.mask_BCT[:, None], scale=spec.scale)
            out_BCHV = out.transpose(1, 2)
        return self.o_proj(out_BCHV.reshape(b, c, h * spec.v_head_dim))

    def _select(self, x_BCD, q_latent_BCQ, cos_BCR, sin_BCR, seqs: PackedSeqs, start: int, cp, sparse: bool):
        """The keys each query of the chunk attends to: its document's, up to it; with DSA, the
        selected ones among them (chosen here by the indexer, or reused from `topk_slot`)."""
        spec = self.spec
        if self.indexer is not None:
            assert spec.indexer is not None and q_latent_BCQ is not None, "built with an indexer and a q latent"
            with torch.no_grad():
                chosen = self._choose(x_BCD, q_latent_BCQ, cos_BCR, sin_BCR, seqs, start, cp, sparse)
            seqs.selections[spec.topk_slot] = chosen
            return chosen
        if spec.reuse_topk:
            if spec.topk_slot not in seqs.selections:
                raise ValueError(
                    f"this MLA layer reuses layer {spec.topk_slot}'s top-k selection, which has not run in this forward"
                )
            return seqs.selections[spec.topk_slot]
        return Selection(mask_BCT=document_causal(seqs, start, x_BCD.shape[1]))

    def _choose(self, x_BCD, q_latent_BCQ, cos_BCR, sin_BCR, seqs, start: int, cp, sparse: bool) -> Selection:
        assert self.indexer is not None and self.spec.indexer is not None
        topk = self.spec.indexer.topk
        q_BCIK, w_BCI = self.indexer.queries(x_BCD, q_latent_BCQ, cos_BCR, sin_BCR)
        k_BCK = self.indexer.keys(x_BCD, cos_BCR, sin_BCR)
        k_BTK = cp.gather(k_BCK) if cp is not None else k_BCK
        c = x_BCD.shape[1]
        if not sparse:
            scores_BCT = index_scores(q_BCIK, w_BCI, k_BTK)
            return Selection(mask_BCT=topk_keys(scores_BCT, document_causal(seqs, start, c), topk))
        chunks = []
        kernel = INDEX_KERNEL and q_BCIK.is_cuda
        low = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else self.indexer.wq_b.weight.dtype
        dots_dtype = low if low in (torch.bfloat16, torch.float16) else torch.float32
        per_row = k_BTK.shape[1] * 8 * 2 if kernel else q_BCIK.shape[2] * k_BTK.shape[1] * 4 * 2
        step = _rows(per_row, c)
        for t0 in range(0, c, step):  # each chunk of queries against the keys up to its last
            t1 = min(t0 + step, c)
            end = start + t1
            q, w, k = q_BCIK[:, t0:t1], w_BCI[:, t0:t1], k_BTK[:, :end]
            if kernel:
                chunks.append(top_keys(index_keys_triton(q, w, k, seqs.doc_ids_BT, start + t0, dots_dtype), topk))
            else:
                allowed = document_causal(seqs, start + t0, t1 - t0)[..., :end]
                chunks.append(topk_indices(index_scores(q, w, k), allowed, topk))
        s = max(index.shape[-1] for index, _ in chunks)  # the last chunk's keys (earlier ones may have fewer)
        index_BCS = torch.cat([F.pad(index, (0, s - index.shape[-1])) for index, _ in chunks], dim=1)
        valid_BCS = torch.cat([F.pad(valid, (0, s - valid.shape[-1])) for _, valid in chunks], dim=1)
        return Selection(index_BCS=index_BCS, valid_BCS=valid_BCS)
