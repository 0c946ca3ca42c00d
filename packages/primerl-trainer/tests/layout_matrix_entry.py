"""Run by test_layout_matrix.py (and the fast test_layouts_fast.py) under torchrun on W ranks
(gloo, CPU, fp32): for each model folder and each layout (ep, cp) of W ranks, one RL step
(the RL trainer's loss, rl.rl_loss) and one SFT step (the SFT trainer's packing and loss,
sft.my_rows + sft.nll_loss) through the real trainer session (mesh, EP, CP, FSDP2, clipping
off, AdamW), on a fixed global batch that the ranks split between them. Each step's loss,
gradient norm and every full gradient (gathered in an optimizer pre-step hook, before
AdamW, whose update barely depends on a gradient's scale) are saved, beside one process
training a plain copy of the model (every expert, whole rows, no FSDP) on the whole batch.

    python -m torch.distributed.run --nproc-per-node W layout_matrix_entry.py OUT LAYOUTS FAMILY=FOLDER ...

LAYOUTS: "all" (every (ep, cp) that divides W) or a comma list such as "ep2,cp2,ep2cp2".
Writes OUT/rank_R.pt: {family: {"ref": ..., layout: {"rl": ..., "sft": ...}}} (gradients on rank 0).
"""

import os
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from primerl_algos.config import LossConfig
from primerl_algos.losses import LossScale
from primerl_algos.types import Sample
from primerl_models import load_model
from primerl_protocol import MicroBatch
from primerl_protocol.config import ModelConfig, TransportConfig, WandbConfig
from primerl_trainer.config import (
    CheckpointConfig,
    OptimizerConfig,
    ParallelConfig,
    SFTDataConfig,
    SFTRunConfig,
    TrainerConfig,
    TrainerRunConfig,
    WeightsConfig,
)
from primerl_trainer.engine import Session
from primerl_trainer.rl import rl_loss
from primerl_trainer.sft import my_rows, nll_loss
from torch.distributed.tensor import DTensor

ROWS = 4  # RL rows of the global batch: rank r of W trains rows r, r + W, ...
SFT_SAMPLES, SFT_ROW = 10, 48
LOSS = LossConfig()  # the default loss (aipo, token normalization), as users run it
OPTIM = OptimizerConfig(lr=1e-3, max_grad_norm=1e6)  # no clipping: the gradients are compared as computed


def layouts(world: int, spec: str) -> dict[str, tuple[int, int]]:
    """{name: (ep, cp)}: every pair dividing `world` for "all", else the named ones."""
    every = {
        f"ep{ep}cp{cp}": (ep, cp) for ep in (1, 2, 4, 8) for cp in (1, 2, 4, 8) if world % ep == 0 and world % cp == 0
    }
    if spec == "all":
        return every
    return {name: every[name] for name in spec.split(",")}


def rl_rows(vocab: int) -> list[MicroBatch]:
    """ROWS packed rows of 2-3 documents of odd lengths 7-23 (CP pads them), 3 prompt tokens
    each, advantages +-1, temperatures 0.7 / 1.0 / 1.3, inference logprobs near the model's."""
    rng = np.random.default_rng(7)
    rows = []
    for i in range(ROWS):
        lengths = (rng.integers(4, 12, rng.integers(2, 4)) * 2 + 1).tolist()
        n, mask = sum(lengths), np.concatenate([np.r_[np.zeros(3, bool), np.ones(m - 3, bool)] for m in lengths])
        rows.append(
            MicroBatch(
                input_ids=rng.integers(3, vocab, n, dtype=np.int32),
                loss_mask=mask,
                inference_logprobs=np.where(mask, -np.log(vocab) + rng.normal(0, 0.1, n), 0.0).astype(np.float32),
                advantages=np.repeat(rng.choice([-1.0, 1.0], len(lengths)), lengths).astype(np.float32),
                temperatures=np.repeat(np.array([0.7, 1.0, 1.3])[np.arange(len(lengths)) % 3], lengths).astype(
                    np.float32
                ),
                seq_lens=np.array(lengths, np.int32),
                sample_ids=np.arange(len(lengths), dtype=np.int64) + 10 * i,
                policy_steps=np.zeros(len(lengths), np.int32),
            )
        )
    return rows


