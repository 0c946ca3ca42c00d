"""FP8 training of the decoder layers' linear projections (`trainer.precision = "fp8"`), through
torchao's float8 training (`torchao.float8`), applied from outside primerl-models' code like the
rest of placement.py's steps, before activation checkpointing, compile and FSDP2.

Each chosen `nn.Linear` becomes torchao's `Float8Linear` in place: its three matmuls (output,
input gradient, weight gradient) run as `torch._scaled_mm` on e4m3 operands with one scale per
row (the "rowwise" recipe: scales rounded to powers of two, fast accumulation for the output
only), the casts computed from the bf16 activations and the bf16 weights FSDP2 gathered. Under
`torch.compile` (trainer.compile) the amax and cast fuse into the op before each matmul, which is
where the speed-up comes from (../shared/FACTS.md: row-wise FP8 GEMMs 1.40-1.65x bf16 on an
H200, 1.08-1.20x with the cast as a separate op). Nothing else changes: the master weights stay
fp32 parameters of the same names and shapes (a `Float8Linear` keeps `weight` and `bias` as plain
parameters), so checkpoints, the optimizer and weight publishing see the model they saw before.

What is converted: every plain `nn.Linear` inside the decoder layers (attention q/k/v/o and gate,
MLA's projections, the linear-attention and Mamba2 in/out projections, dense and shared-expert
MLPs, latent-MoE projections) whose two sizes are multiples of 16 (the FP8 GEMM's rule), except
those in SKIPPED. What is not: embeddings, the lm_head (outside the layers), norms, routers (not
`nn.Linear`), the routed experts (parameters multiplied by `torch._grouped_mm`; torchao's FP8
grouped GEMM is a prototype, `torchao.prototype.moe_training`), the vision tower.

    check_fp8_device(device)        # ValueError naming trainer.precision: CPU, or CUDA < 8.9
    names = convert_to_fp8(model)   # the converted layers' names

torchao is imported here only: a bf16 run never loads it.
"""

from __future__ import annotations

import torch
from torch import nn

RECIPES = ("rowwise", "rowwise_with_gw_hp", "tensorwise")
"""torchao's recipes: "rowwise" (all three matmuls FP8, a scale per row; trainer.precision =
"fp8"), "rowwise_with_gw_hp" (the weight gradient in bf16: more accurate, a third of the FP8 GEMMs
fewer; bench/fp8_mismatch.py compares them) and "tensorwise" (one scale per tensor: the fewest
amax reductions, coarser; bench/model_step.py's `:fp8tw` measures it)."""

SKIPPED = {
    "in_proj_a": "Gated DeltaNet's per-head decay gate (a few outputs, exponentiated)",
    "in_proj_b": "Gated DeltaNet's per-head beta gate (a few outputs)",
    "shared_expert_gate": "one output per token",
    "kv_b_proj": "MLA's sparse path reads its weight directly (absorbed into the queries)",
}
"""Layers left in bf16 by the last part of their name, with why."""

SKIPPED_UNDER = (".indexer.",)
"""Sub-blocks left alone whole: DSA's indexer is frozen and scored by its own kernel (blocks/mla.py)."""

FP8_MIN_CAPABILITY = (8, 9)
"""FP8 tensor cores: Ada (8.9), Hopper (9.0), Blackwell (10.0) and newer."""


def check_fp8_device(device: torch.device) -> None:
    """ValueError naming trainer.precision unless `device` is a GPU with FP8 matmuls."""
    if device.type != "cuda":
        raise ValueError(
            f'trainer.precision = "fp8" needs a GPU with FP8 matmuls (CUDA compute capability 8.9 or newer: '
            f'Ada, Hopper, Blackwell), but this trainer runs on {device.type}; use trainer.precision = "bf16"'
        )
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < FP8_MIN_CAPABILITY:
        raise ValueError(
            f'trainer.precision = "fp8" needs a GPU with FP8 matmuls (CUDA compute capability 8.9 or newer), but '
            f'{torch.cuda.get_device_name(device)} has {major}.{minor}; use trainer.precision = "bf16"'
        )


def fp8_eligible(module: nn.Module, name: str, large_only: bool = False) -> bool:
    """Whether the layer `name` of a Transformer runs in FP8 (the module docstring's rule).
    `large_only`: also leave out the layers torchao measured as no faster in row-wise FP8 on an
    H100 (out <= 2048, in <= 1024, or both out <= 4096 and in <= 2048; torchao's float8 README,
    "rowwise scaling"), for benchmarks to compare."""
    if type(module) is not nn.Linear or not name.startswith("layers."):  # LoRALinear and the like stay
        return False
    if name.rsplit(".", 1)[-1] in SKIPPED or any(part in f".{name}." for part in SKIPPED_UNDER):
        return False
    out_features, in_features = module.out_features, module.in_features
    if out_features % 16 or in_features % 16:
        return False
    if large_only and (out_features <= 2048 or in_features <= 1024 or (out_features <= 4096 and in_features <= 2048)):
        return False
    return True


def convert_to_fp8(model: nn.Module, recipe: str = "rowwise", large_only: bool = False) -> list[str]:
    """Swap the eligible layers of `model` (a Transformer, on any device, meta included) for
    torchao's Float8Linear with `recipe`'s casts, in place; returns their names. Before
    activation checkpointing, compile and FSDP2 (placement.load_for_training)."""
    if recipe not in RECIPES:
        raise ValueError(f"unknown FP8 recipe {recipe!r}: one of {', '.join(RECIPES)}")
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    converted: list[str] = []

    def chosen(module: nn.Module, name: str) -> bool:
        if fp8_eligible(module, name, large_only):
            converted.append(name)
            return True
        return False

    convert_to_float8_training(model, module_filter_fn=chosen, config=Float8LinearConfig.from_recipe_name(recipe))
    return converted
