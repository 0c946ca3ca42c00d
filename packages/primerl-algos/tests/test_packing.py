"""Packing on constructed cases with known answers, and its invariants on random ones."""

import random
from collections import Counter

import numpy as np
import pytest
from primerl_algos.packing import (
    SharedPrompt,
    build_batches,
    build_micro_batch,
    first_fit_decreasing,
    plan_packing,
    row_cost,
    shared_prompts,
)
from primerl_algos.types import Sample


def reference_ffd(lengths, capacity):
    """First-fit decreasing, the plain O(n x rows) way."""
    rows, free = [], []
    for i in sorted(range(len(lengths)), key=lambda k: -lengths[k]):
        for j, f in enumerate(free):
            if f >= lengths[i]:
                rows[j].append(i)
                free[j] -= lengths[i]
                break
        else:
            rows.append([i])
            free.append(capacity - lengths[i])
    return rows


def test_ffd_by_hand():
    # sorted: 8(2) 7(4) 5(0) 3(1) 2(3) 1(5); rows of 10: [8,2] [7,3] [5,1]
    assert first_fit_decreasing([5, 3, 8, 2, 7, 1], 10) == [[2, 3], [4, 1], [0, 5]]


def test_ffd_matches_the_reference_and_keeps_every_sample_once():
    rng = random.Random(0)
    for trial in range(30):
        lengths = [rng.randint(1, 100) for _ in range(rng.randint(1, 300))]
        rows = first_fit_decreasing(lengths, 100)
        assert rows == reference_ffd(lengths, 100)
        assert sorted(i for row in rows for i in row) == list(range(len(lengths)))
        assert all(sum(lengths[i] for i in row) <= 100 for row in rows)


def test_sample_longer_than_a_row_is_refused():
    with pytest.raises(ValueError, match="sample 1 has 11 tokens, more than a row's 10"):
        first_fit_decreasing([3, 11], 10)


def test_every_rank_gets_the_same_number_of_rows_balanced_by_cost():
    lengths = [8, 8, 8, 4, 4, 2]
    plan = plan_packing(lengths, seq_len=8, num_ranks=4, quadratic=0.0)
    # rows: [8] [8] [8] [4,4] [2] -> 5 rows, 2 per rank, 3 padding rows
    assert plan.rows_per_rank == 2 and all(len(r) == 2 for r in plan.ranks)
    loads = sorted(sum(lengths[i] for row in rank for i in row) for rank in plan.ranks)
    assert loads == [8, 8, 8, 10]
    assert sum(row == [] for rank in plan.ranks for row in rank) == 3


def test_quadratic_cost_prefers_spreading_long_documents():
    # Two rows of equal tokens: one long document vs many short ones cost differently.
    assert row_cost([1000]) > row_cost([100] * 10)


