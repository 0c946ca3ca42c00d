"""Softmax attention: the block (`SelfAttention`: q, k, v, optional norms, RoPE, an optional
output gate, o) and the causal attention over packed rows it calls, one function with several
back-ends.

A packed row holds several documents end to end; position ids restart at 0 at each document,
and attention never crosses a boundary. `PackedSeqs.from_position_ids` finds the boundaries
once per forward (primerl_models/packing.py); `attention(q, k, v, seqs, backend)` runs one of:

  sdpa    torch SDPA. One document per row: is_causal (flash on GPU). Several: each document
          gathered into a row of its own (right-padded to the longest; is_causal is then
          exact), or a dense block-diagonal causal mask over the packed rows, whichever
          multiplies fewer scores (S * M^2 against B * T^2 for S documents of at most M
          tokens). Short documents in long rows, as in RL on CPU, take the padded layout.
  varlen  torch.nn.attention.varlen (flash varlen kernels, CUDA): packed rows at full speed.
  flex    flex attention with a document-causal block mask (CUDA, compiled).
  auto    sdpa on CPU or for single-document rows; varlen on CUDA when available, else flex;
          flex for attention sinks or shared prompts on CUDA (the sinks' gradient needs the
          log-sum-exp's; varlen's documents cannot branch).

Shared prompts (`seqs.branched`, primerl_models/packing.py): a document that continues its
parent's first P tokens also sees them. sdpa's padded layout takes the documents without a
prompt as usual and those with one in rows of their own queries over copies of the prompt's
keys and values followed by their own (the copies' gradients summed back into the parent's
tokens; no query is spent on a copy), or the dense mask; flex reads them in its mask_mod
(`document_mask`, which the dense mask is built from too); varlen cannot (auto picks flex).
A window then counts positions, not distances in the row.

Sliding windows (`window`: a query sees itself and the window - 1 tokens before it, within its
document) and attention sinks (`sinks_H`: one learned logit per head in every query's softmax,
with no value) work in every back-end: sdpa adds the window to its mask and computes sinks
exactly (the scores with the sink column, softmax, then the values: CPU, tiny models), varlen
passes the window to the kernel (window_size), flex adds it to the block mask and scales the
output by sigmoid(lse - sink), differentiable through flex's log-sum-exp.

A callable `backend(q, k, v, seqs) -> out` is attention supplied from outside the model (the
trainer's context parallelism exchanges tokens for heads around one of the above).

Legend: B batch, T tokens per row, H query heads, G kv heads, K head_dim, N = B*T.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, Literal, cast

import torch
import torch.nn.functional as F
from torch import nn

from primerl_models.args import Attention as AttentionSpec
from primerl_models.blocks.mixer import Mixer
from primerl_models.blocks.norms import RMSNorm
from primerl_models.blocks.rope import apply_rope
from primerl_models.packing import PackedSeqs

BackendName = Literal["auto", "sdpa", "varlen", "flex"]
Backend = BackendName | Callable[..., torch.Tensor]
"""A back-end by name, or attention supplied from outside: `backend(q, k, v, seqs, window=,
sinks_H=) -> out`."""


BACKENDS = ("auto", "sdpa", "varlen", "flex")


def attention(
    q_BTHK: torch.Tensor,
    k_BTGK: torch.Tensor,
    v_BTGK: torch.Tensor,
    seqs: PackedSeqs,
    backend: Backend = "auto",
    *,
    window: int | None = None,
    sinks_H: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention within documents (and a sliding `window`, with `sinks_H` per head
    when given); returns [B, T, H, K]."""
    if callable(backend):
        return backend(q_BTHK, k_BTGK, v_BTGK, seqs, window=window, sinks_H=sinks_H)
    if backend == "auto":
        backend = _auto(q_BTHK, seqs, window, sinks_H)
    if backend == "sdpa":
        return _sdpa(q_BTHK, k_BTGK, v_BTGK, seqs, window, sinks_H)
    if backend == "varlen":
        if seqs.branched:
            raise ValueError(
                "attention backend 'varlen' cannot attend to a shared prompt (its documents do not "
                "branch); use 'flex' or 'auto'"
            )
        if sinks_H is not None:
            raise ValueError(
                "attention backend 'varlen' cannot train attention sinks (flash kernels do not "
                "differentiate their log-sum-exp); use 'flex' or 'auto'"
            )
        return _varlen(q_BTHK, k_BTGK, v_BTGK, seqs, window)
    if backend == "flex":
        return _flex(q_BTHK, k_BTGK, v_BTGK, seqs, window, sinks_H)
    raise ValueError(f"attention backend {backend!r} is not one of {BACKENDS}")


