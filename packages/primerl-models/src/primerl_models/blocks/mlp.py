"""Dense feed-forward blocks: SwiGLU (every family's dense MLP and shared expert but
Nemotron-H's) and down(relu(up)^2) (Nemotron-H). Spec: args.DenseMLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SwiGLU(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x)). The dense MLP and shared expert of every
    family so far but Nemotron-H (ReluSquaredMLP)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class ReluSquaredMLP(nn.Module):
    """down(relu(up(x))^2): Nemotron-H's dense MLP and shared expert (no gate)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(torch.square(F.relu(self.up_proj(x))))


def dense_mlp(dim: int, hidden: int, activation: str) -> nn.Module:
    return ReluSquaredMLP(dim, hidden) if activation == "relu2" else SwiGLU(dim, hidden)
