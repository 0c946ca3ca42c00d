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


@pytest.mark.parametrize(
    "rows, padded",
    [
        ([[5, 9, 3, 7, 4], [12, 6, 2], [10, 8]], True),  # short documents in long rows
        ([[30, 2], [28, 3, 1]], False),  # one long document per row: the dense mask
    ],
)
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


def by_the_formula(q, k, v, pos, window, sinks):
    """[B, T, H, K] from the definitions, one document and one head at a time: query i of a
    document sees keys j <= i with i - j < window; its weights are the softmax over those
    scores and the head's sink logit, whose weight is dropped (it has no value)."""
    out = torch.zeros_like(q)
    for r in range(q.shape[0]):
        starts = (pos[r] == 0).nonzero().flatten().tolist() + [q.shape[1]]
        for a, e in zip(starts, starts[1:]):
            n = e - a
            i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
            seen = (j <= i) & ((i - j < window) if window else True)
            for hd in range(H):
                kh, vh = k[r, a:e, hd // (H // G)], v[r, a:e, hd // (H // G)]
                scores = (q[r, a:e, hd] @ kh.T / K**0.5).masked_fill(~seen, float("-inf"))
                if sinks is not None:
                    scores = torch.cat([scores, sinks[hd].expand(n, 1)], dim=1)
                out[r, a:e, hd] = scores.softmax(dim=1)[:, :n] @ vh
    return out


@pytest.mark.parametrize("with_sinks", [False, True], ids=["window", "window+sinks"])
@pytest.mark.parametrize(
    "rows, layout",
    [
        ([[5, 9, 3, 7, 4], [12, 6, 2], [10, 8]], "padded"),
        ([[30, 2], [28, 3, 1]], "dense"),
        ([[20], [20]], "single"),
    ],
)
def test_sliding_windows_and_sinks_follow_the_formula(rows, layout, with_sinks):
    """Windows shorter than the documents (4 tokens), non-zero sinks, GQA: outputs and the
    gradients of q, k, v and the sinks equal the formula's, in each of sdpa's layouts; without
    sinks (and with no window) the output is plain attention's."""
    q, k, v, pos = packed(rows, seed=1)
    sinks = (
        (torch.randn(H, dtype=torch.float64, generator=torch.Generator().manual_seed(2)) * 2).requires_grad_()
        if with_sinks
        else None
    )
    seqs = PackedSeqs.from_position_ids(pos)
    assert {
        "padded": seqs.padded_cheaper() and not seqs.single_doc,
        "dense": not seqs.padded_cheaper(),
        "single": seqs.single_doc,
    }[layout]
    got = attention(q, k, v, seqs, "sdpa", window=4, sinks_H=sinks)
    ref = by_the_formula(q, k, v, pos, 4, sinks)
    torch.testing.assert_close(got, ref, atol=1e-12, rtol=0)
    assert (got - attention(q, k, v, seqs, "sdpa")).abs().max() > 1e-3  # the window (and sinks) mattered
    inputs = (q, k, v) + ((sinks,) if with_sinks else ())
    up = torch.randn_like(ref)
    grads = torch.autograd.grad((got * up).sum(), inputs)
    ref_grads = torch.autograd.grad((ref * up).sum(), inputs)
    for name, a, e in zip(["q", "k", "v", "sinks"], grads, ref_grads):
        assert e.abs().max() > 1e-3, name
        torch.testing.assert_close(a, e, atol=1e-12, rtol=0, msg=lambda m, n=name: f"d{n}: {m}")


def test_sinks_without_a_window_and_a_window_longer_than_the_documents():
    q, k, v, pos = packed([[5, 9, 3, 7, 4], [12, 6, 2]], seed=3)
    seqs = PackedSeqs.from_position_ids(pos)
    sinks = torch.linspace(-2, 2, H, dtype=torch.float64)
    torch.testing.assert_close(
        attention(q, k, v, seqs, "sdpa", sinks_H=sinks), by_the_formula(q, k, v, pos, None, sinks), atol=1e-12, rtol=0
    )
    torch.testing.assert_close(
        attention(q, k, v, seqs, "sdpa", window=50), attention(q, k, v, seqs, "sdpa"), atol=1e-12, rtol=0
    )


# -- shared prompts: a document continues the first tokens of an earlier one -----------------

SHARED = {  # seq_lens, prefix_lens, parents of one row; the layout sdpa picks for it
    "padded": ([12, 5, 3, 6, 4, 7], [0, 9, 9, 0, 4, 4], [-1, 0, 0, -1, 3, 3]),
    "dense": ([28, 1, 1, 1, 1, 2, 3], [0, 0, 0, 0, 0, 20, 20], [-1, -1, -1, -1, -1, 0, 0]),  # short roots
}


def each_completion_after_its_prompt(q, k, v, lens, prefix, parents, window, sinks):
    """[1, T, H, K]: every document by the formula on its own, its shared prompt (its parent's
    first tokens) put back in front of it."""
    cu = [0, *torch.tensor(lens).cumsum(0).tolist()]
    out = torch.zeros_like(q)
    for s, (n, p, parent) in enumerate(zip(lens, prefix, parents)):
        idx = torch.tensor([*range(cu[parent], cu[parent] + p), *range(cu[s], cu[s + 1])])
        alone = by_the_formula(q[:, idx], k[:, idx], v[:, idx], torch.arange(len(idx))[None], window, sinks)
        out = out.index_copy(1, torch.arange(cu[s], cu[s + 1]), alone[:, p:])
    return out


@pytest.mark.parametrize("window, with_sinks", [(None, False), (4, True)], ids=["causal", "window+sinks"])
@pytest.mark.parametrize("layout", SHARED)
def test_a_shared_prompt_is_attended_as_if_each_completion_followed_it_alone(layout, window, with_sinks):
    """Documents that continue their parent's first P tokens (positions P, P + 1, ...) see those
    and their own, in both of sdpa's layouts: outputs and the gradients of q, k, v and the sinks
    (summed over the copies of the prompt) are the formula's on each completion after its
    prompt. A window counts positions across the prompt's end; the parent sees no completion."""
    lens, prefix, parents = SHARED[layout]
    t = sum(lens)
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, t, n, K, generator=g, dtype=torch.float64, requires_grad=True) for n in (H, G, G))
    sinks = (torch.randn(H, dtype=torch.float64, generator=g) * 2).requires_grad_() if with_sinks else None
    seqs = PackedSeqs.from_segments(lens, prefix, parents)
    assert seqs.branched and seqs.padded_cheaper() is (layout == "padded")
    got = attention(q, k, v, seqs, "sdpa", window=window, sinks_H=sinks)
    ref = each_completion_after_its_prompt(q, k, v, lens, prefix, parents, window, sinks)
    torch.testing.assert_close(got, ref, atol=1e-12, rtol=0)
    apart = attention(q, k, v, PackedSeqs.from_segments(lens, [0] * len(lens), [-1] * len(lens)), "sdpa")
    assert (got - apart).abs().max() > 1e-3  # the prompt mattered
    inputs = (q, k, v) + ((sinks,) if sinks is not None else ())
    up = torch.randn_like(ref)
    grads = torch.autograd.grad((got * up).sum(), inputs)
    ref_grads = torch.autograd.grad((ref * up).sum(), inputs)
    for name, a, e in zip(["q", "k", "v", "sinks"], grads, ref_grads):
        assert e.abs().max() > 1e-3, name
        torch.testing.assert_close(a, e, atol=1e-12, rtol=0, msg=lambda m, n=name: f"d{n}: {m}")


