"""Transport benchmark: a realistic trainer batch over ZeroMQ on loopback, primerl vs pickle.

One batch = 256 samples x 2,048 tokens packed into 64 rows of 8,192 tokens, with every array a
trainer needs (token ids, loss mask, inference logprobs, advantages, temperatures, sequence
boundaries, sample ids, policy steps). A primerl Receiver in a second process binds; a primerl
Sender PUSHes `--batches` batches over tcp://127.0.0.1 (the pickles travel over the very same
sockets, as one frame each); the clock runs from the first encode to
the receiver's last decode. Each way of sending is measured `--rounds` times, interleaved, and
the median is reported:

  primerl        primerl_protocol Encoder/Decoder: msgpack header + one raw frame per array
  pickle-numpy   pickle.dumps/loads of the same message (numpy arrays inside, protocol 5)
  pickle-lists   pickle of the batch as Python lists, what a batch looks like without arrays

    uv run python bench/transport.py [--batches 20] [--rounds 5]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import pickle
import statistics
import time

import numpy as np
from primerl_protocol import (
    BatchMessage,
    MicroBatch,
    Receiver,
    Sender,
    SocketSettings,
    TrainBatch,
)
from primerl_protocol.testing import free_tcp_endpoint

SAMPLES, SAMPLE_TOKENS, ROW_TOKENS = 256, 2048, 8192


def make_batch(seed: int = 0) -> TrainBatch:
    rng = np.random.default_rng(seed)
    per_row = ROW_TOKENS // SAMPLE_TOKENS
    rows = []
    for r in range(SAMPLES // per_row):
        t = ROW_TOKENS
        rows.append(
            MicroBatch(
                input_ids=rng.integers(0, 151_936, t, dtype=np.int32),
                loss_mask=rng.random(t) < 0.7,
                inference_logprobs=-rng.exponential(1.0, t).astype(np.float32),
                advantages=np.repeat(rng.standard_normal(per_row, dtype=np.float32), SAMPLE_TOKENS),
                temperatures=np.ones(t, np.float32),
                seq_lens=np.full(per_row, SAMPLE_TOKENS, np.int32),
                sample_ids=np.arange(r * per_row, (r + 1) * per_row, dtype=np.int64),
                policy_steps=np.zeros(per_row, np.int32),
            )
        )
    loss_tokens = int(sum(mb.loss_mask.sum() for mb in rows))
    return TrainBatch(
        step=0, rank=0, num_ranks=1, micro_batches=rows, num_loss_tokens=loss_tokens, num_sequences=SAMPLES
    )


def payload_bytes(batch: TrainBatch) -> int:
    return sum(getattr(mb, f).nbytes for mb in batch.micro_batches for f in mb.__struct_fields__)


def as_lists(batch: TrainBatch) -> dict:
    return {
        "step": batch.step,
        "micro_batches": [{f: getattr(mb, f).tolist() for f in mb.__struct_fields__} for mb in batch.micro_batches],
    }


def receiver(endpoint: str, mode: str, count: int, done: mp.Queue) -> None:
    rx = Receiver(endpoint, BatchMessage, channel="bench", bind=True)
    done.put("ready")
    tokens = 0
    for _ in range(count):
        if mode == "primerl":
            batch = rx.recv()
            tokens += sum(mb.num_tokens for mb in batch.micro_batches)
        else:  # the same socket, carrying a pickle
            obj = pickle.loads(rx.socket.recv(copy=False).buffer)
            rows = obj.micro_batches if mode == "pickle-numpy" else obj["micro_batches"]
            tokens += sum(len(mb.input_ids if mode == "pickle-numpy" else mb["input_ids"]) for mb in rows)
    done.put((time.time(), tokens))
    rx.close()


def run_once(mode: str, batch: TrainBatch, lists: dict, count: int) -> float:
    """Seconds from the first encode to the last decode of `count` batches."""
    endpoint = free_tcp_endpoint()
    done: mp.Queue = mp.get_context("spawn").Queue()
    proc = mp.get_context("spawn").Process(target=receiver, args=(endpoint, mode, count, done))
    proc.start()
    assert done.get(timeout=60) == "ready"
    tx = Sender(endpoint, BatchMessage, channel="bench", settings=SocketSettings(linger_ms=-1))
    start = time.time()
    for _ in range(count):
        if mode == "primerl":
            tx.send(batch)
        elif mode == "pickle-numpy":
            tx.socket.send(pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL), copy=False)
        else:
            tx.socket.send(pickle.dumps(lists, protocol=pickle.HIGHEST_PROTOCOL), copy=False)
    end, tokens = done.get(timeout=600)
    proc.join(60)
    tx.close()
    expected = count * SAMPLES * SAMPLE_TOKENS
    assert tokens == expected, f"{mode}: receiver saw {tokens} tokens, expected {expected}"
    return end - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=20, help="batches per measurement")
    parser.add_argument("--rounds", type=int, default=5, help="measurements per mode (median)")
    args = parser.parse_args()

    batch = make_batch()
    lists = as_lists(batch)
    size = payload_bytes(batch)
    modes = ["primerl", "pickle-numpy", "pickle-lists"]
    counts = {"primerl": args.batches, "pickle-numpy": args.batches, "pickle-lists": max(2, args.batches // 10)}
    times: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(args.rounds):  # interleaved, so machine noise hits every mode alike
        for mode in modes:
            times[mode].append(run_once(mode, batch, lists, counts[mode]) / counts[mode])

    per_batch = {m: statistics.median(t) for m, t in times.items()}
    print(
        f"batch: {SAMPLES} samples x {SAMPLE_TOKENS} tokens in {len(batch.micro_batches)} rows, "
        f"{size / 1e6:.1f} MB of arrays; {args.batches} batches x {args.rounds} rounds, median"
    )
    print(f"{'mode':<14} {'MB/s':>9} {'batches/s':>10} {'ms/batch':>9} {'primerl is':>11}")
    for mode in modes:
        s = per_batch[mode]
        ratio = s / per_batch["primerl"]
        print(f"{mode:<14} {size / s / 1e6:>9.0f} {1 / s:>10.1f} {s * 1e3:>9.2f} {ratio:>10.1f}x")


if __name__ == "__main__":
    main()
