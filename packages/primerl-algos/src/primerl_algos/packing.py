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

    plan = plan_packing([len(s) for s in samples], seq_len=8192, num_ranks=8)
    batches = build_batches(samples, plan, step=12)
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from primerl_algos.types import Sample


@dataclass
class PackingPlan:
    """Sample indices of each row of each rank: plan.ranks[rank][row] -> [sample index]."""

    ranks: list[list[list[int]]]
    seq_len: int

    @property
    def rows_per_rank(self) -> int:
        return len(self.ranks[0]) if self.ranks else 0


def first_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Rows (lists of sample indices) holding every sample once, each row <= capacity."""
    n = len(lengths)
    if n == 0:
        return []
    too_long = [i for i, length in enumerate(lengths) if length > capacity]
    if too_long:
        i = too_long[0]
        raise ValueError(
            f"sample {i} has {lengths[i]} tokens, more than a row's {capacity} "
            f"({len(too_long)} such samples); filter them out before packing"
        )
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
) -> PackingPlan:
    """Pack, then deal the rows to `num_ranks` ranks, balanced by cost, equal in number."""
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
    rows = first_fit_decreasing(lengths, seq_len)
    per_rank = max(1, -(-len(rows) // num_ranks))
    costs = [row_cost([lengths[i] for i in row], linear, quadratic) for row in rows]
    ranks: list[list[list[int]]] = [[] for _ in range(num_ranks)]
    heap = [(0.0, r) for r in range(num_ranks)]  # (load, rank) of ranks with room
    for j in sorted(range(len(rows)), key=lambda k: -costs[k]):
        load, r = heapq.heappop(heap)
        ranks[r].append(rows[j])
        if len(ranks[r]) < per_rank:
            heapq.heappush(heap, (load + costs[j], r))
    for rank_rows in ranks:
        rank_rows.extend([] for _ in range(per_rank - len(rank_rows)))  # padding rows
    return PackingPlan(ranks, seq_len)


def build_micro_batch(samples: Sequence[Sample], pad_token_id: int = 0):
    """One packed row of `samples` (a padding row if empty) as a protocol MicroBatch."""
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
    lens = np.array([len(s) for s in samples], np.int32)
    return MicroBatch(
        input_ids=np.concatenate([np.asarray(s.token_ids, np.int32) for s in samples]),
        loss_mask=np.concatenate([np.asarray(s.loss_mask, np.bool_) for s in samples]),
        inference_logprobs=np.concatenate([np.asarray(s.inference_logprobs, np.float32) for s in samples]),
        advantages=np.repeat(np.array([s.advantage for s in samples], np.float32), lens),
        temperatures=np.repeat(np.array([s.temperature for s in samples], np.float32), lens),
        seq_lens=lens,
        sample_ids=np.array([s.sample_id for s in samples], np.int64),
        policy_steps=np.array([s.policy_step for s in samples], np.int32),
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
            micro_batches=[build_micro_batch([samples[i] for i in row], pad_token_id) for row in rows],
            num_loss_tokens=num_loss_tokens,
            num_sequences=len(samples),
        )
        for r, rows in enumerate(plan.ranks)
    ]
