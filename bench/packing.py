"""Packing benchmark: first-fit decreasing + rank balancing vs one sample per row.

A long-tailed length mix (log-normal, median ~600 tokens, clipped to [16, seq_len]) as RL
rollouts have: mostly short, a few near the limit. Reported:
  - real fraction: real tokens / (rows x seq_len), i.e. counting every row padded to seq_len,
    which is what a fixed-shape trainer pays (varlen attention pays less);
  - time to plan 10,000 samples (the packing itself) and to build the protocol messages
    (copying the tokens into rows), on one core, median of `--reps`.

    uv run python bench/packing.py
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from primerl_algos.packing import build_batches, plan_packing
from primerl_algos.types import Sample


def lengths_mix(n: int, seq_len: int, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(mean=6.4, sigma=1.0, size=n), 16, seq_len).astype(int).tolist()


def median_seconds(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--reps", type=int, default=5)
    a = p.parse_args()
    seq = a.seq_len

    print(f"real-token fraction, 1,000 samples, rows of {seq} tokens padded to full length")
    print(f"{'method':<28} {'ranks':>5} {'rows':>6} {'real':>7}")
    lengths = lengths_mix(1000, seq)
    total = sum(lengths)
    print(f"{'one sample per row':<28} {1:>5} {len(lengths):>6} {total / (len(lengths) * seq):>7.1%}")
    for ranks in (1, 8):
        plan = plan_packing(lengths, seq, num_ranks=ranks)
        rows = plan.rows_per_rank * ranks
        print(f"{'first-fit decreasing':<28} {ranks:>5} {rows:>6} {total / (rows * seq):>7.1%}")

    big = lengths_mix(10_000, seq, seed=1)
    rng = np.random.default_rng(2)
    samples = [
        Sample(
            sample_id=i,
            token_ids=rng.integers(0, 150_000, n).tolist(),
            loss_mask=[True] * n,
            inference_logprobs=[-0.5] * n,
        )
        for i, n in enumerate(big)
    ]
    t_naive = median_seconds(lambda: [[i] for i in range(len(big))], a.reps)
    t_plan = median_seconds(lambda: plan_packing(big, seq, num_ranks=8), a.reps)
    plan = plan_packing(big, seq, num_ranks=8)
    t_build = median_seconds(lambda: build_batches(samples, plan, step=0), max(1, a.reps // 2))
    print(f"\n10,000 samples ({sum(big) / 1e6:.1f}M tokens), one core, median of {a.reps}")
    print(f"{'step':<44} {'ms':>8}")
    print(f"{'one sample per row (plan)':<44} {t_naive * 1e3:>8.1f}")
    print(f"{'first-fit decreasing + balance, 8 ranks (plan)':<44} {t_plan * 1e3:>8.1f}")
    print(f"{'building the TrainBatch messages':<44} {t_build * 1e3:>8.1f}")


if __name__ == "__main__":
    main()
