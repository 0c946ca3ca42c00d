"""AdamW, the learning-rate schedule and gradient clipping."""

from __future__ import annotations

import math

import torch

from primerl_trainer.config import OptimizerConfig, SchedulerConfig


def build_optimizer(model: torch.nn.Module, cfg: OptimizerConfig, device: torch.device) -> torch.optim.AdamW:
    # Fused AdamW on GPUs (one kernel for all parameters); foreach elsewhere.
    fused = device.type == "cuda" and not cfg.cpu_offload
    return torch.optim.AdamW(
        model.parameters(), lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay, fused=fused
    )


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


def clip_grad_norm(model: torch.nn.Module, max_norm: float) -> float:
    """Clip the global gradient norm (over all ranks' shards); returns the norm before clipping."""
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    if hasattr(norm, "full_tensor"):  # a DTensor under FSDP2
        norm = norm.full_tensor()
    return float(norm)