def sft_samples(vocab: int) -> list[Sample]:
    rng = np.random.default_rng(11)
    samples = []
    for i in range(SFT_SAMPLES):
        n = int(rng.integers(7, 24))
        samples.append(
            Sample(
                sample_id=i,
                token_ids=rng.integers(3, vocab, n).tolist(),
                loss_mask=[False] * 3 + [True] * (n - 3),
                inference_logprobs=[0.0] * n,
            )
        )
    return samples


def rl_scale(rows: list[MicroBatch]) -> LossScale:
    return LossScale(tokens=sum(int(mb.loss_mask.sum()) for mb in rows), sequences=sum(len(mb.seq_lens) for mb in rows))


def reference(folder: Path, dtype: torch.dtype) -> dict:
    """One process, the plain model in `dtype`, the whole batch: each step's loss, gradient norm
    and gradients, the loss's gradients through the logprobs' backward (the layouts compute them
    in the forward where the rows allow it: trainer.loss_in_forward's default)."""
    out = {}
    for job in ("rl", "sft"):
        model = load_model(folder, device="cpu").to(dtype)
        model.train()
        vocab = model.args.vocab_size
        if job == "rl":
            rows = rl_rows(vocab)
            loss_fn = rl_loss(LOSS, rl_scale(rows), torch.device("cpu"), in_forward=False)
        else:
            rows, tokens = my_rows(sft_samples(vocab), SFT_ROW, 0, 1)
            loss_fn = nll_loss(tokens, torch.device("cpu"), in_forward=False)
        total = 0.0
        for mb in rows:
            loss, _ = loss_fn(model, mb)
            loss.backward()
            total += float(loss)
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        out[job] = {
            "loss": total,
            "grad_norm": float(torch.nn.utils.get_total_norm(list(grads.values()))),
            "grads": grads,
        }
    return out


def capture_grads(s: Session, into: dict) -> None:
    """Each parameter's whole gradient, gathered when AdamW is about to step (a collective on
    every rank; kept on rank 0)."""

    def hook(_opt, _args, _kwargs):
        for name, p in s.model.named_parameters():
            if not p.requires_grad:  # frozen (GLM-5's indexer)
                continue
            g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            if s.d.rank == 0:
                into[name] = g.detach().clone()

    s.opt.register_step_pre_hook(hook)


def step(folder: Path, run_dir: Path, job: str, ep: int, cp: int) -> dict:
    common = dict(
        model=ModelConfig(name=str(folder)),
        seq_len=64,
        max_steps=1,
        run_dir=str(run_dir),
        transport=TransportConfig(trainer_ranks=dist.get_world_size()),
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
    if job == "rl":
        s = Session(TrainerRunConfig(**common), job="rl")
        rows = rl_rows(s.args.vocab_size)
        mine, loss_fn = rows[s.d.rank :: s.d.world_size], rl_loss(LOSS, rl_scale(rows), s.d.device, s.mesh.cp_group)
    else:
        s = Session(SFTRunConfig(**common, data=SFTDataConfig(path="unused")), job="sft")
        mine, tokens = my_rows(sft_samples(s.args.vocab_size), SFT_ROW, s.d.rank, s.d.world_size)
        loss_fn = nll_loss(tokens, s.d.device, s.mesh.cp_group)
    grads = {}
    capture_grads(s, grads)
    stats = s.train_step(mine, loss_fn)
    s.metrics.close()
    return {
        "loss": stats["loss"],
        "grad_norm": stats["grad_norm"],
        "grads": grads,
        "mesh": (s.mesh.dp, s.mesh.cp, s.mesh.ep),
    }


def main(out: Path, spec: str, models: dict[str, Path]) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {}
    for family, folder in models.items():
        row = {
            "ref": reference(folder, torch.float32) if rank == 0 else None,
            "ref64": reference(folder, torch.float64) if rank == 0 else None,
        }
        for name, (ep, cp) in layouts(world, spec).items():
            row[name] = {job: step(folder, out / f"{family}-{name}-{job}", job, ep, cp) for job in ("rl", "sft")}
        results[family] = row
    torch.save(results, out / f"rank_{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main(Path(sys.argv[1]), sys.argv[2], {k: Path(v) for k, v in (a.split("=", 1) for a in sys.argv[3:])})
