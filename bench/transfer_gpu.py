"""The trainer's side of weights in memory on one GPU (issue 40's H200 figure): what
`primerl_trainer.transfer.MemorySender` does per layer group (gather, cast to bf16 on the
device, rename to HF's names and layouts, pack into one buffer) and the hand-off of each
layer's buffer, against today's folder publish of the same model, same run.

- folder: `FolderPublisher.publish` (gather, cast, copy to host, write safetensors, checksum).
- memory, host: per group pack on the GPU, one copy of the buffer to pinned host memory (what
  the gloo back-end sends from), checksum (xxh3-128) of it.
- memory, overlap (trainer.weights.overlap, the default): what holds up the training step, the
  whole update packed group by group into pinned host buffers kept from step to step
  (`transfer.pack_update`); the send and its checksum then run in a thread.
- memory, FP8: gather, cast, block-quantise every projection weight (128 x 128 blocks, what a
  block-FP8 checkpoint's servers read: `primerl_models.hf.quantize_fp8`), pack.
- memory, IPC: per group pack on the GPU and hand the buffer to a second process on the same
  GPU through CUDA IPC (torch.multiprocessing), which copies it into its own memory and answers
  (what a colocated receiver would do); the sender waits for that answer before the next group.

Models (random weights, fp32 master weights as the trainer holds them, one rank; vLLM is not
installed on the GPU machine, so no server loads them): Qwen3-1.7B and the Qwen3-30B-A3B
6-layer shape of bench/model_step.py. Medians of `--reps` rounds.

    python bench/transfer_gpu.py --models qwen3-1.7b,qwen3-30b-a3b-6l --reps 5 --out $OUT/transfer.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp
from model_step import hf_dict, our_args
from primerl_models import Transformer
from primerl_protocol import transfer
from primerl_trainer.distributed import Dist
from primerl_trainer.publish import FolderPublisher
from primerl_trainer.transfer import MemorySender


def receiver(inbox, outbox) -> None:
    """The colocated receiver: copies every buffer it is handed into its own GPU memory."""
    torch.cuda.set_device(0)
    while (item := inbox.get()) is not None:
        kept = item.clone()  # the receiver's own copy (a model's load_weights would copy likewise)
        torch.cuda.synchronize()
        outbox.put(kept.numel())
        del item, kept


def timed(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def bench(name: str, reps: int, root: Path) -> dict:
    d = Dist(rank=0, world_size=1, local_rank=0, device=torch.device("cuda"))
    args = our_args(name)
    with torch.device("cuda"):
        model = Transformer(args)
    model.init_weights()
    params = sum(p.numel() for p in model.parameters())
    hf = hf_dict(name)
    folder = FolderPublisher(root / name, root, hf, keep=1, dtype=torch.bfloat16, d=d)
    sender = MemorySender(model, hf, torch.bfloat16, d)
    names = [n for g in sender.groups(model) for n, _ in g]
    fp8_sender = MemorySender(
        model, hf, torch.bfloat16, d, fp8=((128, 128), {n for n in names if n.endswith("proj.weight")})
    )
    hosts: list = []
    ctx = mp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=receiver, args=(inbox, outbox), daemon=True)
    proc.start()
    pinned: dict[int, torch.Tensor] = {}

    def host_path():
        digest = transfer.new_checksum()
        for tensors in sender.groups(model):
            _, buffer = transfer.pack(tensors)
            host = pinned.get(buffer.numel())
            if host is None:
                host = pinned[buffer.numel()] = torch.empty(buffer.numel(), dtype=torch.uint8, pin_memory=True)
            host.copy_(buffer)
            digest.update(memoryview(host.numpy()))

    def ipc_path():
        for tensors in sender.groups(model):
            _, buffer = transfer.pack(tensors)
            torch.cuda.synchronize()
            inbox.put(buffer)
            outbox.get()

    def pack_only(s=sender):
        for tensors in s.groups(model):
            transfer.pack(tensors)

    def overlap_path():
        list(transfer.pack_update(0, sender.groups(model), hosts=hosts))

    runs = {
        "folder publish": lambda: folder.publish(model, 0),
        "memory: gather+cast+pack": pack_only,
        "memory: + to pinned host + checksum": host_path,
        "memory, overlap: what the step waits for": overlap_path,
        "memory, FP8 blocks: gather+cast+quant+pack": lambda: pack_only(fp8_sender),
        "memory: + CUDA IPC hand-off": ipc_path,
    }
    times = {k: [] for k in runs}
    with torch.no_grad():
        for k, fn in runs.items():  # warm-up (allocator, pinned buffers, the receiver's CUDA context)
            fn()
        for _ in range(reps):
            for k, fn in runs.items():
                times[k].append(timed(fn))
    inbox.put(None)
    proc.join(30)
    nbytes = sum(p.numel() * 2 for p in model.parameters())
    return {
        "model": name,
        "params": params,
        "bf16_gb": nbytes / 1e9,
        "median_s": {k: statistics.median(v) for k, v in times.items()},
        "all_s": times,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--models", default="qwen3-1.7b,qwen3-30b-a3b-6l")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="primerl-transfer-"))
    rows = [bench(name, a.reps, root) for name in a.models.split(",")]
    print(f"\ntrainer side of a weight update, one GPU, bf16 on the wire; median of {a.reps}")
    print(f"{'model':<18} {'params':>8} {'GB':>6} {'path':<44} {'s':>7} {'vs folder':>9}")
    for r in rows:
        base = r["median_s"]["folder publish"]
        for k, v in r["median_s"].items():
            print(
                f"{r['model']:<18} {r['params'] / 1e9:>7.2f}B {r['bf16_gb']:>6.2f} {k:<44} {v:>7.3f} {base / v:>8.1f}x"
            )
    if a.out:
        Path(a.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    mp.set_start_method("spawn", force=True)
    main()
