"""DSA's indexer kernel (kernels/dsa_index.py) against the torch forms it replaces on CUDA
(blocks/mla.py: index_scores, document_causal, order_keys): the same keys, so the same top-k.
On CUDA when there is one, else under Triton's CPU interpreter (small shapes: it is slow).
Legend as in mla.py: B batch, c queries, T keys, I indexer heads, K their width."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # read when Triton is imported
pytest.importorskip("triton")

from primerl_models import PackedSeqs  # noqa: E402
from primerl_models.blocks import mla  # noqa: E402
from primerl_models.kernels.dsa_index import NONE, index_keys_triton  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CUDA_ONLY = pytest.mark.skipif(DEVICE != "cuda", reason="bf16 dots and the layer's CUDA path need a GPU")


def _positions(b, t, doc_lengths):
    """Position ids of b rows of t tokens cut into documents of these lengths (the last one takes
    what is left), each row's cut rotated by its index."""
    pos = []
    for i in range(b):
        lengths = [*doc_lengths[i:], *doc_lengths[:i]]
        row, used = [], 0
        for n in lengths:
            n = min(n, t - used)
            row += range(n)
            used += n
        row += range(t - used)
        pos.append(row)
    return torch.tensor(pos)


def _row(b, t, doc_lengths):
    return PackedSeqs.from_position_ids(_positions(b, t, doc_lengths))


def _inputs(b, c, t, heads, width, generator):
    q = torch.randn(b, c, heads, width, generator=generator)
    w = torch.randn(b, c, heads, generator=generator)  # negative weights too: -0.0 scores
    k = torch.randn(b, t, width, generator=generator)
    k[:, 3::7] = 0.0  # keys every head scores 0: ties, -0.0 where w < 0
    return q, w, k


def _reference(q, w, k, seqs, start):
    c, t = q.shape[1], k.shape[1]
    allowed = mla.document_causal(seqs, start, c)[..., :t]
    return mla.order_keys(mla.index_scores(q, w, k), allowed), mla.index_scores(q, w, k)


def _decoded(keys):
    """The scores a key carries (its high 32 bits back to a float)."""
    ordered = (keys >> 32).to(torch.int32)
    return torch.where(ordered < 0, ordered ^ 0x7FFFFFFF, ordered).view(torch.float32)


@pytest.mark.parametrize(
    "b, c, t, start, heads, width, docs",
    [
        (2, 23, 32, 9, 3, 20, [5, 14, 6]),  # I and K padded, queries ending at the last key
        (1, 37, 50, 0, 16, 16, [50]),  # the tiny GLM-5's indexer heads, keys past the queries
        (2, 9, 140, 128, 32, 128, [70, 30]),  # GLM-5's 32 heads of 128, a second key block
    ],
)
def test_keys_are_the_torch_forms(b, c, t, start, heads, width, docs):
    g = torch.Generator().manual_seed(c * 100 + heads)
    q, w, k = _inputs(b, c, t, heads, width, g)
    seqs = _row(b, max(t, start + c), docs)
    ref_keys, ref_scores = _reference(q, w, k, seqs, start)
    keys = index_keys_triton(q.to(DEVICE), w.to(DEVICE), k.to(DEVICE), seqs.doc_ids_BT.to(DEVICE), start, torch.float32)
    keys = keys.cpu()
    allowed = ref_keys != NONE
    assert allowed.any() and (~allowed).any()
    assert torch.equal(keys == NONE, ~allowed), "the pairs a query may read"
    assert torch.equal(keys[allowed] & 0xFFFFFFFF, ref_keys[allowed] & 0xFFFFFFFF), "the key positions"
    err = (_decoded(keys)[allowed] - ref_scores[allowed]).abs().max().item()
    assert err <= 1e-5 * ref_scores.abs().max().item(), f"scores off by {err:.3g}"
    assert ((ref_scores == 0) & allowed).any(), "ties at zero (ReLU) exercise the later-key rule"
    for topk in (1, 4, 11, t):
        got, ref = mla.top_keys(keys, topk), mla.top_keys(ref_keys, topk)
        chosen = [torch.zeros(b, c, t, dtype=torch.int64).scatter_add(-1, i, v.long()) > 0 for i, v in (got, ref)]
        assert torch.equal(chosen[0], chosen[1]), topk


@CUDA_ONLY
def test_bf16_dots_are_within_the_bound_of_bf16_operands():
    """Each dot's operands rounded to bf16 (relative 2^-8 each) with an fp32 accumulator: a
    score moves by at most sum_j |w_j| 2^-7 sum |q_j| |k| (and the accumulation's fp32 error)."""
    g = torch.Generator().manual_seed(3)
    b, c, t, heads, width = 1, 300, 300, 32, 128
    q, w, k = _inputs(b, c, t, heads, width, g)
    seqs = _row(b, t, [t])
    ref_keys, ref_scores = _reference(q, w, k, seqs, 0)
    keys = index_keys_triton(q.cuda(), w.cuda(), k.cuda(), seqs.doc_ids_BT.cuda(), 0, torch.bfloat16).cpu()
    allowed = ref_keys != NONE
    assert torch.equal(keys == NONE, ~allowed)
    bound = torch.einsum("bci,bcik,bsk->bcs", w.abs(), q.abs(), k.abs()) * (2**-7 + 1e-6)
    err = (_decoded(keys) - ref_scores).abs()
    assert (err[allowed] <= bound[allowed]).all(), f"worst error over its bound {(err / bound)[allowed].max():.3g}"


@CUDA_ONLY
def test_the_layers_choice_on_cuda_is_the_torch_choice(monkeypatch):
    """A GLM-5 attention block's `_choose` (fp32 weights, no autocast: exact dots) picks the same
    keys with the kernel as with the torch forms, over two documents longer than topk."""
    from primerl_models.args import MLA, DSAIndexer, Rope
    from primerl_models.blocks.rope import inv_freq, rope_cos_sin

    torch.manual_seed(0)
    spec = MLA(
        num_heads=4,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=16,
        v_head_dim=16,
        rope=Rope(rotary_dim=16, interleaved=True),
        indexer=DSAIndexer(num_heads=16, head_dim=32, topk=24),
    )
    block = mla.MLAttention(spec, dim=64, eps=1e-6).cuda()
    pos = _positions(1, 200, [120, 80]).cuda()
    seqs = PackedSeqs.from_position_ids(pos)
    cos, sin = rope_cos_sin(pos, inv_freq(spec.rope), interleaved=True)
    x = torch.randn(1, 200, 64, device="cuda")
    q_latent = block.q_a_layernorm(block.q_a_proj(x))
    chosen = []
    for kernel in (True, False):
        monkeypatch.setattr(mla, "INDEX_KERNEL", kernel)
        with torch.no_grad():
            sel = block._choose(x, q_latent, cos, sin, seqs, 0, None, True)
        assert sel.index_BCS is not None and sel.valid_BCS is not None
        chosen.append(
            torch.zeros(1, 200, 200, dtype=torch.int64, device="cuda").scatter_add(
                -1, sel.index_BCS, sel.valid_BCS.long()
            )
        )
    assert torch.equal(chosen[0], chosen[1])
    assert int(chosen[0].sum()) == sum(min(i + 1, 24) for n in (120, 80) for i in range(n))
