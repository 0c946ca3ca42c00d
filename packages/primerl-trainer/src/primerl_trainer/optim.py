"""AdamW, the learning-rate schedule and gradient clipping."""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor

from primerl_trainer.config import OptimizerConfig, SchedulerConfig


def build_optimizer(model: torch.nn.Module, cfg: OptimizerConfig, device: torch.device) -> torch.optim.AdamW:
    # Fused AdamW on GPUs (one kernel for all parameters); foreach elsewhere.
    fused = device.type == "cuda" and not cfg.cpu_offload
    # only what trains (with LoRA: the adapters; frozen weights keep no optimizer state)
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay, fused=fused)


def lr_factor(step: int, cfg: SchedulerConfig, max_steps: int | None) -> float:
    """Multiplier of the peak learning rate at optimizer step `step` (0-based).

    Warm-up rises linearly from 1/(warmup+1) to 1 over `warmup_steps`; then constant, or a
    linear / cosine decay to `min_lr_ratio` at `max_steps`.
    """
    if step < cfg.warmup_steps:
        return (step + 1) / (cfg.warmup_steps + 1)
    if cfg.type == "constant" or not max_steps:
        return 1.0
    span = max(1, max_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    if cfg.type == "linear":
        decay = 1.0 - progress
    else:  # cosine
        decay = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * decay


def build_scheduler(opt: torch.optim.Optimizer, cfg: SchedulerConfig, max_steps: int | None):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: lr_factor(step, cfg, max_steps))


def apply_settings(opt: torch.optim.Optimizer, sched, cfg: OptimizerConfig) -> list[str]:
    """After a resume, make the configured optimizer settings the ones in force. A loaded
    optimizer and LambdaLR carry the values they were saved with (`lr`, `weight_decay`, `betas`
    in the param groups, the peak lr in `base_lrs`): without this a resume with a new lr would
    go on with the old one. The lr becomes the new peak times the schedule's factor at the
    resumed step. Returns what changed, e.g. ["lr 0.001 -> 0.0005"]."""
    group = opt.param_groups[0]
    saved = {"lr": sched.base_lrs[0], "weight_decay": group["weight_decay"], "betas": tuple(group["betas"])}
    wanted = {"lr": cfg.lr, "weight_decay": cfg.weight_decay, "betas": tuple(cfg.betas)}
    changed = [f"{key} {saved[key]} -> {value}" for key, value in wanted.items() if saved[key] != value]
    sched.base_lrs = [cfg.lr] * len(opt.param_groups)
    lrs = [cfg.lr * f(sched.last_epoch) for f in sched.lr_lambdas]
    for group, lr in zip(opt.param_groups, lrs, strict=True):
        group.update(lr=lr, initial_lr=cfg.lr, weight_decay=cfg.weight_decay, betas=tuple(cfg.betas))
    sched._last_lr = lrs
    return changed


@torch.no_grad()
def clip_grad_norm(model: torch.nn.Module, max_norm: float) -> float:
    """Clip the global gradient norm (over all ranks' shards, the dense and the expert-parallel
    ones alike); returns the norm before clipping.

    Gradients sharded on different meshes (FSDP2 over all ranks; experts over their EP and
    replica ranks) cannot enter one norm: each mesh's norm is computed whole (`full_tensor`),
    then they are combined, and every gradient is scaled by the one clip factor."""
    by_mesh: dict = {}
    for p in model.parameters():
        if p.grad is not None:
            mesh = p.grad.device_mesh if isinstance(p.grad, DTensor) else None
            by_mesh.setdefault(mesh, []).append(p.grad)
    if not by_mesh:
        return 0.0
    norms = []
    for grads in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(grads)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    total = torch.linalg.vector_norm(torch.stack(norms))
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    local = [g.to_local() if isinstance(g, DTensor) else g for grads in by_mesh.values() for g in grads]
    # the op torch's clip_grad_norm_ uses; torch leaves its _foreach_ ops out of torch.__all__
    torch._foreach_mul_(local, coef.to(local[0].device))  # pyright: ignore[reportPrivateImportUsage]
    return float(total)
