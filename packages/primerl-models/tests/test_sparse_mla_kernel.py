"""The sparse MLA Triton kernels (kernels/sparse_mla.py) against the torch `_SparseMLA` they
replace on CUDA (blocks/mla.py), fp32 inputs: output, lse and the gradients of q and kv. On CUDA
when there is one, else under Triton's CPU interpreter (tiny shapes: it is slow).
Legend as in mla.py: B batch, C queries, T keys, H heads, L latent, R rope, X = L + R, S slots."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # read when Triton is imported
pytest.importorskip("triton")

from primerl_models.blocks.mla import _SparseMLA  # noqa: E402
from primerl_models.kernels import sparse_mla  # noqa: E402
from primerl_models.kernels.sparse_mla import BACKWARD, FORWARD, sparse_mla_with_lse  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = 1e-4
"""Relative to the largest magnitude of each reference: fp32 arithmetic in a different order."""


def _inputs(b, c, t, h, lat, rope, s, generator, min_valid=1):
    """q [B, C, H, X], kv [B, T, X], index and valid [B, C, S]: each query has between min_valid
    and S valid slots at random places (the others index 0), keys drawn with repeats from T, so that
    every key is selected by many queries (and some several times by one)."""
    x = lat + rope
    q_BCHX = torch.randn(b, c, h, x, generator=generator)
    kv_BTX = torch.randn(b, t, x, generator=generator)
    index_BCS = torch.randint(0, t, (b, c, s), generator=generator)
    n_BC1 = torch.randint(min_valid, s + 1, (b, c, 1), generator=generator)
    n_BC1[0, 0] = 1  # a query with a single valid key
    n_BC1[-1, -1] = s  # and one with all of them
    rank_BCS = torch.rand(b, c, s, generator=generator).argsort(-1).argsort(-1)
    valid_BCS = rank_BCS < n_BC1
    index_BCS = index_BCS.masked_fill(~valid_BCS, 0)
    return q_BCHX, kv_BTX, index_BCS, valid_BCS


def _reference_lse(q_BCHX, kv_BTX, index_BCS, valid_BCS, scale):
    kv_BCSX = torch.stack([kv_BTX[i][index_BCS[i]] for i in range(kv_BTX.shape[0])])
    logits_BCHS = torch.einsum("bchx,bcsx->bchs", q_BCHX, kv_BCSX) * scale
    return logits_BCHS.masked_fill(~valid_BCS[:, :, None], float("-inf")).logsumexp(-1)


def _run(fn, q_BCHX, kv_BTX, index_BCS, valid_BCS, scale, v_dim, dout_BCHV):
    q = q_BCHX.to(DEVICE, copy=True).requires_grad_()  # a leaf of its own (its own .grad)
    kv = kv_BTX.to(DEVICE, copy=True).requires_grad_()
    out = fn(q, kv, index_BCS.to(DEVICE), valid_BCS.to(DEVICE), scale, v_dim)
    lse = None
    if isinstance(out, tuple):
        out, lse = out
    (out * dout_BCHV.to(DEVICE)).sum().backward()
    assert q.grad is not None and kv.grad is not None
    return out.detach().cpu(), None if lse is None else lse.cpu(), q.grad.cpu(), kv.grad.cpu()


def _close(name, got, ref):
    bound = TOL * ref.abs().max().item()
    err = (got - ref).abs().max().item()
    assert torch.isfinite(got).all(), f"{name}: not finite"
    assert err <= bound, f"{name}: max error {err:.3g} over {bound:.3g} ({TOL} of the largest magnitude)"


@pytest.mark.parametrize(
    "b, c, t, h, lat, rope, s",
    [
        (2, 5, 16, 5, 40, 12, 75),  # H, L, R not powers of two, S not a multiple of BLOCK_S
        (2, 3, 7, 40, 24, 8, 33),  # two head blocks in the backward, more slots than keys
        (1, 4, 64, 16, 32, 16, 64),  # powers of two, S a multiple of BLOCK_S
    ],
)
@pytest.mark.parametrize("form", ["one-pass", "split", "stored"])
def test_kernel_matches_sparse_mla(b, c, t, h, lat, rope, s, form, monkeypatch):
    monkeypatch.setattr(sparse_mla, "BACKWARD_FORM", form)
    if form == "stored":  # chunks of 2 queries: the last one short, queries past the first chunk
        monkeypatch.setattr(sparse_mla, "STORED_BYTES", 2 * 2 * b * h * s * 4)
    assert s % FORWARD["BLOCK_S"] or s % BACKWARD["BLOCK_S"] or (h, lat, rope) == (16, 32, 16)
    g = torch.Generator().manual_seed(b * 1000 + c * 100 + h)
    q, kv, index, valid = _inputs(b, c, t, h, lat, rope, s, g)
    scale = (lat + rope) ** -0.5
    dout = torch.randn(b, c, h, lat, generator=g)
    ref_out, _, ref_dq, ref_dkv = _run(_SparseMLA.apply, q, kv, index, valid, scale, lat, dout)
    out, lse, dq, dkv = _run(sparse_mla_with_lse, q, kv, index, valid, scale, lat, dout)
    assert lse is not None
    _close("out", out, ref_out)
    _close("lse", lse, _reference_lse(q, kv, index, valid, scale))
    _close("dq", dq, ref_dq)
    _close("dkv", dkv, ref_dkv)


def test_invalid_slots_are_not_read():
    """Invalid slots index key 0, whose row is huge and which no valid slot selects: it would
    take the whole softmax if they were read. The result must be the reference's, with no
    gradient to key 0."""
    b, c, t, h, lat, rope, s = 2, 4, 12, 3, 20, 12, 40
    g = torch.Generator().manual_seed(7)
    q, kv, index, valid = _inputs(b, c, t, h, lat, rope, s, g)
    index = torch.where(valid, index.clamp(min=1), 0)
    kv[:, 0] = 50.0
    q[..., :] = q.abs()  # every score against key 0 large and positive
    scale = (lat + rope) ** -0.5
    dout = torch.randn(b, c, h, lat, generator=g)
    ref_out, _, ref_dq, ref_dkv = _run(_SparseMLA.apply, q, kv, index, valid, scale, lat, dout)
    out, lse, dq, dkv = _run(sparse_mla_with_lse, q, kv, index, valid, scale, lat, dout)
    assert lse is not None and (~valid).any()
    _close("out", out, ref_out)
    _close("lse", lse, _reference_lse(q, kv, index, valid, scale))
    _close("dq", dq, ref_dq)
    _close("dkv", dkv, ref_dkv)
    assert (dkv[:, 0] == 0).all()
    assert out.abs().max() < 10  # a read of key 0 would give values near 50
