"""Placing the model for training: loading it, then, in torchtitan's order, activation
checkpointing, torch.compile and FSDP2 (each decoder layer, then the root); expert and context
parallelism join them here. All of it is applied from outside primerl-models' code, which stays
plain modules.

    model, loaded = load_for_training(cfg, d)   # what the trainer does, from its config
    parallelize(model, device, activation_checkpointing=True, compile_layers=True)  # the steps

Activation checkpointing wraps each chosen decoder layer's forward in `torch.utils.checkpoint`
(non-reentrant): its activations are recomputed in the backward pass instead of being kept.
Parameter names do not change (no wrapper module), so checkpoints, HF conversion and FSDP2 see
the same model.

Mixed precision: on GPUs the sharded parameters stay fp32 and are all-gathered as bf16
(`MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`); on CPUs everything is fp32.
With `cpu_offload`, parameters, gradients and optimizer state live in CPU memory
(FSDP2's CPUOffloadPolicy) and the optimizer step runs there.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from primerl_models import Transformer, load_model, read_config, resolve_model_folder
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.utils.checkpoint import checkpoint

from primerl_trainer.config import SFTRunConfig, TrainerRunConfig
from primerl_trainer.distributed import Dist


@dataclass
class LoadedModel:
    folder: Path
    """The local HF folder the weights came from (its tokenizer files travel with published weights)."""
    hf_config: dict


def load_for_training(cfg: TrainerRunConfig | SFTRunConfig, d: Dist) -> tuple[Transformer, LoadedModel]:
    """Every rank loads the HF checkpoint (CPU), then FSDP2 shards it onto its device."""
    folder = resolve_model_folder(cfg.model.name, cfg.model.revision)
    tcfg = cfg.trainer
    model = load_model(folder, device="cpu", attn_backend=tcfg.attention)
    model.train()
    parallelize(
        model,
        d.device,
        activation_checkpointing=tcfg.activation_checkpointing,
        compile_layers=tcfg.compile,
        bf16=tcfg.dtype == "bfloat16",
        cpu_offload=tcfg.optimizer.cpu_offload,
    )
    return model, LoadedModel(folder, read_config(folder))


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


def parallelize(
    model: Transformer,
    device: torch.device,
    *,
    activation_checkpointing: bool = False,
    compile_layers: bool = False,
    bf16: bool = True,
    cpu_offload: bool = False,
) -> Transformer:
    if activation_checkpointing:
        apply_activation_checkpointing(model)
    if compile_layers:
        for layer in model.layers:
            layer.compile()
    use_bf16 = bf16 and device.type == "cuda"
    policy = dict(
        mp_policy=MixedPrecisionPolicy(
            param_dtype=torch.bfloat16 if use_bf16 else torch.float32, reduce_dtype=torch.float32
        ),
    )
    if cpu_offload:
        policy["offload_policy"] = CPUOffloadPolicy()
    for layer in model.layers:
        fully_shard(layer, **policy)
    fully_shard(model, **policy)
    return model