def _auto(q_BTHK, seqs: PackedSeqs, window, sinks_H) -> BackendName:
    if not q_BTHK.is_cuda:
        return "sdpa"
    if sinks_H is not None or seqs.branched:
        return "flex"
    if window is None and seqs.single_doc:
        return "sdpa"
    if _varlen_fn() is not None and (window is None or "window_size" in _VARLEN_PARAMS):
        return "varlen"
    return "flex"


def _sdpa(q_BTHK, k_BTGK, v_BTGK, seqs: PackedSeqs, window: int | None = None, sinks_H=None) -> torch.Tensor:
    """sdpa in the cheaper layout: one row per document (padded) or the packed rows under a
    document mask; plain causal attention for single-document rows without window or sinks."""
    plain = window is None and sinks_H is None
    if seqs.padded_cheaper() and not seqs.single_doc:
        return _sdpa_padded(q_BTHK, k_BTGK, v_BTGK, seqs, window, sinks_H)
    q, k, v = (x.transpose(1, 2) for x in (q_BTHK, k_BTGK, v_BTGK))  # [B, H|G, T, K]
    if seqs.single_doc and plain:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
    else:
        b, t = seqs.doc_ids_BT.shape
        idx = torch.arange(t, device=q.device)
        batch = torch.arange(b, device=q.device)[:, None, None]
        mask_B1TT = document_mask(seqs, window)(batch, None, idx[None, :, None], idx[None, None, :])[:, None]
        out = _masked(q, k, v, mask_B1TT, sinks_H)
    return out.transpose(1, 2)


def document_mask(seqs: PackedSeqs, window: int | None = None) -> Callable[..., torch.Tensor]:
    """flex attention's mask_mod(b, h, q, kv) of the rows: key kv is in query q's document and
    not after it, or in the prompt q's document shares (its parent's tokens before
    prefix_end); and within the window. Written with tensor ops only, so that it also builds
    sdpa's dense mask from broadcast indices."""
    doc = seqs.doc_ids_BT
    if seqs.shared is None:

        def document_causal(b, h, q, kv):
            keep = (doc[b, q] == doc[b, kv]) & (q >= kv)
            return keep & (q - kv < window) if window is not None else keep

        return document_causal
    parent, prefix_end, pos = seqs.shared.parent_BT, seqs.shared.prefix_end_BT, seqs.shared.positions_BT

    def shared_prompt_causal(b, h, q, kv):
        own = (doc[b, q] == doc[b, kv]) & (q >= kv)
        keep = own | ((parent[b, q] == doc[b, kv]) & (kv < prefix_end[b, q]))
        return keep & (pos[b, q] - pos[b, kv] < window) if window is not None else keep

    return shared_prompt_causal


def _band(t: int, window: int | None, device) -> torch.Tensor:
    """bool [T, T]: key j is causal for query i, and inside the window."""
    i, j = torch.arange(t, device=device)[:, None], torch.arange(t, device=device)[None, :]
    keep = j <= i
    return keep & (i - j < window) if window is not None else keep


def _masked(q, k, v, mask, sinks_H) -> torch.Tensor:
    """Attention of [X, H|G, Q|Kv, K] under a bool mask broadcast to [X, H, Q, Kv]; with sinks,
    exact: each query's softmax over its scores and its head's sink, the sink's weight dropped."""
    gqa = q.shape[1] != k.shape[1]
    if sinks_H is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    if gqa:
        k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
    dt = torch.promote_types(q.dtype, torch.float32)  # scores and softmax in fp32 at least
    scores = (q.to(dt) @ k.to(dt).transpose(-1, -2)) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks_H.to(dt).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    probs = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]
    return probs.to(v.dtype) @ v


def _sdpa_padded(q_BTHK, k_BTGK, v_BTGK, seqs: PackedSeqs, window: int | None, sinks_H) -> torch.Tensor:
    """Each document in a row of its own, right-padded with zeros: plain causal attention is
    exact there (a real query never sees a padded key, which comes after it), and the padded
    queries' outputs are dropped; a window or sinks go through the masked path. index_copy /
    index_select move the tokens both ways (on CPU several times faster, forward and backward,
    than advanced indexing or masked_select)."""
    if seqs.shared is not None:
        return _sdpa_shared(q_BTHK, k_BTGK, v_BTGK, seqs, window, sinks_H)
    b, t, h, kd = q_BTHK.shape
    at_N = seqs.padded_layout()
    s_, m = seqs.num_docs, seqs.max_seqlen

    def pad(x_BTXK):
        x = x_BTXK.reshape(b * t, x_BTXK.shape[2], kd)
        return x.new_zeros(s_ * m, x.shape[1], kd).index_copy(0, at_N, x).view(s_, m, x.shape[1], kd).transpose(1, 2)

    q, k, v = pad(q_BTHK), pad(k_BTGK), pad(v_BTGK)  # [S, H|G, M, K]
    if window is None and sinks_H is None:
        out_SHMK = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
    else:
        out_SHMK = _masked(q, k, v, _band(m, window, q.device), sinks_H)
    return out_SHMK.transpose(1, 2).reshape(s_ * m, h, kd).index_select(0, at_N).view(b, t, h, kd)


