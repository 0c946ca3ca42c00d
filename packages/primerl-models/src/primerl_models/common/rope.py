"""Rotary position embeddings, computed from position ids (so packed rows restart at 0).

Legend: B batch, T tokens, H heads, K head_dim.
"""

from __future__ import annotations

import math

import torch

from primerl_models.common.args import ModelArgs

SUPPORTED_ROPE_TYPES = ("default", "llama3")


def inv_freq(args: ModelArgs) -> torch.Tensor:
    """[K/2] float32 inverse frequencies, with Llama-3 scaling when configured."""
    k = args.head_dim
    freq = 1.0 / (args.rope_theta ** (torch.arange(0, k, 2, dtype=torch.float64) / k))
    scaling = args.rope_scaling or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return freq.float()
    if rope_type != "llama3":
        raise ValueError(f"rope_type {rope_type!r} is not supported (supported: {SUPPORTED_ROPE_TYPES})")
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling.get("original_max_position_embeddings", 8192)
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / freq
    scaled = torch.where(wavelen > low_wavelen, freq / factor, freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled).float()


def rope_cos_sin(position_ids_BT: torch.Tensor, inv_freq_K2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [B, T, K] float32 (each half repeated, the non-interleaved layout of HF)."""
    freqs_BTK2 = position_ids_BT[..., None].float() * inv_freq_K2.to(position_ids_BT.device)
    emb_BTK = torch.cat([freqs_BTK2, freqs_BTK2], dim=-1)
    return emb_BTK.cos(), emb_BTK.sin()


def apply_rope(x_BTHK: torch.Tensor, cos_BTK: torch.Tensor, sin_BTK: torch.Tensor) -> torch.Tensor:
    half = x_BTHK.shape[-1] // 2
    x1, x2 = x_BTHK[..., :half], x_BTHK[..., half:]
    rotated = torch.cat([-x2, x1], dim=-1)
    cos, sin = cos_BTK[:, :, None, :], sin_BTK[:, :, None, :]
    return (x_BTHK.float() * cos + rotated.float() * sin).to(x_BTHK.dtype)
