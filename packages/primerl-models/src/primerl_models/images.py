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

import torch
from primerl_protocol.images import ImageSpec, image_tokens, kept_size_problem, smart_resize

__all__ = ["ImageSpec", "image_tokens", "patchify", "smart_resize"]


def patchify(rgb_HW3: torch.Tensor, spec: ImageSpec) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """(pixel_values [t h w, 3 T P P] float32, grid (t, h, w) in patches) of one RGB image,
    uint8 [H, W, 3], at a size the processor keeps (ValueError naming the size it would
    resize to otherwise)."""
    if rgb_HW3.dtype != torch.uint8 or rgb_HW3.dim() != 3 or rgb_HW3.shape[2] != 3:
        raise ValueError(f"an image must be uint8 [height, width, 3], not {rgb_HW3.dtype} {list(rgb_HW3.shape)}")
    height, width = rgb_HW3.shape[:2]
    if (problem := kept_size_problem(height, width, spec)) is not None:
        raise ValueError(problem)
    p, t, m = spec.patch_size, spec.temporal_patch_size, spec.merge_size
    mean, std = torch.tensor(spec.mean), torch.tensor(spec.std)
    x_CHW = ((rgb_HW3.float() / 255.0 - mean) / std).permute(2, 0, 1)
    gh, gw = height // p, width // p
    frames = x_CHW[None].expand(t, -1, -1, -1)  # [T, C, H, W]: the image as t identical frames
    blocks = frames.reshape(t, 3, gh // m, m, p, gw // m, m, p)  # T C bh mh P bw mw P
    patches = blocks.permute(2, 5, 3, 6, 1, 0, 4, 7)  # bh bw mh mw C T P P
    return patches.reshape(gh * gw, 3 * t * p * p).contiguous(), (1, gh, gw)

