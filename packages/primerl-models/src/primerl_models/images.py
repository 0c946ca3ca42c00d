"""Pictures as the Qwen-VL vision tower takes them (common/vision.py): what the models' image
processor does (transformers' Qwen2-VL processor, which vLLM runs), written out so that the
trainer can recompute from an image exactly the inputs the server built from it.

    h, w = smart_resize(height, width, spec)          # the size the processor resizes to
    pixel_values, grid = patchify(rgb_HW3, spec)       # [t h w, C T P P] float32, (t, h, w)
    tokens = image_tokens(grid, spec)                  # the image's placeholder tokens

`patchify` takes an image already at its processed size (both sides multiples of
patch x merge, within the pixel bounds): then the processor's resize changes nothing, and
rescaling, normalising and cutting into patches are exact arithmetic, the same on both sides
(environments draw or resize their images to such sizes: primerl_shapes). Resizing itself is
not reproduced here: the processor resizes with torchvision's antialiased bicubic filter.

Layout (Qwen2-VL's): the image is repeated to `temporal_patch_size` frames; patches are ordered
by merge block (row-major over blocks of merge x merge patches), then row-major inside a block,
and each patch is flattened as [C, T, P, P].
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class ImageSpec:
    """The image processor's settings (a model folder's preprocessor_config.json)."""

    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    min_pixels: int = 65536
    max_pixels: int = 16777216

    @property
    def factor(self) -> int:
        """Both sides of a processed image are multiples of this (a merge block's pixels)."""
        return self.patch_size * self.merge_size

    @classmethod
    def from_folder(cls, folder: str | Path) -> ImageSpec:
        """The spec of a model folder's preprocessor_config.json (defaults: Qwen3.5's)."""
        path = Path(folder) / "preprocessor_config.json"
        if not path.exists():
            return cls()
        cfg = json.loads(path.read_text())
        size = cfg.get("size") or {}
        default = cls()
        return cls(patch_size=cfg.get("patch_size", default.patch_size),
                   temporal_patch_size=cfg.get("temporal_patch_size", default.temporal_patch_size),
                   merge_size=cfg.get("merge_size", default.merge_size),
                   mean=tuple(cfg.get("image_mean", default.mean)), std=tuple(cfg.get("image_std", default.std)),
                   min_pixels=size.get("shortest_edge", cfg.get("min_pixels", default.min_pixels)),
                   max_pixels=size.get("longest_edge", cfg.get("max_pixels", default.max_pixels)))


def smart_resize(height: int, width: int, spec: ImageSpec) -> tuple[int, int]:
    """The size the processor resizes an image of `height` x `width` to: each side rounded to a
    multiple of spec.factor, then scaled (keeping the aspect ratio) into
    [min_pixels, max_pixels]. ValueError for an aspect ratio above 200, as the processor's."""
    f = spec.factor
    if max(height, width) > 200 * min(height, width):
        raise ValueError(f"an image of {height} x {width} pixels: aspect ratio above 200")
    h, w = round(height / f) * f, round(width / f) * f
    if h * w > spec.max_pixels:
        beta = math.sqrt(height * width / spec.max_pixels)
        h, w = max(f, math.floor(height / beta / f) * f), max(f, math.floor(width / beta / f) * f)
    elif h * w < spec.min_pixels:
        beta = math.sqrt(spec.min_pixels / (height * width))
        h, w = math.ceil(height * beta / f) * f, math.ceil(width * beta / f) * f
    return h, w


def patchify(rgb_HW3: torch.Tensor, spec: ImageSpec) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """(pixel_values [t h w, 3 T P P] float32, grid (t, h, w) in patches) of one RGB image,
    uint8 [H, W, 3], at a size the processor keeps (ValueError naming the size it would
    resize to otherwise)."""
    if rgb_HW3.dtype != torch.uint8 or rgb_HW3.dim() != 3 or rgb_HW3.shape[2] != 3:
        raise ValueError(f"an image must be uint8 [height, width, 3], not {rgb_HW3.dtype} {list(rgb_HW3.shape)}")
    height, width = rgb_HW3.shape[:2]
    if (keep := smart_resize(height, width, spec)) != (height, width):
        raise ValueError(f"an image of {height} x {width} pixels would be resized to {keep[0]} x {keep[1]} by the "
                         "model's processor: give it at that size")
    p, t, m = spec.patch_size, spec.temporal_patch_size, spec.merge_size
    mean, std = torch.tensor(spec.mean), torch.tensor(spec.std)
    x_CHW = ((rgb_HW3.float() / 255.0 - mean) / std).permute(2, 0, 1)
    gh, gw = height // p, width // p
    frames = x_CHW[None].expand(t, -1, -1, -1)  # [T, C, H, W]: the image as t identical frames
    blocks = frames.reshape(t, 3, gh // m, m, p, gw // m, m, p)  # T C bh mh P bw mw P
    patches = blocks.permute(2, 5, 3, 6, 1, 0, 4, 7)  # bh bw mh mw C T P P
    return patches.reshape(gh * gw, 3 * t * p * p).contiguous(), (1, gh, gw)


def image_tokens(grid: tuple[int, int, int], spec: ImageSpec) -> int:
    """Placeholder tokens of an image in the text: one per merged block of patches."""
    t, h, w = grid
    return t * h * w // spec.merge_size**2
