"""Rotary position embeddings, computed from position ids (so packed rows restart at 0).

Each attention block has its `Rope` (args.py): how many dimensions of a head rotate (partial
RoPE leaves the rest unchanged), the base, Llama-3 or YaRN scaling, and the layout: the two halves of
the rotated part (Llama, Qwen: HF's `rotate_half`) or interleaved pairs (GLM-4).

With images (Qwen3-VL, Qwen3.5), positions have three axes (t, h, w) and each frequency turns
with one of them (`Rope.mrope_section`, `mrope_cos_sin`); text tokens have t = h = w.

Legend: B batch, T tokens, H heads, K head_dim, R rotary dims, R2 = R / 2 frequencies.
"""

from __future__ import annotations

import math

import torch

from primerl_models.args import Rope

SUPPORTED_ROPE_TYPES = ("default", "llama3", "yarn")


def _rope_type(rope: Rope) -> str:
    scaling = rope.scaling or {}
    return scaling.get("rope_type", scaling.get("type", "default"))


def _yarn_factor(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def attention_factor(rope: Rope) -> float:
    """The factor cos and sin are multiplied by (YaRN's attention temperature; 1 otherwise)."""
    if _rope_type(rope) != "yarn":
        return 1.0
    s = rope.scaling or {}
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])
    if s.get("mscale") and s.get("mscale_all_dim"):
        return _yarn_factor(s["factor"], s["mscale"]) / _yarn_factor(s["factor"], s["mscale_all_dim"])
    return _yarn_factor(s["factor"])


def _yarn(freq: torch.Tensor, rope: Rope, s: dict) -> torch.Tensor:
    """YaRN (arXiv:2309.00071): frequencies that turn fewer than beta_slow times over the
    original context are interpolated (divided by factor), those that turn more than beta_fast
    times are kept, with a linear ramp between the two dimensions in between. `s`: the rope's
    scaling dict."""
    r = rope.rotary_dim
    factor, original = s["factor"], s["original_max_position_embeddings"]
    fast, slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def dim_of(turns: float) -> float:  # the dimension whose frequency turns `turns` times
        return r * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = dim_of(fast), dim_of(slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, r - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(r // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (the frequency as is), 0: interpolate
    freq = freq.float()
    return (freq / factor) * (1 - keep) + freq * keep


def inv_freq(rope: Rope) -> torch.Tensor:
    """[R/2] float32 inverse frequencies, with Llama-3 or YaRN scaling when configured."""
    r = rope.rotary_dim
    freq = 1.0 / (rope.theta ** (torch.arange(0, r, 2, dtype=torch.float64) / r))
    scaling = rope.scaling or {}
    rope_type = _rope_type(rope)
    if rope_type == "default":
        return freq.float()
    if rope_type == "yarn":
        return _yarn(freq, rope, scaling)
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


def rope_cos_sin(
    position_ids_BT: torch.Tensor, inv_freq_R2: torch.Tensor, interleaved: bool = False, factor: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [B, T, R] float32 (times `factor`): each frequency for both members of its
    pair (the halves repeated, or each frequency twice in a row when interleaved)."""
    freqs_BTR2 = position_ids_BT[..., None].float() * inv_freq_R2.to(position_ids_BT.device)
    if interleaved:
        emb_BTR = freqs_BTR2.repeat_interleave(2, dim=-1)
    else:
        emb_BTR = torch.cat([freqs_BTR2, freqs_BTR2], dim=-1)
    if factor != 1.0:
        return emb_BTR.cos() * factor, emb_BTR.sin() * factor
    return emb_BTR.cos(), emb_BTR.sin()


def mrope_axes(section: tuple[int, int, int], num_freqs: int) -> torch.Tensor:
    """int64 [R2]: which position axis (0 t, 1 h, 2 w) each frequency turns with, interleaved
    as transformers' Qwen3.5 text rotary embedding lays them out (t h w t h w ..., each axis
    only within its 3 * section)."""
    j = torch.arange(num_freqs)
    axis = torch.zeros(num_freqs, dtype=torch.int64)
    axis[(j % 3 == 1) & (j < 3 * section[1])] = 1
    axis[(j % 3 == 2) & (j < 3 * section[2])] = 2
    return axis


def mrope_cos_sin(
    positions_3BT: torch.Tensor, inv_freq_R2: torch.Tensor, section: tuple[int, int, int], factor: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [B, T, R] float32 of 3-axis positions: frequency j at the position of its axis
    (`mrope_axes`), the halves repeated (rotate-half layout)."""
    inv_freq_R2 = inv_freq_R2.to(positions_3BT.device)
    freqs_3BTR2 = positions_3BT[..., None].float() * inv_freq_R2
    axis_R2 = mrope_axes(section, len(inv_freq_R2)).to(positions_3BT.device)
    freqs_BTR2 = freqs_3BTR2.gather(0, axis_R2.expand(1, *freqs_3BTR2.shape[1:3], -1)).squeeze(0)
    emb_BTR = torch.cat([freqs_BTR2, freqs_BTR2], dim=-1)
    if factor != 1.0:
        return emb_BTR.cos() * factor, emb_BTR.sin() * factor
    return emb_BTR.cos(), emb_BTR.sin()


def apply_rope(
    x_BTHK: torch.Tensor, cos_BTR: torch.Tensor, sin_BTR: torch.Tensor, interleaved: bool = False
) -> torch.Tensor:
    """Rotate the first R dimensions of each head (R = cos.shape[-1]); the rest pass unchanged."""
    r = cos_BTR.shape[-1]
    x_rot, x_pass = (x_BTHK, None) if r == x_BTHK.shape[-1] else (x_BTHK[..., :r], x_BTHK[..., r:])
    if interleaved:
        x1, x2 = x_rot[..., 0::2], x_rot[..., 1::2]
        rotated = torch.stack([-x2, x1], dim=-1).flatten(-2)
    else:
        x1, x2 = x_rot[..., : r // 2], x_rot[..., r // 2 :]
        rotated = torch.cat([-x2, x1], dim=-1)
    cos, sin = cos_BTR[:, :, None, :], sin_BTR[:, :, None, :]
    out = (x_rot.float() * cos + rotated.float() * sin).to(x_BTHK.dtype)
    return out if x_pass is None else torch.cat([out, x_pass], dim=-1)
