"""Images as Qwen-VL models take them, the one home of the concept for every process: the
picture a prompt holds (`Image`), the model's processor settings and image token
(`ModelImages`), the processor's size rule, each image's placeholder tokens and its patches,
in numpy (environments and the orchestrator check images without torch; the trainer feeds the
patches to the vision tower, primerl_models/blocks/vision.py).

    images = model_images(model_dir)                   # ModelImages, or None for a text model
    h, w = smart_resize(height, width, images.spec)    # the size the processor resizes to
    n = image_tokens(grid_of(height, width, spec), spec)   # its placeholder tokens in the text
    pixel_values, grid = patchify(rgb_HW3, spec)       # [t h w, C T P P] float32, (t, h, w)

An image travels as an `Image`: its size and raw RGB bytes (or its file). `decode_data_url`
reads one from a message's inline data URL, for environments' prompts and SFT data alike.
Only what the server and the trainer read alike is taken: an inline `data:image/...;base64,`
URL (no fetching: a URL on the network could answer the server and the orchestrator
differently) holding an RGB picture (the server converts other modes, e.g. RGBA onto white,
its own way). Anything else raises ImageError saying what.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import msgspec
import numpy as np


class Image(msgspec.Struct, kw_only=True, frozen=True):
    """One picture of a prompt: what the trainer needs to recompute what the server's image
    processor made of it (`patchify`). Either decoded (`rgb`) or, to hold
    a dataset's pictures at their file size, still encoded (`encoded`, checked when read:
    decode_data_url(keep_encoded=True)); `pixels()` gives the RGB bytes."""

    height: int
    width: int
    rgb: bytes = b""
    """height x width x 3 bytes, row-major RGB."""
    encoded: bytes = b""
    """The picture's file (PNG, JPEG, ...), when `rgb` is not kept."""

    def __post_init__(self) -> None:
        if self.height <= 0 or self.width <= 0:
            raise ValueError(f"an image must have a positive size, got {self.height} x {self.width}")
        if not self.rgb and not self.encoded:
            raise ValueError("an image needs its RGB bytes or its encoded file")
        if self.rgb and len(self.rgb) != self.height * self.width * 3:
            raise ValueError(
                f"an image of {self.height} x {self.width} pixels needs {self.height * self.width * 3} "
                f"RGB bytes, got {len(self.rgb)}"
            )

    def pixels(self) -> bytes:
        """The RGB bytes, decoded from `encoded` when not kept (ValueError if they do not match the size)."""
        if self.rgb:
            return self.rgb
        image = decode_bytes(self.encoded)
        if (image.height, image.width) != (self.height, self.width):
            raise ValueError(
                f"an encoded image of {image.height} x {image.width} pixels, recorded as {self.height} x {self.width}"
            )
        return image.rgb


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
        try:
            cfg = json.loads(path.read_text())
        except ValueError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from e
        size = cfg.get("size") or {}
        default = cls()
        return cls(
            patch_size=cfg.get("patch_size", default.patch_size),
            temporal_patch_size=cfg.get("temporal_patch_size", default.temporal_patch_size),
            merge_size=cfg.get("merge_size", default.merge_size),
            mean=tuple(cfg.get("image_mean", default.mean)),
            std=tuple(cfg.get("image_std", default.std)),
            min_pixels=size.get("shortest_edge", cfg.get("min_pixels", default.min_pixels)),
            max_pixels=size.get("longest_edge", cfg.get("max_pixels", default.max_pixels)),
        )


class ModelImages(NamedTuple):
    """What the image checks need of a vision-language model: its processor's settings and its
    image token (the orchestrator, the RL trainer's batch check and SFT data take it)."""

    spec: ImageSpec
    image_token_id: int


def model_images(model: str | Path) -> ModelImages | None:
    """The ModelImages of the model folder `model`, or None for a text model (config.json
    without a vision_config and an integer image_token_id) or a name that is not a local folder."""
    try:
        config = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    token = config.get("image_token_id") if isinstance(config, dict) else None
    if not isinstance(config, dict) or "vision_config" not in config or not isinstance(token, int):
        return None
    return ModelImages(ImageSpec.from_folder(model), token)


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


def grid_of(height: int, width: int, spec: ImageSpec) -> tuple[int, int, int]:
    """(t, h, w) in patches of an image the processor keeps at `height` x `width`: one frame."""
    return 1, height // spec.patch_size, width // spec.patch_size


def image_tokens(grid: tuple[int, int, int], spec: ImageSpec) -> int:
    """Placeholder tokens of an image in the text: one per merged block of patches."""
    t, h, w = grid
    return t * h * w // spec.merge_size**2


def kept_size_problem(height: int, width: int, spec: ImageSpec) -> str | None:
    """Why the processor would not take an image of `height` x `width` as it is (it would resize
    it, and the trainer does not reproduce the resize), or None."""
    try:
        keep = smart_resize(height, width, spec)
    except ValueError as e:
        return str(e)
    if keep != (height, width):
        return (
            f"an image of {height} x {width} pixels would be resized to {keep[0]} x {keep[1]} by the model's "
            f"processor: give it at that size (sides multiples of {spec.factor}, "
            f"{spec.min_pixels} to {spec.max_pixels} pixels)"
        )
    return None


