"""Run by test_parallel_layouts.py under torchrun on 4 ranks (gloo, CPU, fp32): the real trainer
session (mesh, EP, CP, FSDP2, clipping, AdamW) at several layouts, 3 optimizer steps on the
same packed batch each, against one process that trains a plain copy of the model (every
expert, whole rows, no FSDP) on all 4 ranks' rows; then resumes across layouts. Writes
OUT/rank_R.pt: the losses of every run, and (rank 0) the updated weights and the reference's.

    python -m torch.distributed.run --nproc-per-node 4 parallel_layouts_entry.py OUT FAMILY=FOLDER ...
"""

import os
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from primerl_algos.config import LossConfig
from primerl_algos.losses import LossScale
from primerl_models import load_model
from primerl_protocol import MicroBatch
from primerl_protocol.config import ModelConfig, TransportConfig, WandbConfig
from primerl_trainer.config import (
    CheckpointConfig,
    OptimizerConfig,
    ParallelConfig,
    TrainerConfig,
    TrainerRunConfig,
    WeightsConfig,
)
from primerl_trainer.engine import Session
from primerl_trainer.rl import rl_loss

WORLD, STEPS = 4, 3
LAYOUTS = {"ep2": (2, 1), "cp2": (1, 2), "ep2_cp2": (2, 2), "cp4": (1, 4)}  # (ep, cp)
LOSS = LossConfig(normalization="sequence")  # per-sequence sums: documents crossing the CP split
# Clipping is active. AdamW divides each update by the gradient's running size, so a gradient
# near zero turns its rounding into a large update: a small lr keeps that below 1e-5.
OPTIM = OptimizerConfig(lr=2e-4, weight_decay=0.01, max_grad_norm=0.5)


def micro_batch(seed: int, lengths: list[int], vocab: int) -> MicroBatch:
    """One packed row of documents of `lengths` (odd totals: CP pads them), 3 prompt tokens
    each, advantages +-1, temperatures 0.7 / 1.0 / 1.3, inference logprobs near the model's."""
    rng = np.random.default_rng(seed)
    n = sum(lengths)
    mask = np.concatenate([np.r_[np.zeros(3, bool), np.ones(m - 3, bool)] for m in lengths])
    return MicroBatch(
        input_ids=rng.integers(3, vocab, n, dtype=np.int32),
        loss_mask=mask,
        inference_logprobs=np.where(mask, -np.log(vocab) + rng.normal(0, 0.1, n), 0.0).astype(np.float32),
        advantages=np.repeat(rng.choice([-1.0, 1.0], len(lengths)), lengths).astype(np.float32),
        temperatures=np.repeat(np.array([0.7, 1.0, 1.3])[np.arange(len(lengths)) % 3], lengths).astype(np.float32),
        seq_lens=np.array(lengths, np.int32),
        sample_ids=np.arange(len(lengths), dtype=np.int64) + 10 * seed,
        policy_steps=np.zeros(len(lengths), np.int32),
    )


def batches(vocab: int) -> list[list[MicroBatch]]:
    """2 rows per rank, each of 2-3 documents of 7-23 tokens."""
    rng = np.random.default_rng(7)
    return [
        [micro_batch(10 * r + i, rng.integers(7, 24, rng.integers(2, 4)).tolist(), vocab) for i in range(2)]
        for r in range(WORLD)
    ]


def scale_of(rows: list[list[MicroBatch]]) -> LossScale:
    return LossScale(
        tokens=sum(int(mb.loss_mask.sum()) for r in rows for mb in r),
        sequences=sum(len(mb.seq_lens) for r in rows for mb in r),
    )


def reference(folder: Path, rows: list[list[MicroBatch]]) -> dict:
    """One process, the whole model, every rank's rows: losses and the weights after STEPS."""
    model = load_model(folder, device="cpu")
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=OPTIM.lr, betas=OPTIM.betas, weight_decay=OPTIM.weight_decay)
    # the loss's gradients through the logprobs' backward (not in the forward, which the layouts
    # run by default where the rows allow it: trainer.loss_in_forward)
    loss_fn = rl_loss(LOSS, scale_of(rows), torch.device("cpu"), in_forward=False)
    losses, norms = [], []
    for _ in range(STEPS):
        total = 0.0
        for mb in (mb for r in rows for mb in r):
            loss, _ = loss_fn(model, mb)
            loss.backward()
            total += float(loss)
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), OPTIM.max_grad_norm)))
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return {
        "losses": losses,
        "grad_norms": norms,
        "weights": {k: v.detach().clone() for k, v in model.state_dict().items()},
    }


def session(folder: Path, run_dir: Path, ep: int, cp: int) -> Session:
    cfg = TrainerRunConfig(
        model=ModelConfig(name=str(folder)),
        seq_len=128,
        max_steps=STEPS,
        run_dir=str(run_dir),
        transport=TransportConfig(trainer_ranks=WORLD),
        wandb=WandbConfig(mode="disabled"),
        trainer=TrainerConfig(
            dtype="float32",
            optimizer=OPTIM,
            loss=LOSS,
            checkpoint=CheckpointConfig(interval=0),
            weights=WeightsConfig(dtype="float32"),
            parallel=ParallelConfig(ep=ep, cp=cp),
        ),
    )
    return Session(cfg, job="rl")


def train(s: Session, rows: list[list[MicroBatch]], steps: range, norms: list | None = None) -> list[float]:
    losses = []
    for step in steps:
        stats = s.train_step(rows[s.d.rank], rl_loss(LOSS, scale_of(rows), s.d.device, s.mesh.cp_group))
        losses.append(stats["loss"])
        if norms is not None:
            norms.append(stats["grad_norm"])
        if step == 1:
            s.maybe_checkpoint(step, {"next_step": step + 1}, final=True)
    return losses


def main(out: Path, models: dict[str, Path]) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    results = {}
    for family, folder in models.items():
        rows = batches(load_model(folder, device="cpu").args.vocab_size)
        row = {
            "ref": reference(folder, rows) if rank == 0 else None,
            "checkpoint": load_model(folder, device="cpu").state_dict() if rank == 0 else None,
        }
        for name, (ep, cp) in LAYOUTS.items():
            s = session(folder, out / f"{family}-{name}", ep, cp)
            loaded = s.publisher.gather(s.model)  # before any step: what a publish would write
            norms = []
            losses = train(s, rows, range(STEPS), norms)
            weights = s.publisher.gather(s.model)  # full tensors on rank 0 (what publishing writes)
            row[name] = {
                "losses": losses,
                "grad_norms": norms,
                "weights": {k: v.float() for k, v in weights.items()},
                "loaded": loaded,
                "mesh": (s.mesh.dp, s.mesh.cp, s.mesh.ep),
            }
        results[family] = row
    # Resume across layouts: 2 steps at one layout (checkpointed), the 3rd at another.
    family, folder = next(iter(models.items()))
    rows = batches(load_model(folder, device="cpu").args.vocab_size)
    for first, then in (("ep2", "cp2"), ("cp2", "ep2_cp2")):
        run_dir = out / f"resume-{first}-{then}"
        s = session(folder, run_dir, *LAYOUTS[first])
        before = train(s, rows, range(2))
        s = session(folder, run_dir, *LAYOUTS[then])
        assert s.start_step == 2, s.start_step
        results[f"resume {first} -> {then}"] = before + train(s, rows, range(2, STEPS))
    torch.save(results, out / f"rank_{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main(Path(sys.argv[1]), {k: Path(v) for k, v in (a.split("=", 1) for a in sys.argv[2:])})
