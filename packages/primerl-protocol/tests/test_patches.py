"""Image inputs of the Qwen-VL tower (primerl_protocol.images): the processor's size rule worked by
hand, and the patch layout against a loop over the layout's definition, pixel by pixel."""

import json

import numpy as np
import pytest
from primerl_protocol.images import ImageSpec, image_tokens, patchify, smart_resize

QWEN35 = ImageSpec()  # patches of 16 merged 2 x 2 (factor 32), 65,536 .. 16,777,216 pixels


@pytest.mark.parametrize(
    "size, expected",
    [
        ((256, 256), (256, 256)),  # kept: multiples of 32, at the lower bound
        ((300, 500), (288, 512)),  # 300 / 32 = 9.4 -> 9 blocks, 500 / 32 = 15.6 -> 16
        ((100, 100), (256, 256)),  # 96 x 96 is under 65,536 pixels: scaled by sqrt(65536 / 10000), up to 8 blocks
        ((10000, 10000), (4096, 4096)),  # over 16,777,216: scaled by 1 / 2.44140625, down to 128 blocks
    ],
)
def test_the_processors_size_rule_by_hand(size, expected):
    assert smart_resize(*size, QWEN35) == expected


def test_a_too_thin_image_is_refused():
    with pytest.raises(ValueError, match="aspect ratio"):
        smart_resize(32, 6432, QWEN35)


def test_patches_follow_the_layout_pixel_by_pixel():
    """Patches ordered by merge block, then inside the block; each [C, T, P, P] with the image
    repeated over T; values (x / 255 - mean) / std. Expected from a loop over that definition."""
    spec = ImageSpec(
        patch_size=2,
        temporal_patch_size=2,
        merge_size=2,
        mean=(0.1, 0.2, 0.3),
        std=(0.5, 0.25, 2.0),
        min_pixels=16,
        max_pixels=10_000,
    )
    rgb = np.random.default_rng(0).integers(0, 256, (8, 12, 3), dtype=np.uint8)
    got, grid = patchify(rgb, spec)
    assert grid == (1, 4, 6) and got.shape == (24, 3 * 2 * 2 * 2) and image_tokens(grid, spec) == 6
    p, m = 2, 2
    n = 0
    for bh in range(2):
        for bw in range(3):
            for mh in range(m):
                for mw in range(m):
                    top, left = (bh * m + mh) * p, (bw * m + mw) * p
                    want = [
                        (int(rgb[top + i, left + j, c]) / 255 - spec.mean[c]) / spec.std[c]
                        for c in range(3)
                        for _ in range(2)
                        for i in range(p)
                        for j in range(p)
                    ]
                    np.testing.assert_allclose(got[n], want, atol=1e-6, rtol=0)
                    n += 1


def test_an_image_the_processor_would_resize_is_refused_naming_the_size():
    with pytest.raises(ValueError, match="resized to 256 x 256"):
        patchify(np.zeros((100, 100, 3), dtype=np.uint8), QWEN35)
    with pytest.raises(ValueError, match="uint8"):
        patchify(np.zeros((256, 256, 3)), QWEN35)
    with pytest.raises(ValueError, match=r"\[256, 256, 4\]"):
        patchify(np.zeros((256, 256, 4), dtype=np.uint8), QWEN35)


def test_the_spec_of_a_model_folder(tmp_path):
    assert ImageSpec.from_folder(tmp_path) == QWEN35
    (tmp_path / "preprocessor_config.json").write_text(
        json.dumps(
            {
                "patch_size": 14,
                "temporal_patch_size": 2,
                "merge_size": 2,
                "image_mean": [0.48, 0.45, 0.4],
                "image_std": [0.26, 0.26, 0.27],
                "size": {"shortest_edge": 3136, "longest_edge": 12845056},
            }
        )
    )
    spec = ImageSpec.from_folder(tmp_path)
    assert (spec.factor, spec.mean, spec.min_pixels, spec.max_pixels) == (28, (0.48, 0.45, 0.4), 3136, 12845056)


def _transformers_processor():
    """transformers' Qwen2-VL image processor: its torchvision backend where torchvision loads,
    else its PIL backend (Qwen2VLImageProcessorPil, which vLLM's server runs on these CPU
    machines: primerl_inference.vision_compat)."""
    try:
        import torchvision  # noqa: F401
        from transformers import Qwen2VLImageProcessor
    except (ImportError, RuntimeError):  # PyPI's CUDA torchvision fails to load on a CPU torch
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
            Qwen2VLImageProcessorPil as Qwen2VLImageProcessor,
        )
    return Qwen2VLImageProcessor


@pytest.mark.parametrize("size", [(256, 256), (288, 512), (512, 256)])
def test_patches_equal_transformers_processor_on_an_image_it_keeps(size):
    """The reference: transformers' processor (what vLLM runs) on the same image, at Qwen3.5's
    settings; on a size it keeps, its resize changes nothing and every value matches."""
    processor = _transformers_processor()(
        patch_size=16,
        temporal_patch_size=2,
        merge_size=2,
        image_mean=[0.5] * 3,
        image_std=[0.5] * 3,
        size={"shortest_edge": 65536, "longest_edge": 16777216},
    )
    rgb = np.random.default_rng(1).integers(0, 256, (*size, 3), dtype=np.uint8)
    ref = processor(images=[rgb], return_tensors="pt")
    got, grid = patchify(rgb, QWEN35)
    assert ref["image_grid_thw"].tolist() == [list(grid)]
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, ref["pixel_values"].float().numpy(), atol=1e-6, rtol=0)