def tokens_problem(ids, sizes: list[tuple[int, int]], spec: ImageSpec, image_token_id: int) -> str | None:
    """Why the images of `sizes` (height, width each, in order) do not fit the token ids `ids`
    of one sequence (each a run of exactly its image tokens, at a size the processor keeps), or None."""
    runs = placeholder_runs(ids, image_token_id)
    if len(runs) != len(sizes):
        return f"{len(sizes)} images but {len(runs)} runs of image tokens"
    for k, ((height, width), (_, length)) in enumerate(zip(sizes, runs, strict=True), 1):
        if (problem := kept_size_problem(height, width, spec)) is not None:
            return f"image {k}: {problem}"
        need = image_tokens(grid_of(height, width, spec), spec)
        if need != length:
            return f"image {k} ({height} x {width} pixels) makes {need} image tokens but its run has {length}"
    return None


def placeholder_runs(ids: np.ndarray | list[int], image_token_id: int) -> list[tuple[int, int]]:
    """(start, length) of each run of `image_token_id` in `ids`, in order."""
    is_image = np.asarray(ids) == image_token_id
    if not is_image.any():
        return []
    edges = np.flatnonzero(np.diff(np.concatenate([[0], is_image.astype(np.int8), [0]])))
    return [(int(a), int(b - a)) for a, b in zip(edges[::2], edges[1::2])]


MAX_PIXELS = 64 * 1024 * 1024
"""Largest picture decoded (PIL's decompression-bomb bound is near this, 89M)."""


class ImageError(ValueError):
    """A picture that cannot be read for training; the message says why."""


def decode_data_url(url: object, keep_encoded: bool = False) -> Image:
    """The picture of an inline `data:image/...;base64,...` URL as an Image: decoded, or with
    `keep_encoded` checked the same way and kept as its file (a tenth of the memory or less).
    `url` is whatever a message held: anything but such a string is refused (ImageError)."""
    if not isinstance(url, str) or not url.startswith("data:"):
        shown = url[:60] + "..." if isinstance(url, str) and len(url) > 60 else url
        raise ImageError(f"an image URL must be inline (data:image/...;base64,...), got {shown!r}")
    header, sep, payload = url.partition(",")
    if not sep or not header.endswith(";base64") or not header[5:].startswith("image/"):
        raise ImageError(f"an image URL must be data:image/<format>;base64,<data>, got a header {header[:60]!r}")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ImageError(f"the image's base64 data does not decode ({e})") from None
    image = decode_bytes(data)
    return Image(height=image.height, width=image.width, encoded=data) if keep_encoded else image


def decode_bytes(data: bytes) -> Image:
    """The RGB picture of an image file's bytes (ImageError saying why not)."""
    from PIL import Image as PILImage

    try:
        with PILImage.open(io.BytesIO(data)) as picture:
            if picture.width * picture.height > MAX_PIXELS:
                raise ImageError(f"an image of {picture.width} x {picture.height} pixels is larger than {MAX_PIXELS}")
            if picture.mode != "RGB":
                raise ImageError(
                    f"an image in mode {picture.mode}: give RGB pictures (the server and the trainer "
                    "would convert other modes differently)"
                )
            picture.load()
            return Image(height=picture.height, width=picture.width, rgb=picture.tobytes())
    except ImageError:
        raise
    except Exception as e:  # PIL raises many kinds for a broken file
        raise ImageError(f"not a readable image ({type(e).__name__}: {e})") from None


def patchify(rgb_HW3: np.ndarray, spec: ImageSpec) -> tuple[np.ndarray, tuple[int, int, int]]:
    """(pixel_values [t h w, 3 T P P] float32, grid (t, h, w) in patches) of one RGB image,
    uint8 [H, W, 3], at a size the processor keeps (ValueError naming the size it would resize
    to otherwise): what transformers' Qwen2-VL processor (which vLLM runs) makes of it.

    At a kept size the processor's resize changes nothing, and rescaling, normalising and
    cutting into patches are exact arithmetic, the same on both sides (environments draw or
    resize their images to such sizes: primerl_shapes); the resize itself (torchvision's
    antialiased bicubic filter) is not reproduced. Layout (Qwen2-VL's): the image repeated to
    `temporal_patch_size` frames; patches ordered by merge block (row-major over blocks of
    merge x merge patches), then row-major inside a block; each patch flattened as [C, T, P, P]."""
    if rgb_HW3.dtype != np.uint8 or rgb_HW3.ndim != 3 or rgb_HW3.shape[2] != 3:
        raise ValueError(f"an image must be uint8 [height, width, 3], not {rgb_HW3.dtype} {list(rgb_HW3.shape)}")
    height, width = rgb_HW3.shape[:2]
    if (problem := kept_size_problem(height, width, spec)) is not None:
        raise ValueError(problem)
    p, t, m = spec.patch_size, spec.temporal_patch_size, spec.merge_size
    mean, std = np.asarray(spec.mean, dtype=np.float32), np.asarray(spec.std, dtype=np.float32)
    x_CHW = ((rgb_HW3.astype(np.float32) / np.float32(255.0) - mean) / std).transpose(2, 0, 1)
    gh, gw = height // p, width // p
    frames = np.broadcast_to(x_CHW[None], (t, *x_CHW.shape))  # [T, C, H, W]: the image as t identical frames
    blocks = frames.reshape(t, 3, gh // m, m, p, gw // m, m, p)  # T C bh mh P bw mw P
    patches = blocks.transpose(2, 5, 3, 6, 1, 0, 4, 7)  # bh bw mh mw C T P P
    return np.ascontiguousarray(patches.reshape(gh * gw, 3 * t * p * p)), (1, gh, gw)
