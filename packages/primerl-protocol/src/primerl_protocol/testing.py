"""Builders of valid synthetic messages, for tests and benchmarks of any package."""

import socket

import numpy as np

from primerl_protocol import MicroBatch, TrainBatch


def micro_batch(seq_lens=(3, 5), seed=0) -> MicroBatch:
    rng = np.random.default_rng(seed)
    t = int(sum(seq_lens))
    return MicroBatch(
        input_ids=rng.integers(0, 1000, t, dtype=np.int32),
        loss_mask=rng.random(t) < 0.5,
        inference_logprobs=-rng.random(t, dtype=np.float32),
        advantages=rng.standard_normal(t, dtype=np.float32),
        temperatures=np.full(t, 0.7, np.float32),
        seq_lens=np.asarray(seq_lens, np.int32),
        sample_ids=np.arange(len(seq_lens), dtype=np.int64) + 100 * seed,
        policy_steps=np.full(len(seq_lens), 4, np.int32),
    )


def train_batch(num_micro_batches=2, step=5) -> TrainBatch:
    mbs = [micro_batch(seed=i) for i in range(num_micro_batches)]
    return TrainBatch(
        step=step,
        rank=0,
        num_ranks=1,
        micro_batches=mbs,
        num_loss_tokens=int(sum(mb.loss_mask.sum() for mb in mbs)),
        num_sequences=sum(len(mb.seq_lens) for mb in mbs),
    )


def assert_same_batch(a: TrainBatch, b: TrainBatch) -> None:
    assert (a.step, a.rank, a.num_ranks, a.num_loss_tokens, a.num_sequences) == (
        b.step,
        b.rank,
        b.num_ranks,
        b.num_loss_tokens,
        b.num_sequences,
    )
    assert len(a.micro_batches) == len(b.micro_batches)
    for x, y in zip(a.micro_batches, b.micro_batches):
        for name in x.__struct_fields__:
            xa, ya = getattr(x, name), getattr(y, name)
            assert xa.dtype == ya.dtype, name
            np.testing.assert_array_equal(xa, ya, err_msg=name)


def free_tcp_endpoint() -> str:
    """tcp://127.0.0.1:<a port that was free just now>."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"
