"""Causal attention over packed rows on CPU (the sdpa back-end's two layouts), against each
document attended alone with torch's own SDPA: outputs and the gradients of q, k and v."""

import pytest
import torch
import torch.nn.functional as F

from primerl_models import PackedSeqs, attention

H, G, K = 4, 2, 8


def packed(lengths_per_row: list[list[int]], seed: int = 0):
    """q, k, v for rows of the given document lengths (zero-padded rows are one more document),
    and the position ids that mark the documents."""
    t = max(sum(row) for row in lengths_per_row)
    pos = []
    for row in lengths_per_row:
        ids = [torch.arange(n) for n in row]
        if (pad := t - sum(row)) > 0:
            ids.append(torch.arange(pad))
        pos.append(torch.cat(ids))
    g = torch.Generator().manual_seed(seed)
    b = len(lengths_per_row)
    q, k, v = (torch.randn(b, t, n, K, generator=g, dtype=torch.float64, requires_grad=True) for n in (H, G, G))
    return q, k, v, torch.stack(pos)


def each_document_alone(q, k, v, pos):
    """[B, T, H, K]: every document through SDPA on its own, causal, kv heads repeated."""
    out = torch.empty_like(q)
    for r in range(q.shape[0]):
        starts = (pos[r] == 0).nonzero().flatten().tolist() + [q.shape[1]]
        for a, e in zip(starts, starts[1:]):
            qd = q[r, a:e].transpose(0, 1)[None]
            kd, vd = (x[r, a:e].transpose(0, 1).repeat_interleave(H // G, dim=0)[None] for x in (k, v))
            out[r, a:e] = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True)[0].transpose(0, 1)
    return out


@pytest.mark.parametrize("rows, padded", [
    ([[5, 9, 3, 7, 4], [12, 6, 2], [10, 8]], True),   # short documents in long rows
    ([[30, 2], [28, 3, 1]], False),                 # one long document per row: the dense mask
])
def test_packed_attention_equals_each_document_alone(rows, padded):
    q, k, v, pos = packed(rows)
    seqs = PackedSeqs.from_position_ids(pos)
    assert seqs.padded_cheaper() is padded and not seqs.single_doc
    got = attention(q, k, v, seqs, "sdpa")
    ref = each_document_alone(q, k, v, pos)
    torch.testing.assert_close(got, ref, atol=1e-12, rtol=0)
    up = torch.randn_like(ref)
    grads = torch.autograd.grad((got * up).sum(), (q, k, v))
    ref_grads = torch.autograd.grad((ref * up).sum(), (q, k, v))
    for name, a, e in zip("qkv", grads, ref_grads):
        assert e.abs().max() > 0.1, name
        torch.testing.assert_close(a, e, atol=1e-12, rtol=0, msg=lambda m, n=name: f"d{n}: {m}")
    assert (seqs.padded is not None) is padded  # the layout that was checked is the one chosen