def _sdpa_shared(q_BTHK, k_BTGK, v_BTGK, seqs: PackedSeqs, window: int | None, sinks_H) -> torch.Tensor:
    """The padded layout of rows with shared prompts, one group of documents at a time
    (packing.PaddedDocs): each document's queries in a row of their own, its prompt's keys and
    values copied in front of its own (their gradients summed back into the prompt's tokens),
    query i of a document with a P-token prompt seeing keys j <= P + i (and P + i - j < window)."""
    assert seqs.shared is not None
    b, t, h, kd = q_BTHK.shape
    q_N, k_N, v_N = (x.reshape(b * t, x.shape[2], kd) for x in (q_BTHK, k_BTGK, v_BTGK))
    out_N = q_N.new_zeros(b * t, h, kd)
    for g in seqs.shared.groups:

        def pad(x_N, tokens, slots, m):
            x = x_N.new_zeros(g.num_docs * m, x_N.shape[1], kd).index_copy(0, slots, x_N.index_select(0, tokens))
            return x.view(g.num_docs, m, x_N.shape[1], kd).transpose(1, 2)  # [docs, H|G, M, K]

        q = pad(q_N, g.tokens, g.q_slots, g.mq)
        k, v = (pad(x, g.kv_tokens, g.kv_slots, g.mk) for x in (k_N, v_N))
        if g.mq == g.mk and window is None and sinks_H is None and not bool(g.prefix.any()):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
        else:
            i = g.prefix[:, None, None] + torch.arange(g.mq, device=q.device)[None, :, None]  # query positions
            j = torch.arange(g.mk, device=q.device)[None, None, :]
            seen = (j <= i) & (i - j < window) if window is not None else j <= i
            out = _masked(q, k, v, seen[:, None], sinks_H)
        out_N = out_N.index_copy(0, g.tokens, out.transpose(1, 2).reshape(-1, h, kd).index_select(0, g.q_slots))
    return out_N.view(b, t, h, kd)


def _load_varlen() -> Callable[..., torch.Tensor] | None:
    """torch's varlen attention, where it can run: CUDA kernels only, so a CPU-only torch build
    does not import it at all (importing it pulls in torch._dynamo: 1.4 s of every CPU process's
    start-up, the trainer's and `primerl rl`'s own checks included). The build, not the device,
    decides: asking for a device here would touch the CUDA driver before processes fork."""
    if torch.version.cuda is None:
        return None
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # torch < 2.10
        return None
    # cast: it returns the output alone unless asked for its auxiliaries (return_aux, which we
    # never pass), and its keywords differ between torch releases (see _VARLEN_CAUSAL)
    return cast("Callable[..., torch.Tensor]", varlen_attn)


_VARLEN = _load_varlen()


# Read once here, not under torch.compile. The causal switch moved between torch releases:
# `is_causal` (2.10/2.11) or `window_size=(-1, 0)` (2.13); remove when the oldest supported
# torch has window_size.
_VARLEN_PARAMS = inspect.signature(_VARLEN).parameters if _VARLEN is not None else {}


_VARLEN_CAUSAL: dict[str, Any] = {"window_size": (-1, 0)} if "window_size" in _VARLEN_PARAMS else {"is_causal": True}


def _varlen_fn():
    return _VARLEN


