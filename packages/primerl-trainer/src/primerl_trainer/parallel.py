"""Apply parallelism to a primerl-models Transformer from outside, in torchtitan's order:
activation checkpointing, then torch.compile, then FSDP2 (each decoder layer, then the root).

Mixed precision: on GPUs the sharded parameters stay fp32 and are all-gathered as bf16
(`MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`); on CPUs everything is fp32.
With `cpu_offload`, parameters, gradients and optimizer state live in CPU memory
(FSDP2's CPUOffloadPolicy) and the optimizer step runs there.
"""

from __future__ import annotations

import torch
from primerl_models import Transformer
from primerl_models.checkpointing import apply_activation_checkpointing
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard


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
