"""Low-rank adapters applied to a model from outside: each chosen `nn.Linear` becomes a
`LoRALinear` in place (the same class of module, its `weight` and `bias` where they were, so
checkpoint names do not move), with `lora_A.weight` [r, in] and `lora_B.weight` [out, r] beside
them, PEFT's names:

    y = x W^T (+ b) + (alpha / r) dropout(x) A^T B^T

A starts as PEFT's (Kaiming-uniform), B at zero, so a fresh adapter changes nothing. Every
other parameter is frozen (requires_grad False), so the optimizer holds only the adapters.

    n = apply_lora(model, LoRAConfig(rank=16, alpha=32))   # adapted layers
    merged = merged_state_dict(model)                      # W + (alpha / r) B A, adapters gone
"""

from __future__ import annotations

import fnmatch
import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from primerl_models.blocks.moe import GroupedExperts
from torch import nn

if TYPE_CHECKING:  # the module runs on torch alone (bench/model_step.py on a GPU machine without msgspec)
    from primerl_trainer.config import LoRAConfig


class LoRALinear(nn.Linear):
    """nn.Linear plus a low-rank update (see the module docstring)."""

    # Set by `_adapt` on the nn.Linear it turns into one (declared here for the type checker).
    lora_A: nn.Linear
    lora_B: nn.Linear
    lora_dropout: nn.Module
    lora_scale: float

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        return out + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.lora_scale

    def delta(self) -> torch.Tensor:
        """(alpha / r) B A: what the adapter adds to the weight [out, in]."""
        return (self.lora_B.weight @ self.lora_A.weight) * self.lora_scale


def _adapt(linear: nn.Linear, cfg: LoRAConfig) -> None:
    linear.__class__ = LoRALinear
    assert isinstance(linear, LoRALinear)  # what the line above made it (the checker cannot follow __class__)
    w = linear.weight
    linear.lora_A = nn.Linear(linear.in_features, cfg.rank, bias=False, device=w.device, dtype=w.dtype)
    linear.lora_B = nn.Linear(cfg.rank, linear.out_features, bias=False, device=w.device, dtype=w.dtype)
    with torch.no_grad():
        nn.init.kaiming_uniform_(linear.lora_A.weight, a=math.sqrt(5))
        linear.lora_B.weight.zero_()
    linear.lora_dropout = nn.Dropout(cfg.dropout) if cfg.dropout else nn.Identity()
    linear.lora_scale = cfg.alpha / cfg.rank


VISION_PREFIX = "visual."
"""A VLM's vision tower (primerl_models.blocks.vision): never adapted, frozen with the rest."""


def apply_lora(model: nn.Module, cfg: LoRAConfig) -> list[str]:
    """Adapt the language model's linear layers whose last name part matches `cfg.targets`
    (a vision tower's are left alone, whatever the globs: its layer names, `qkv`, `proj`,
    `linear_fc1`, are easy to match by accident); freeze every other parameter. Returns the
    adapted layers' names; a ValueError when nothing is (naming the targets and the linear
    layers there are)."""
    chosen = [
        (name, m)
        for name, m in model.named_modules()
        if type(m) is nn.Linear
        and not name.startswith(VISION_PREFIX)
        and any(fnmatch.fnmatchcase(name.rsplit(".", 1)[-1], t) for t in cfg.targets)
    ]
    experts = [
        (name, m)
        for name, m in model.named_modules()
        if cfg.experts and isinstance(m, GroupedExperts) and not name.startswith(VISION_PREFIX)
    ]
    if cfg.experts and not experts:
        raise ValueError("trainer.lora.experts = true, but the model has no MoE layer")
    if not chosen and not experts:
        kinds = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear)})
        raise ValueError(
            f"trainer.lora.targets = {cfg.targets} matches no linear layer of the model "
            f"(its linear layers: {', '.join(kinds)})"
        )
    for p in model.parameters():
        p.requires_grad_(False)
    for _, linear in chosen:
        _adapt(linear, cfg)
    for _, module in experts:
        _adapt_experts(module, cfg)
    return [name for name, _ in chosen] + [name for name, _ in experts]


def _adapt_experts(experts: GroupedExperts, cfg: LoRAConfig) -> None:
    """lora_A_<w> [E, in, r] (PEFT's Kaiming-uniform bound 1 / sqrt(in)) and lora_B_<w> [E, r, out]
    (zeros) beside each stacked weight w [E, in, out]: GroupedExperts.run folds them in."""
    for name, w in list(experts.named_parameters(recurse=False)):
        if not name.startswith("w_"):
            continue
        e, fan_in, fan_out = w.shape
        a = torch.empty(e, fan_in, cfg.rank, device=w.device, dtype=w.dtype)
        with torch.no_grad():
            a.uniform_(-(fan_in**-0.5), fan_in**-0.5)
        experts.register_parameter(f"lora_A_{name}", nn.Parameter(a))
        experts.register_parameter(
            f"lora_B_{name}", nn.Parameter(torch.zeros(e, cfg.rank, fan_out, device=w.device, dtype=w.dtype))
        )
    experts.lora_scale = cfg.alpha / cfg.rank


def adapted_weights(model: nn.Module) -> set[str]:
    """The state-dict names of the weights that have adapters."""
    out = set()
    for name, m in model.named_modules():
        if isinstance(m, LoRALinear):
            out.add(f"{name}.weight")
        elif isinstance(m, GroupedExperts) and m.lora_scale:
            out |= {f"{name}.{w}" for w, _ in m.named_parameters(recurse=False) if w.startswith("w_")}
    return out


def fold(state: dict[str, torch.Tensor], model: nn.Module, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """`state` (the model's state dict, or one gathered from it) with every adapter folded into
    its weight, W + (alpha / r) B A for a linear layer, W + (alpha / r) A B for each expert,
    summed in fp32 and cast to `dtype` (default: the weight's), the adapter tensors popped."""
    for name, module in model.named_modules():
        if isinstance(module, LoRALinear):
            a, b = state.pop(f"{name}.lora_A.weight"), state.pop(f"{name}.lora_B.weight")
            pairs = [(f"{name}.weight", b.float() @ a.float())]
        elif isinstance(module, GroupedExperts) and module.lora_scale:
            pairs = [
                (
                    f"{name}.{w}",
                    torch.bmm(state.pop(f"{name}.lora_A_{w}").float(), state.pop(f"{name}.lora_B_{w}").float()),
                )
                for w, _ in module.named_parameters(recurse=False)
                if w.startswith("w_")
            ]
        else:
            continue
        scale = module.lora_scale
        for key, delta in pairs:
            w = state[key]
            state[key] = (w.float() + scale * delta).to(dtype or w.dtype)
    return state


@torch.no_grad()
def merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict with every adapter folded into its weight and the adapter tensors
    left out: the full model's names and shapes, for export."""
    return fold(dict(model.state_dict()), model)


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Only the adapters' tensors (`<layer>.lora_A.weight`, `<layer>.lora_B.weight`)."""
    return {k: v for k, v in model.state_dict().items() if ".lora_" in k}
