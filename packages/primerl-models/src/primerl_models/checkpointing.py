"""Activation checkpointing at decoder-layer granularity, applied from outside the model.

    apply_activation_checkpointing(model)          # every layer
    apply_activation_checkpointing(model, every=2) # every other layer

Each chosen layer's forward is wrapped in `torch.utils.checkpoint` (non-reentrant): its
activations are recomputed in the backward pass instead of being kept. Parameter names do not
change (no wrapper module), so checkpoints, HF conversion and FSDP2 see the same model.
Apply it before torch.compile and FSDP (the order torchtitan uses).
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from primerl_models.common.transformer import Transformer


def apply_activation_checkpointing(model: Transformer, every: int = 1) -> int:
    """Checkpoint every `every`-th decoder layer; returns how many layers were wrapped."""
    if every < 1:
        raise ValueError(f"every must be >= 1, got {every}")
    wrapped = 0
    for i, layer in enumerate(model.layers):
        if i % every or getattr(layer, "_primerl_checkpointed", False):
            continue
        inner = layer.forward

        def forward(*args, _inner=inner, **kwargs):
            if not torch.is_grad_enabled():
                return _inner(*args, **kwargs)
            return checkpoint(_inner, *args, use_reentrant=False, **kwargs)

        layer.forward = forward
        layer._primerl_checkpointed = True
        wrapped += 1
    return wrapped