@pytest.mark.parametrize("window", [None, 4])
def test_flex_reads_shared_prompts_as_sdpa_does(window):
    """flex attention's block mask (built from the same mask_mod as sdpa's dense mask, which the
    test above checks) on a row with shared prompts: the same outputs. On CPU torch runs flex
    compiled, forward only and without sinks; GPUs run it in training (auto picks it there)."""
    lens, prefix, parents = SHARED["padded"]
    t = sum(lens)
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, t, n, K, generator=g) for n in (H, G, G))
    seqs = PackedSeqs.from_segments(lens, prefix, parents)
    with torch.no_grad():
        got = attention(q, k, v, seqs, "flex", window=window)
    torch.testing.assert_close(got, attention(q, k, v, seqs, "sdpa", window=window), atol=2e-6, rtol=0)
    assert window in seqs.block_masks


def test_a_shared_prompt_longer_than_its_parent_is_refused():
    """Bound exact: a prompt of all its parent's tokens is allowed, one token more is not (its
    copies would come from the next document)."""
    PackedSeqs.from_segments([4, 3, 2], [0, 4, 0], [-1, 0, -1])
    with pytest.raises(ValueError, match="document 1 shares the first 5 tokens of document 0, which has 4"):
        PackedSeqs.from_segments([4, 3, 2], [0, 5, 0], [-1, 0, -1])


def test_varlen_refuses_shared_prompts():
    seqs = PackedSeqs.from_segments(*SHARED["padded"])
    q = torch.zeros(1, seqs.doc_ids_BT.shape[1], H, K)
    with pytest.raises(ValueError, match="'varlen' cannot attend to a shared prompt"):
        attention(q, q[:, :, :G], q[:, :, :G], seqs, "varlen")
