"""Samples -> packed rows -> the same number of micro-batches on every data-parallel rank.

1. First-fit decreasing: samples, longest first, go into the first row with room (rows hold
   `seq_len` tokens). A segment tree over the rows' free space finds that row in O(log rows),
   so 10,000 samples pack in milliseconds. A sample is never split; one longer than a row is
   refused (the orchestrator's length filter should have dropped it).
2. Balancing: rows are dealt to ranks by estimated cost, most expensive first, each to the
   least-loaded rank that has room, so every rank gets ceil(rows / ranks) rows. Cost of a row
   = sum over its samples of (linear * n + quadratic * n^2): matmuls grow with tokens, causal
   attention with each document's length squared. Ranks left short get padding rows (one pad
   token, nothing trained), because every rank must run the same number of micro-batches.
3. `build_batches` turns the plan into primerl_protocol TrainBatch messages, one per rank.

Shared prompts (`shared_prompts`, the orchestrator's `share_prompts`): the samples of one
prompt (a GRPO group's 8-16 completions) are laid as that prompt once and each completion
after it, without its copy of the prompt (MicroBatch.prefix_lens / parents say which tokens
each one continues). A sample's prompt is its tokens before its first trained one (a
multi-turn sample's first prompt); samples share it only when those tokens are the same, token
for token (compared, never assumed from a group id), and it is never trained, so the loss and
its normalisation see the same trained tokens either way. A unit (the prompt and the
completions laid after it) is packed like one sample; one longer than a row is cut into several.

    plan = plan_packing([len(s) for s in samples], seq_len=8192, num_ranks=8,
                        shared=shared_prompts(samples, seq_len=8192))
    batches = build_batches(samples, plan, step=12)
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from primerl_algos.types import Sample


@dataclass
class PackingPlan:
    """Sample indices of each row of each rank: plan.ranks[rank][row] -> [sample index]."""

    ranks: list[list[list[int]]]
    seq_len: int
    prefixes: dict[int, tuple[int, int]] = field(default_factory=dict)
    """Sample index -> (the sample whose prompt it shares, the prompt's tokens), for the samples
    laid without their prompt, after that sample in the same row."""

    @property
    def rows_per_rank(self) -> int:
        return len(self.ranks[0]) if self.ranks else 0


@dataclass(frozen=True)
class SharedPrompt:
    """Samples laid as one unit: samples[0] whole, each other without its first `prompt` tokens,
    which are samples[0]'s (the same tokens, none of them trained)."""

    samples: list[int]
    prompt: int


def prompt_length(sample: Sample) -> int:
    """Tokens before the sample's first trained token (all of them when none is trained)."""
    mask = np.asarray(sample.loss_mask, np.bool_)
    return int(mask.argmax()) if mask.any() else len(mask)


def shared_prompts(samples: Sequence[Sample], seq_len: int) -> list[SharedPrompt]:
    """Units of samples whose prompts (prompt_length) are the same tokens, each at most `seq_len`
    tokens laid shared: a prompt's samples in order, a new unit begun when the next would not
    fit. Samples with images, without a trained token, or alone with their prompt are in none
    (packed whole)."""
    by_prompt: dict[bytes, list[int]] = defaultdict(list)
    for i, sample in enumerate(samples):
        n = prompt_length(sample)
        if 0 < n < len(sample) and not sample.images and len(sample) <= seq_len:
            # the key is the tokens themselves: equal keys are equal prompts, token for token
            by_prompt[np.asarray(sample.token_ids[:n], np.int64).tobytes()].append(i)
    units: list[SharedPrompt] = []
    for members in by_prompt.values():
        prompt = prompt_length(samples[members[0]])
        unit, used = [members[0]], len(samples[members[0]])
        for i in members[1:]:
            if used + len(samples[i]) - prompt <= seq_len:
                unit.append(i)
                used += len(samples[i]) - prompt
                continue
            if len(unit) > 1:
                units.append(SharedPrompt(unit, prompt))
            unit, used = [i], len(samples[i])
        if len(unit) > 1:
            units.append(SharedPrompt(unit, prompt))
    return units


def _refuse_too_long(lengths: Sequence[int], capacity: int) -> None:
    too_long = [i for i, length in enumerate(lengths) if length > capacity]
    if too_long:
        i = too_long[0]
        raise ValueError(
            f"sample {i} has {lengths[i]} tokens, more than a row's {capacity} "
            f"({len(too_long)} such samples); filter them out before packing"
        )


def first_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Rows (lists of sample indices) holding every sample once, each row <= capacity."""
    n = len(lengths)
    if n == 0:
        return []
    _refuse_too_long(lengths, capacity)
    size = 1
    while size < n:
        size *= 2
    # free[size + j] = free space of row j (rows not opened yet have all of it); inner nodes
    # hold the max of their children.
    free = [capacity] * (2 * size)
    rows: list[list[int]] = []
    for i in sorted(range(n), key=lambda k: -lengths[k]):
        need = lengths[i]
        node = 1
        while node < size:  # descend to the leftmost row with room
            node = 2 * node if free[2 * node] >= need else 2 * node + 1
        row = node - size
        if row == len(rows):
            rows.append([])
        rows[row].append(i)
        free[node] -= need
        node //= 2
        while node:
            free[node] = max(free[2 * node], free[2 * node + 1])
            node //= 2
    return rows


def row_cost(lengths: Sequence[int], linear: float = 1.0, quadratic: float = 1e-4) -> float:
    return sum(linear * n + quadratic * n * n for n in lengths)


def plan_packing(
    lengths: Sequence[int],
    seq_len: int,
    num_ranks: int = 1,
    linear: float = 1.0,
    quadratic: float = 1e-4,
    shared: Sequence[SharedPrompt] = (),
) -> PackingPlan:
    """Pack, then deal the rows to `num_ranks` ranks, balanced by cost, equal in number. The
    samples of each `shared` unit are laid together, their prompt once."""
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
    _refuse_too_long(lengths, seq_len)
    prefixes = {i: (unit.samples[0], unit.prompt) for unit in shared for i in unit.samples[1:]}
    in_units = {i for unit in shared for i in unit.samples}
    units = [list(unit.samples) for unit in shared] + [[i] for i in range(len(lengths)) if i not in in_units]
    # a sample laid without its prompt: its own tokens, and attention from them to the prompt's
    own = [lengths[i] - prefixes[i][1] if i in prefixes else lengths[i] for i in range(len(lengths))]
    square = [lengths[i] ** 2 - prefixes[i][1] ** 2 if i in prefixes else lengths[i] ** 2 for i in range(len(lengths))]
    rows = [
        [i for u in row for i in units[u]]
        for row in first_fit_decreasing([sum(own[i] for i in u) for u in units], seq_len)
    ]
    per_rank = max(1, -(-len(rows) // num_ranks))
    costs = [sum(linear * own[i] + quadratic * square[i] for i in row) for row in rows]
    ranks: list[list[list[int]]] = [[] for _ in range(num_ranks)]
    heap = [(0.0, r) for r in range(num_ranks)]  # (load, rank) of ranks with room
    for j in sorted(range(len(rows)), key=lambda k: -costs[k]):
        load, r = heapq.heappop(heap)
        ranks[r].append(rows[j])
        if len(ranks[r]) < per_rank:
            heapq.heappush(heap, (load + costs[j], r))
    for rank_rows in ranks:
        rank_rows.extend([] for _ in range(per_rank - len(rank_rows)))  # padding rows
    return PackingPlan(ranks, seq_len, prefixes)


def build_micro_batch(
    samples: Sequence[Sample], pad_token_id: int = 0, prefix_lens: Sequence[int] = (), parents: Sequence[int] = ()
):
    """One packed row of `samples` (a padding row if empty) as a protocol MicroBatch. Sample j
    with prefix_lens[j] = P > 0 shares the first P tokens of the row's sample parents[j] and is
    laid without them (ValueError if they are not the same tokens, or are trained)."""
    from primerl_protocol import MicroBatch

    if not samples:
        one = np.ones(1, np.float32)
        return MicroBatch(
            input_ids=np.full(1, pad_token_id, np.int32),
            loss_mask=np.zeros(1, np.bool_),
            inference_logprobs=np.zeros(1, np.float32),
            advantages=np.zeros(1, np.float32),
            temperatures=one,
            seq_lens=np.ones(1, np.int32),
            sample_ids=np.full(1, -1, np.int64),
            policy_steps=np.zeros(1, np.int32),
        )
    prefix = np.zeros(len(samples), np.int32) if not len(prefix_lens) else np.asarray(prefix_lens, np.int32)
    parent = np.full(len(samples), -1, np.int32) if not len(parents) else np.asarray(parents, np.int32)
    ids = [np.asarray(s.token_ids, np.int32) for s in samples]
    mask = [np.asarray(s.loss_mask, np.bool_) for s in samples]
    for j in np.flatnonzero(prefix).tolist():
        n, p = int(prefix[j]), int(parent[j])
        if not (0 <= p < j and np.array_equal(ids[p][:n], ids[j][:n]) and not (mask[p][:n].any() or mask[j][:n].any())):
            raise ValueError(
                f"sample {samples[j].sample_id} does not share the first {n} tokens of row sample {p}: "
                "a shared prompt is an earlier sample's first tokens, the same and untrained in both"
            )
    lens = np.array([len(s) for s in samples], np.int32) - prefix
    logprobs = [np.asarray(s.inference_logprobs, np.float32) for s in samples]
    return MicroBatch(
        input_ids=np.concatenate([x[n:] for x, n in zip(ids, prefix)]),
        loss_mask=np.concatenate([x[n:] for x, n in zip(mask, prefix)]),
        inference_logprobs=np.concatenate([x[n:] for x, n in zip(logprobs, prefix)]),
        advantages=np.repeat(np.array([s.advantage for s in samples], np.float32), lens),
        temperatures=np.repeat(np.array([s.temperature for s in samples], np.float32), lens),
        seq_lens=lens,
        sample_ids=np.array([s.sample_id for s in samples], np.int64),
        policy_steps=np.array([s.policy_step for s in samples], np.int32),
        prefix_lens=prefix,
        parents=parent,
        **image_arrays([image for s in samples for image in s.images]),
    )


def image_arrays(images: Sequence) -> dict[str, np.ndarray]:
    """MicroBatch's image_sizes and image_pixels of `images` (primerl_protocol.images.Image;
    encoded ones are decoded here, so a dataset's pictures are held at their file size)."""
    return {
        "image_sizes": np.array([[i.height, i.width] for i in images], np.int32).reshape(-1, 2),
        "image_pixels": np.frombuffer(b"".join(i.pixels() for i in images), np.uint8),
    }


def build_batches(samples: Sequence[Sample], plan: PackingPlan, step: int, pad_token_id: int = 0) -> list:
    """One primerl_protocol TrainBatch per rank, following `plan`."""
    from primerl_protocol import TrainBatch

    num_loss_tokens = sum(sum(s.loss_mask) for s in samples)
    return [
        TrainBatch(
            step=step,
            rank=r,
            num_ranks=len(plan.ranks),
            micro_batches=[_row(samples, row, plan, pad_token_id) for row in rows],
            num_loss_tokens=num_loss_tokens,
            num_sequences=len(samples),
        )
        for r, rows in enumerate(plan.ranks)
    ]


def _row(samples: Sequence[Sample], row: list[int], plan: PackingPlan, pad_token_id: int):
    """The MicroBatch of one planned row: its samples, each shared prompt once."""
    if not plan.prefixes:
        return build_micro_batch([samples[i] for i in row], pad_token_id)
    at = {i: j for j, i in enumerate(row)}
    shared = [plan.prefixes.get(i) for i in row]
    return build_micro_batch(
        [samples[i] for i in row],
        pad_token_id,
        prefix_lens=[0 if x is None else x[1] for x in shared],
        parents=[-1 if x is None else at[x[0]] for x in shared],
    )