def samples_of(lengths, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for i, n in enumerate(lengths):
        mask = [bool(b) for b in rng.random(n) < 0.5]
        out.append(
            Sample(
                sample_id=i,
                token_ids=rng.integers(0, 100, n).tolist(),
                loss_mask=mask,
                inference_logprobs=[-0.5 if m else 0.0 for m in mask],
                advantage=float(i),
                temperature=0.7,
            )
        )
    return out


def test_built_batches_hold_every_token_once_and_never_split_a_sample():
    lengths = [5, 9, 3, 12, 7, 1, 16, 2]
    samples = samples_of(lengths)
    plan = plan_packing(lengths, seq_len=16, num_ranks=2)
    batches = build_batches(samples, plan, step=3)
    assert [b.rank for b in batches] == [0, 1] and {len(b.micro_batches) for b in batches} == {plan.rows_per_rank}
    seen = Counter()
    for b in batches:
        assert b.num_loss_tokens == sum(sum(s.loss_mask) for s in samples)
        assert b.num_sequences == len(samples)
        for mb in b.micro_batches:
            assert mb.num_tokens <= 16
            start = 0
            for sid, n in zip(mb.sample_ids.tolist(), mb.seq_lens.tolist()):
                if sid == -1:  # padding row: nothing trained
                    assert not mb.loss_mask.any()
                    continue
                s = samples[sid]
                assert mb.input_ids[start : start + n].tolist() == s.token_ids  # whole, in order
                assert mb.loss_mask[start : start + n].tolist() == s.loss_mask
                assert np.all(mb.advantages[start : start + n] == s.advantage)
                assert np.allclose(mb.temperatures[start : start + n], 0.7)
                seen[sid] += 1
                start += n
    assert seen == Counter(range(len(samples)))


def test_empty_batch_gives_padding_rows_on_every_rank():
    plan = plan_packing([], seq_len=16, num_ranks=3)
    batches = build_batches([], plan, step=0)
    assert [len(b.micro_batches) for b in batches] == [1, 1, 1]


def test_a_rows_images_are_its_samples_images_in_order():
    from primerl_protocol.images import Image

    def image(value, h, w):
        return Image(height=h, width=w, rgb=bytes([value]) * (h * w * 3))

    with_two = Sample(
        sample_id=1,
        token_ids=[5, 6, 7],
        loss_mask=[False, False, True],
        inference_logprobs=[0.0] * 3,
        images=[image(1, 2, 3), image(2, 1, 1)],
    )
    plain = Sample(sample_id=2, token_ids=[8, 9], loss_mask=[False, True], inference_logprobs=[0.0] * 2)
    with_one = Sample(
        sample_id=3, token_ids=[4, 4], loss_mask=[False, True], inference_logprobs=[0.0] * 2, images=[image(3, 1, 2)]
    )
    mb = build_micro_batch([with_two, plain, with_one])
    assert mb.image_sizes.tolist() == [[2, 3], [1, 1], [1, 2]]
    assert [int(x[0, 0, 0]) for x in mb.images()] == [1, 2, 3]
    assert build_micro_batch([plain]).image_sizes.shape == (0, 2)


# -- shared prompts ----------------------------------------------------------------------------


def group(prompt, completions, first_id=0, advantage=1.0):
    """Samples of one prompt: its tokens untrained, each completion's trained."""
    return [
        Sample(
            sample_id=first_id + i,
            token_ids=list(prompt) + list(c),
            loss_mask=[False] * len(prompt) + [True] * len(c),
            inference_logprobs=[0.0] * len(prompt) + [-1.0 - i] * len(c),
            advantage=advantage + i,
        )
        for i, c in enumerate(completions)
    ]


def test_a_groups_samples_are_laid_as_their_prompt_once_then_each_completion():
    """Prompt + sum of completions in the row; each sample's tokens after the prompt, in order,
    with its own per-token data; the prompt laid once, in the first sample."""
    prompt = [7, 8, 9, 10, 11]
    samples = group(prompt, [[1, 2, 3], [4], [5, 6]]) + [
        Sample(sample_id=9, token_ids=[1, 2, 3], loss_mask=[False, True, True], inference_logprobs=[0.0, -1.0, -1.0])
    ]
    units = shared_prompts(samples, seq_len=64)
    assert units == [SharedPrompt([0, 1, 2], 5)]
    plan = plan_packing([len(s) for s in samples], 64, shared=units)
    assert plan.prefixes == {1: (0, 5), 2: (0, 5)}
    (batch,) = build_batches(samples, plan, step=0)
    (mb,) = batch.micro_batches
    assert mb.num_tokens == 5 + 3 + 1 + 2 + 3  # the prompt once, the completions, the unshared sample
    at = {sid: i for i, sid in enumerate(mb.sample_ids.tolist())}
    starts = mb.cu_seqlens()
    for sid, s in enumerate(samples[:3]):
        i = at[sid]
        lo, hi = starts[i], starts[i + 1]
        n = 0 if sid == 0 else 5
        assert (mb.prefix_lens[i], mb.parents[i]) == ((0, -1) if sid == 0 else (5, at[0]))
        assert mb.input_ids[lo:hi].tolist() == s.token_ids[n:]
        assert mb.loss_mask[lo:hi].tolist() == s.loss_mask[n:]
        assert mb.inference_logprobs[lo:hi].tolist() == s.inference_logprobs[n:]
        assert np.all(mb.advantages[lo:hi] == s.advantage)
        assert mb.position_ids()[lo:hi].tolist() == list(range(n, len(s)))
    assert (mb.prefix_lens[at[9]], mb.parents[at[9]]) == (0, -1)
    # the loss sees every trained token once, as unshared: same count, same normalisation
    assert int(mb.loss_mask.sum()) == batch.num_loss_tokens == sum(sum(s.loss_mask) for s in samples)
    assert batch.num_sequences == 4


def test_prompts_that_differ_by_one_token_are_not_shared():
    """The tokens decide, not which group the samples came from: a prompt with one token
    changed (here the last) shares nothing with the others; two equal ones share theirs."""
    samples = group([7, 8, 9], [[1], [2]]) + group([7, 8, 10], [[3]], first_id=2) + group([7, 8, 9], [[4]], first_id=3)
    assert shared_prompts(samples, seq_len=64) == [SharedPrompt([0, 1, 3], 3)]
    alike = group([7, 8, 9], [[1]]) + group([7, 8, 10], [[3]], first_id=1)
    assert shared_prompts(alike, seq_len=64) == []


def test_samples_without_a_trained_token_or_with_images_are_packed_whole():
    from primerl_protocol.images import Image

    samples = group([7, 8, 9], [[1], [2]])
    untrained = Sample(sample_id=5, token_ids=[7, 8, 9, 1], loss_mask=[False] * 4, inference_logprobs=[0.0] * 4)
    pictured = group([7, 8, 9], [[3]], first_id=6)[0]
    pictured.images = [Image(height=1, width=1, rgb=bytes(3))]
    assert shared_prompts([*samples, untrained, pictured], seq_len=64) == [SharedPrompt([0, 1], 3)]


def test_a_prompts_completions_longer_than_a_row_are_cut_into_units_that_fit():
    """A prompt of 6 and four completions of 4 (22 shared) in rows of 16: units of the prompt
    and two completions (6 + 4 + 4 = 14), each row's tokens within the row."""
    samples = group(range(20, 26), [[1] * 4] * 4)
    units = shared_prompts(samples, seq_len=16)
    assert units == [SharedPrompt([0, 1], 6), SharedPrompt([2, 3], 6)]
    plan = plan_packing([len(s) for s in samples], 16, num_ranks=2, shared=units)
    batches = build_batches(samples, plan, step=0)
    assert [mb.num_tokens for b in batches for mb in b.micro_batches] == [14, 14]


def test_a_shared_prompt_that_is_not_the_same_tokens_is_refused_when_the_row_is_built():
    samples = group([7, 8, 9], [[1], [2]]) + group([7, 6, 9], [[3]], first_id=2)
    with pytest.raises(ValueError, match="sample 2 does not share the first 3 tokens of row sample 0"):
        build_micro_batch([samples[0], samples[2]], prefix_lens=[0, 3], parents=[-1, 0])
