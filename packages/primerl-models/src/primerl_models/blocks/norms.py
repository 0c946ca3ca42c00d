"""The RMSNorms of the text model: plain or zero-centred (Qwen3.5), and the gated form of the
Gated DeltaNet's output (RMSNorm per value head times silu(z))."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """x / rms(x) * weight; zero-centred (Qwen3.5): * (1 + weight), the weight starting at 0."""

    def __init__(self, dim: int, eps: float, zero_centered: bool = False):
        super().__init__()
        self.eps, self.zero_centered = eps, zero_centered
        self.weight = nn.Parameter(torch.zeros(dim) if zero_centered else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.zero_centered:  # scaled in fp32, then cast (as Qwen3.5's reference does)
            return (F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps) * (1.0 + self.weight.float())).to(x.dtype)
        # Normalise in fp32, scale in the input dtype (as the reference implementations do).
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)
        return self.weight.to(x.dtype) * normed


class GatedRMSNorm(nn.Module):
    """RMSNorm over each value head, times weight, times silu(z) (Qwen3.5's RMSNormGated)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)
        return (self.weight.to(x.dtype) * normed * F.silu(z.float())).to(x.dtype)
