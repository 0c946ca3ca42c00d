"""The full RL trainer step on GPUs: FSDP2, packed rows, the RL loss, AdamW, and publishing.

Run under torchrun, once per GPU count; per-GPU work is the same at every count (weak
scaling), so tokens/s per GPU at N GPUs over that at 1 GPU is the scaling efficiency.

    torchrun --nproc-per-node 1 bench/trainer_step.py --model qwen3-1.7b
    torchrun --nproc-per-node 1 bench/trainer_step.py --model qwen3-1.7b --fp8   # trainer.precision = "fp8"
    torchrun --nproc-per-node 2 bench/trainer_step.py --model qwen3-1.7b
    torchrun --nproc-per-node 8 bench/trainer_step.py --model qwen3-30b-a3b --ep 8 --cp 2 --seq 65536 --ac

With --cp, the ranks of a context-parallel group share their rows (each runs its chunk of
every row of the group): tokens/s per GPU counts each row's tokens once over the group.

Uses primerl_trainer's own pieces (parallelize, optimizer, the RL loss through the model's
chunked logprob path, FolderPublisher); random weights, random tokens, 16,384-token rows of
8 documents each.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from model_step import hf_dict, our_args  # noqa: E402  (shapes shared with the model benchmark)
from primerl_algos.config import LossConfig
from primerl_algos.losses import LossScale
from primerl_models import Transformer
from primerl_protocol import MicroBatch
from primerl_trainer.config import OptimizerConfig, ParallelConfig
from primerl_trainer.distributed import all_reduce_sum, init_distributed, shutdown
from primerl_trainer.engine import peak_flops, train_flops
from primerl_trainer.optim import build_optimizer, clip_grad_norm
from primerl_trainer.placement import build_mesh, check_fits, parallelize
from primerl_trainer.precision import check_fp8_device, convert_to_fp8
from primerl_trainer.publish import FolderPublisher
from primerl_trainer.rl import rl_loss


def row(vocab: int, seq: int, docs: int, seed: int) -> MicroBatch:
    rng = np.random.default_rng(seed)
    lens = np.full(docs, seq // docs, np.int32)
    mask = np.ones(seq, bool)
    mask[np.cumsum(lens) - lens] = False  # each document's first token is context
    return MicroBatch(
        input_ids=rng.integers(0, vocab, seq, dtype=np.int32),
        loss_mask=mask,
        inference_logprobs=np.full(seq, -11.0, np.float32),
        advantages=rng.standard_normal(seq).astype(np.float32),
        temperatures=np.ones(seq, np.float32),
        seq_lens=lens,
        sample_ids=np.arange(docs, dtype=np.int64),
        policy_steps=np.zeros(docs, np.int32),
    )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen3-1.7b")
    p.add_argument("--seq", type=int, default=16384)
    p.add_argument("--docs", type=int, default=8)
    p.add_argument("--rows", type=int, default=2, help="micro-batches per GPU per step")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--ac", action="store_true")
    p.add_argument("--fp8", action="store_true", help='trainer.precision = "fp8": FP8 projections (precision.py)')
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default: the shape's)")
    p.add_argument("--ep", type=int, default=1, help="expert parallelism (trainer.parallel.ep)")
    p.add_argument("--cp", type=int, default=1, help="context parallelism (trainer.parallel.cp)")
    p.add_argument(
        "--no-loss-in-forward",
        action="store_true",
        help="the loss's gradients through the logprobs' backward (trainer.loss_in_forward = false)",
    )
    p.add_argument("--publish-dir", default=None)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    d = init_distributed()
    args = our_args(a.model, a.layers)
    mesh = build_mesh(ParallelConfig(ep=a.ep, cp=a.cp), d)
    check_fits(args, mesh.ep, mesh.cp)
    with torch.device("meta"):
        model = Transformer(args)
    if a.fp8:  # as placement.load_for_training does, before compile and FSDP2
        check_fp8_device(d.device)
        convert_to_fp8(model)
    parallelize(model, d.device, mesh, activation_checkpointing=a.ac, compile_layers=True, bf16=True)
    model.to_empty(device=d.device)
    model.init_weights()
    opt = build_optimizer(model, OptimizerConfig(lr=1e-6), d.device)
    # this rank's rows, and with CP its group's (each rank runs its chunk of all of them)
    rows = mesh.group_rows([row(args.vocab_size, a.seq, a.docs, seed=d.rank * 100 + i) for i in range(a.rows)])
    loss_tokens = int(sum(mb.loss_mask.sum() for mb in rows)) * mesh.dp
    loss_fn = rl_loss(
        LossConfig(type="aipo"),
        LossScale(tokens=loss_tokens, sequences=a.docs * len(rows) * mesh.dp),
        d.device,
        mesh.cp_group,
        in_forward=not a.no_loss_in_forward,
    )
    flops = sum(train_flops(args, mb.seq_lens) for mb in rows) / mesh.cp  # this rank's share
    times = []
    for i in range(a.steps + 2):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        if i == 2:
            torch.cuda.reset_peak_memory_stats()
        for mb in rows:
            loss, _ = loss_fn(model, mb)
            loss.backward()  # FSDP2 sums the gradients over ranks (placement.py)
        clip_grad_norm(model, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    tokens_per_gpu = len(rows) * a.seq / step_s / mesh.cp
    mfu = flops / step_s / peak_flops(d.device)
    publish_s = None
    if a.publish_dir:
        hf = hf_dict(a.model, a.layers)
        pub = FolderPublisher(a.publish_dir, Path(tempfile.mkdtemp()), hf, keep=1, dtype=torch.bfloat16, d=d)
        pub.publish(model, 0)  # warm-up (allocations, first write)
        t0 = time.perf_counter()
        pub.publish(model, 1)
        publish_s = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() / 2**30
    tokens_per_gpu, mfu, peak = (v / d.world_size for v in all_reduce_sum([tokens_per_gpu, mfu, peak], d))
    if d.is_main:
        result = {
            "model": a.model,
            "layers": args.num_layers,
            "gpus": d.world_size,
            **mesh.layout,
            "seq": a.seq,
            "docs": a.docs,
            "rows_per_gpu": a.rows,
            "ac": a.ac,
            "precision": "fp8" if a.fp8 else "bf16",
            "loss_in_forward": not a.no_loss_in_forward,
            "s_per_step": step_s,
            "tokens_per_s_per_gpu": tokens_per_gpu,
            "mfu": mfu,
            "peak_gib": peak,
            "publish_s": publish_s,
            "publish_phases_s": pub.last_timing if a.publish_dir else None,
        }
        print(json.dumps(result))
        if a.out:
            Path(a.out).write_text(json.dumps(result))
    shutdown()


if __name__ == "__main__":
    main()