def _varlen(q_BTHK, k_BTGK, v_BTGK, seqs: PackedSeqs, window: int | None = None) -> torch.Tensor:
    fn = _varlen_fn()
    if fn is None:
        raise ValueError("attention backend 'varlen' needs CUDA and torch.nn.attention.varlen (torch >= 2.10)")
    b, t, h, kd = q_BTHK.shape
    q_NHK, k_NGK, v_NGK = (x.reshape(b * t, x.shape[2], kd) for x in (q_BTHK, k_BTGK, v_BTGK))
    kwargs = dict(_VARLEN_CAUSAL)
    if window is not None:
        if "window_size" not in _VARLEN_PARAMS:
            raise ValueError(
                "attention backend 'varlen' takes sliding windows from torch 2.13 (window_size); use 'flex' or 'auto'"
            )
        kwargs["window_size"] = (window - 1, 0)  # the window - 1 tokens before, and the token itself
    if k_NGK.shape[1] != h:
        if "enable_gqa" in _VARLEN_PARAMS:
            kwargs["enable_gqa"] = True
        else:  # older torch: repeat the kv heads
            k_NGK, v_NGK = (x.repeat_interleave(h // x.shape[1], dim=1) for x in (k_NGK, v_NGK))
    cu, m = seqs.cu_seqlens, seqs.max_seqlen
    out_NHK = fn(q_NHK, k_NGK, v_NGK, cu, cu, m, m, **kwargs)
    return out_NHK.view(b, t, h, kd)


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def _flex(q_BTHK, k_BTGK, v_BTGK, seqs: PackedSeqs, window: int | None = None, sinks_H=None) -> torch.Tensor:
    from torch.nn.attention.flex_attention import create_block_mask

    if window not in seqs.block_masks:
        b, t = seqs.doc_ids_BT.shape
        mask_mod = document_mask(seqs, window)
        seqs.block_masks[window] = create_block_mask(mask_mod, b, None, t, t, device=q_BTHK.device)
    q, k, v = (x.transpose(1, 2) for x in (q_BTHK, k_BTGK, v_BTGK))
    gqa = q.shape[1] != k.shape[1]
    if sinks_H is None:
        out = _compiled_flex()(q, k, v, block_mask=seqs.block_masks[window], enable_gqa=gqa)
    else:
        # softmax over the scores and the sink = the scores' softmax x sigmoid(lse - sink)
        out, lse_BHT = _compiled_flex()(q, k, v, block_mask=seqs.block_masks[window], enable_gqa=gqa, return_lse=True)
        out = out * torch.sigmoid(lse_BHT - sinks_H.float()[None, :, None])[..., None].to(out.dtype)
    return out.transpose(1, 2)


class SelfAttention(Mixer):
    """The softmax attention block (HF's `self_attn`); its spec is args.Attention."""

    def __init__(self, spec: AttentionSpec, dim: int, eps: float, zero_centered: bool = False):
        super().__init__()
        h, g, k = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.spec, self.rope = spec, spec.rope
        self.num_heads, self.num_kv_heads, self.head_dim = h, g, k
        self.q_proj = nn.Linear(dim, h * k, bias=spec.qkv_bias)
        self.k_proj = nn.Linear(dim, g * k, bias=spec.qkv_bias)
        self.v_proj = nn.Linear(dim, g * k, bias=spec.qkv_bias)
        self.o_proj = nn.Linear(h * k, dim, bias=spec.o_bias)
        norm_q, norm_k = {"none": (0, 0), "head": (k, k), "full": (h * k, g * k)}[spec.qk_norm]
        self.q_norm = RMSNorm(norm_q, eps, zero_centered) if norm_q else None
        self.k_norm = RMSNorm(norm_k, eps, zero_centered) if norm_k else None
        self.sinks = nn.Parameter(torch.zeros(h)) if spec.sinks else None
        if spec.gate != "none":
            self.gate_proj = nn.Linear(dim, h if spec.gate_per_head else h * k, bias=False)

    def forward(self, x_BTD, cos_BTR, sin_BTR, seqs: PackedSeqs, backend: Backend) -> torch.Tensor:
        b, t, _ = x_BTD.shape
        q, k, v = self.q_proj(x_BTD), self.k_proj(x_BTD), self.v_proj(x_BTD)
        if self.spec.qk_norm == "full":
            assert self.q_norm is not None and self.k_norm is not None, "built for qk_norm 'full'"
            q, k = self.q_norm(q), self.k_norm(k)
        q_BTHK = q.view(b, t, self.num_heads, self.head_dim)
        k_BTGK = k.view(b, t, self.num_kv_heads, self.head_dim)
        v_BTGK = v.view(b, t, self.num_kv_heads, self.head_dim)
        if self.spec.qk_norm == "head":
            assert self.q_norm is not None and self.k_norm is not None, "built for qk_norm 'head'"
            q_BTHK, k_BTGK = self.q_norm(q_BTHK), self.k_norm(k_BTGK)
        if self.spec.rope is not None:  # else no positions (cos, sin are None)
            assert cos_BTR is not None and sin_BTR is not None, "the model gives each RoPE's cos and sin"
            interleaved = self.spec.rope.interleaved
            q_BTHK = apply_rope(q_BTHK, cos_BTR, sin_BTR, interleaved)
            k_BTGK = apply_rope(k_BTGK, cos_BTR, sin_BTR, interleaved)
        out_BTHK = attention(q_BTHK, k_BTGK, v_BTGK, seqs, backend, window=self.spec.window, sinks_H=self.sinks)
        if self.spec.gate != "none":
            out_BTHK = out_BTHK * self._gate(x_BTD, out_BTHK.dtype).view(b, t, self.num_heads, -1)
        return self.o_proj(out_BTHK.reshape(b, t, -1))

    def _gate(self, x_BTD: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[B, T, H or H*K]: sigmoid or softplus (in fp32 at least) of gate_proj(x)."""
        g = self.gate_proj(x_BTD)
        if self.spec.gate == "sigmoid":
            return torch.sigmoid(g).to(dtype)
        return F.softplus(g.float()).to(dtype)
