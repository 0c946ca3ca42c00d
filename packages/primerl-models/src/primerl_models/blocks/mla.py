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
loss, which post-training does not have). A "shared" layer (`reuse_topk`) attends to the keys the
layer that wrote its `topk_slot` chose, kept for the forward in `PackedSeqs.selections`.

This is the exact torch form (the CPU oracle): the scores and the attention are computed densely
under a [B, T, T] mask of the selected keys, within each document of a packed row.

Legend: B batch, T tokens, D hidden, H heads, Q q latent, L kv latent, R rope dims, I indexer heads,
K indexer head_dim, Vd value head_dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from primerl_models.args import MLA, DSAIndexer
from primerl_models.blocks.mixer import Mixer
from primerl_models.blocks.norms import RMSNorm
from primerl_models.blocks.rope import apply_rope
from primerl_models.packing import PackedSeqs


def document_causal(seqs: PackedSeqs) -> torch.Tensor:
    """bool [B, T, T]: key s is in query t's document and not after it."""
    doc_BT = seqs.doc_ids_BT
    t = doc_BT.shape[1]
    causal_TT = torch.ones(t, t, dtype=torch.bool, device=doc_BT.device).tril()
    return (doc_BT[:, :, None] == doc_BT[:, None, :]) & causal_TT


def topk_keys(scores_BTT: torch.Tensor, allowed_BTT: torch.Tensor, topk: int) -> torch.Tensor:
    """bool [B, T, T]: each query's `topk` best-scored allowed keys (all of them when it has
    fewer). Equal scores are common (the ReLU's zeros: a key no head scores above 0) and go to
    the later key, so that a document's choice does not depend on where it sits in a packed row
    (torch.topk leaves ties unspecified; on CPU it too took the later keys in our tests)."""
    t = scores_BTT.shape[-1]
    latest_first_BTT = scores_BTT.masked_fill(~allowed_BTT, float("-inf")).flip(-1)
    order_BTk = latest_first_BTT.sort(dim=-1, descending=True, stable=True).indices[..., : min(topk, t)]
    chosen_BTT = torch.zeros_like(allowed_BTT).scatter(-1, t - 1 - order_BTk, True)
    return chosen_BTT & allowed_BTT  # a query with fewer than topk keys also "chose" masked ones


class Indexer(nn.Module):
    """DSA's indexer (HF's `self_attn.indexer`): scores every (query, key) pair."""

    def __init__(self, spec: DSAIndexer, dim: int, q_lora_rank: int):
        super().__init__()
        self.spec = spec
        self.wq_b = nn.Linear(q_lora_rank, spec.num_heads * spec.head_dim, bias=False)
        self.wk = nn.Linear(dim, spec.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(spec.head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(dim, spec.num_heads, bias=False)

    def forward(self, x_BTD: torch.Tensor, q_latent_BTQ: torch.Tensor, cos_BTR, sin_BTR) -> torch.Tensor:
        """fp32 [B, T, T] scores (not yet masked)."""
        b, t, _ = x_BTD.shape
        heads, k = self.spec.num_heads, self.spec.head_dim
        q_BTIK = apply_rope(self.wq_b(q_latent_BTQ).view(b, t, heads, k), cos_BTR, sin_BTR, interleaved=True)
        k_BTK = apply_rope(self.k_norm(self.wk(x_BTD))[:, :, None], cos_BTR, sin_BTR, interleaved=True)[:, :, 0]
        dots_BITT = torch.einsum("btik,bsk->bits", q_BTIK.float(), k_BTK.float()) * k**-0.5
        weights_BTI = self.weights_proj(x_BTD).float() * heads**-0.5
        return torch.einsum("bti,bits->bts", weights_BTI, F.relu(dots_BITT))


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

    def forward(self, x_BTD, cos_BTR, sin_BTR, seqs: PackedSeqs, backend) -> torch.Tensor:
        if callable(backend):
            raise ValueError("MLA attention does not run under context parallelism (attention from outside the model)")
        assert cos_BTR is not None and sin_BTR is not None, "the model gives each RoPE's cos and sin"
        spec = self.spec
        b, t, _ = x_BTD.shape
        h, nope, rope_dim = spec.num_heads, spec.qk_nope_head_dim, spec.qk_rope_head_dim
        q_latent_BTQ = None
        if spec.q_lora_rank is None:
            q = self.q_proj(x_BTD)
        else:
            q_latent_BTQ = self.q_a_layernorm(self.q_a_proj(x_BTD))
            q = self.q_b_proj(q_latent_BTQ)
        q_nope_BTHN, q_rope_BTHR = q.view(b, t, h, spec.qk_head_dim).split([nope, rope_dim], dim=-1)
        latent_BTL, k_rope_BTR = self.kv_a_proj_with_mqa(x_BTD).split([spec.kv_lora_rank, rope_dim], dim=-1)
        kv_BTHX = self.kv_b_proj(self.kv_a_layernorm(latent_BTL)).view(b, t, h, nope + spec.v_head_dim)
        k_nope_BTHN, v_BTHV = kv_BTHX.split([nope, spec.v_head_dim], dim=-1)
        q_rope_BTHR = apply_rope(q_rope_BTHR, cos_BTR, sin_BTR, interleaved=True)
        k_rope_BT1R = apply_rope(k_rope_BTR[:, :, None], cos_BTR, sin_BTR, interleaved=True)
        q_BTHK = torch.cat([q_nope_BTHN, q_rope_BTHR], dim=-1)
        k_BTHK = torch.cat([k_nope_BTHN, k_rope_BT1R.expand(b, t, h, rope_dim)], dim=-1)
        mask_BTT = self._keys(x_BTD, q_latent_BTQ, cos_BTR, sin_BTR, seqs)
        q, k, v = (y.transpose(1, 2) for y in (q_BTHK, k_BTHK, v_BTHV))
        out_BHTV = F.scaled_dot_product_attention(q, k, v, attn_mask=mask_BTT[:, None], scale=spec.scale)
        return self.o_proj(out_BHTV.transpose(1, 2).reshape(b, t, h * spec.v_head_dim))

    def _keys(self, x_BTD, q_latent_BTQ, cos_BTR, sin_BTR, seqs: PackedSeqs) -> torch.Tensor:
        """bool [B, T, T]: the keys each query attends to (its document's, up to it; with DSA,
        the selected ones among them)."""
        allowed_BTT = document_causal(seqs)
        spec = self.spec
        if self.indexer is not None:
            assert spec.indexer is not None and q_latent_BTQ is not None, "built with an indexer and a q latent"
            with torch.no_grad():
                scores_BTT = self.indexer(x_BTD, q_latent_BTQ, cos_BTR, sin_BTR)
                chosen_BTT = topk_keys(scores_BTT, allowed_BTT, spec.indexer.topk)
            seqs.selections[spec.topk_slot] = chosen_BTT
            return chosen_BTT
        if spec.reuse_topk:
            if spec.topk_slot not in seqs.selections:
                raise ValueError(
                    f"this MLA layer reuses layer {spec.topk_slot}'s top-k selection, which has not run in this forward"
                )
            return seqs.selections[spec.topk_slot]
        return allowed_BTT
