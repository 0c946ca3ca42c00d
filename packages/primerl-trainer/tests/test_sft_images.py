"""SFT on image + text rows (CPU, fp32): each image's single placeholder widened to its image
tokens, never trained on; the packed row's log-probabilities against transformers'
Qwen3_5ForConditionalGeneration on each sample alone; malformed rows named; and a 2-rank run
on the tiny VLM that lowers the loss and leaves the frozen tower as it was.

The tiny VLM (primerl_models.tiny.build_tiny_vlm) has Qwen3.5's image processor settings:
patch 16, merge 2, at least 65536 pixels, so 256 x 256 is the smallest square it keeps.
"""

import base64
import io
import json

import numpy as np
import pytest
import torch
import transformers
from primerl_algos.packing import build_micro_batch
from primerl_models import load_model
from primerl_models.tiny import build_tiny_model, build_tiny_vlm
from primerl_protocol.images import ImageSpec, patchify
from primerl_trainer.engine import token_logprobs
from primerl_trainer.sft_data import DataError, load_samples
from primerl_trainer.testing import free_port_block

SIZES = [(256, 256), (256, 384)]  # two images of different sizes
PATCH, MERGE = 16, 2


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    return build_tiny_vlm(tmp_path_factory.mktemp("vlm"), tokenizer="chars", alphabet="abcdefghij :")


@pytest.fixture(scope="module")
def vision(vlm_dir):
    return ImageSpec.from_folder(vlm_dir), json.loads((vlm_dir / "config.json").read_text())["image_token_id"]


def png_url(height: int, width: int, seed: int, mode: str = "RGB") -> str:
    from PIL import Image

    rgb = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(rgb).convert(mode).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def image_row(seed: int, sizes=SIZES, reply: str = "cab") -> dict:
    """A user message with text between images (OpenAI parts) and a string assistant reply."""
    parts = [{"type": "text", "text": "ab "}]
    for k, (h, w) in enumerate(sizes):
        parts += [image_part(png_url(h, w, seed * 10 + k)), {"type": "text", "text": f" {'cd'[k % 2]}"}]
    return {"messages": [{"role": "user", "content": parts}, {"role": "assistant", "content": reply}]}


def write_rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_each_image_is_widened_to_its_tokens_and_not_trained_on(tmp_path, vlm_dir, vision):
    tokenizer = transformers.AutoTokenizer.from_pretrained(vlm_dir)
    spec, image_id = vision
    data = write_rows(tmp_path / "d.jsonl", [image_row(0)])
    [sample], _ = load_samples(data, tokenizer, 1024, vision)
    ids, mask = np.array(sample.token_ids), np.array(sample.loss_mask)
    assert [(i.height, i.width) for i in sample.images] == SIZES
    # held as their files (the row's PNGs), decoded to their pixels when a row is built
    assert all(not i.rgb and i.encoded[:8] == b"\x89PNG\r\n\x1a\n" for i in sample.images)
    assert [len(i.pixels()) for i in sample.images] == [h * w * 3 for h, w in SIZES]
    # runs of image tokens: one per image, each (h / patch / merge) * (w / patch / merge) long
    is_image = ids == image_id
    edges = np.flatnonzero(np.diff(np.concatenate([[0], is_image.astype(int), [0]])))
    runs = list(zip(edges[::2], edges[1::2] - edges[::2]))
    assert [n for _, n in runs] == [(h // PATCH // MERGE) * (w // PATCH // MERGE) for h, w in SIZES] == [64, 96]
    vs, ve = (tokenizer.convert_tokens_to_ids(t) for t in ("<|vision_start|>", "<|vision_end|>"))
    for start, n in runs:
        assert ids[start - 1] == vs and ids[start + n] == ve
    assert not mask[is_image].any()
    # what is trained on is the assistant's reply (and its end), nothing else
    assert ids[mask].tolist() == tokenizer.encode("cab<|im_end|>\n", add_special_tokens=False)
    # the text around the images is the template's, with each pad widened
    narrow = [t for k, t in enumerate(ids.tolist()) if not (is_image[k] and is_image[k - 1])]
    parts = image_row(0)["messages"][0]["content"]
    as_template = [
        {"role": "user", "content": [p if p["type"] == "text" else {"type": "image"} for p in parts]},
        {"role": "assistant", "content": "cab"},
    ]
    assert narrow == list(tokenizer.apply_chat_template(as_template, tokenize=True)["input_ids"])


def test_text_rows_are_unchanged_by_vision(tmp_path, vlm_dir, vision):
    tokenizer = transformers.AutoTokenizer.from_pretrained(vlm_dir)
    data = write_rows(
        tmp_path / "t.jsonl",
        [
            {"prompt": "ab", "completion": "ba"},
            {
                "messages": [
                    {"role": "user", "content": [{"type": "text", "text": "c"}]},
                    {"role": "assistant", "content": "d"},
                ]
            },
        ],
    )
    with_vision, _ = load_samples(data, tokenizer, 256, vision)
    without, _ = load_samples(data, tokenizer, 256)
    assert [(s.token_ids, s.loss_mask, s.images) for s in with_vision] == [
        (s.token_ids, s.loss_mask, []) for s in without
    ]


def test_parquet_image_rows_read_as_jsonl_ones(tmp_path, vlm_dir, vision):
    """Parquet fills each part's missing keys with None (a text part's `image_url`): the
    template sees the parts as JSON gives them."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    tokenizer = transformers.AutoTokenizer.from_pretrained(vlm_dir)
    rows = [image_row(0), image_row(1, sizes=[(320, 256)])]
    for row in rows:  # a column holds lists or strings, not both
        row["messages"][1]["content"] = [{"type": "text", "text": row["messages"][1]["content"]}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    assert pq.read_table(tmp_path / "d.parquet").to_pylist()[0]["messages"][0]["content"][0]["image_url"] is None
    from_parquet, _ = load_samples(str(tmp_path / "d.parquet"), tokenizer, 1024, vision)
    from_jsonl, _ = load_samples(write_rows(tmp_path / "d.jsonl", rows), tokenizer, 1024, vision)

    def fields(samples):
        return [(s.token_ids, s.loss_mask, s.images) for s in samples]

    assert fields(from_parquet) == fields(from_jsonl)


def test_packed_image_rows_match_transformers_per_sample(tmp_path, vlm_dir, vision):
    """token_logprobs on one packed row of two image samples (2 + 1 images of different
    sizes) = log-softmax of transformers' Qwen3_5ForConditionalGeneration on each sample alone."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(vlm_dir)
    spec, image_id = vision
    rows = [image_row(1), image_row(2, sizes=[(320, 256)], reply="jihg")]
    samples, _ = load_samples(write_rows(tmp_path / "d.jsonl", rows), tokenizer, 1024, vision)
    mb = build_micro_batch(samples)
    ours = load_model(vlm_dir).eval()
    with torch.no_grad():
        pi, _ = token_logprobs(ours, mb, torch.device("cpu"), None, spec)
    hf = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(vlm_dir, dtype=torch.float32).eval()
    worst, least_moved, start = 0.0, float("inf"), 0
    for s in samples:
        ids = torch.tensor([s.token_ids])
        patches, grids = zip(
            *(patchify(np.frombuffer(i.pixels(), dtype=np.uint8).reshape(i.height, i.width, 3), spec) for i in s.images)
        )
        with torch.no_grad():
            logits = hf(
                input_ids=ids,
                pixel_values=torch.from_numpy(np.concatenate(patches)),
                image_grid_thw=torch.tensor(grids),
                mm_token_type_ids=(ids == image_id).int(),
            ).logits[0]
            # the pictures show in the numbers: other pixels move them far beyond the tolerance
            other = hf(
                input_ids=ids,
                pixel_values=torch.from_numpy(np.concatenate(patches)).flip(0),
                image_grid_thw=torch.tensor(grids),
                mm_token_type_ids=(ids == image_id).int(),
            ).logits[0]
        expected, moved = (
            torch.log_softmax(x.double(), -1)[:-1].gather(1, ids[0, 1:, None])[:, 0] for x in (logits, other)
        )
        got = pi[start + 1 : start + len(s)].double()
        worst = max(worst, float((got - expected).abs().max()))
        least_moved = min(least_moved, float((moved - expected).abs().max()))
        start += len(s)
    assert start == len(pi)
    print(f"max |ours - transformers| = {worst:.2e}; other pixels move transformers' by {least_moved:.2e}")
    assert worst < 1e-4 and least_moved > 1e-2


def test_malformed_image_rows_are_named(tmp_path, vlm_dir, vision):
    tokenizer = transformers.AutoTokenizer.from_pretrained(vlm_dir)
    good = image_row(0, sizes=[(256, 256)])

    def one_image(url):
        return {
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "a"}, image_part(url)]},
                {"role": "assistant", "content": "b"},
            ]
        }

    cases = [
        (
            one_image("data:image/png;base64," + base64.b64encode(b"not a picture").decode()),
            r"row 1, image 1: not a readable image",
        ),
        (
            one_image(png_url(250, 250, 0)),
            r"row 1, image 1: an image of 250 x 250 pixels would be resized to 256 x 256 by the model's processor: "
            r"give it at that size",
        ),
        (one_image("https://example.com/cat.png"), r"row 1, image 1: an image URL must be inline"),
        (one_image(png_url(256, 256, 0, mode="L")), r"row 1, image 1: an image in mode L"),
        # a literal image token in text, beside a real image: the counts differ
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "text", "text": "<|image_pad|>"}, image_part(png_url(256, 256, 0))],
                    },
                    {"role": "assistant", "content": "b"},
                ]
            },
            r"row 1: 1 images but the chat template renders 2 image tokens",
        ),
    ]
    for k, (bad, message) in enumerate(cases):
        path = write_rows(tmp_path / f"bad{k}.jsonl", [good, bad])
        with pytest.raises(DataError, match=f"^{path}, {message}"):
            load_samples(path, tokenizer, 1024, vision)
    # images for a text model
    text_dir = build_tiny_model(tmp_path / "text", "qwen3", hidden_size=32, num_layers=1, alphabet="abcdefghij :")
    path = write_rows(tmp_path / "text.jsonl", [{"prompt": "ab", "completion": "ba"}, good])
    with pytest.raises(DataError, match=f"^{path}, row 1: 1 images, but the model has no vision tower"):
        load_samples(path, transformers.AutoTokenizer.from_pretrained(text_dir), 1024, None)


SFT_TOML = """
seq_len = 512
max_steps = 3
run_dir = "{run_dir}"
[model]
name = "{model}"
[wandb]
mode = "disabled"
[data]
path = "{data}"
batch_size = 4
[trainer]
dtype = "float32"
[trainer.optimizer]
lr = 3e-3
[trainer.checkpoint]
interval = 100
[trainer.weights]
dtype = "float32"
"""


@pytest.mark.slow
def test_sft_with_images_on_two_ranks(tmp_path, vlm_dir):
    """3 steps of SFT on image rows under torchrun (2 ranks, gloo): finite losses that fall;
    the published weights differ from the source in the text model and not in the frozen tower."""
    import os
    import subprocess
    import sys

    from safetensors.torch import load_file

    rows = [image_row(seed, sizes=[SIZES[seed % 2]], reply="abc") for seed in range(4)]
    data = write_rows(tmp_path / "train.jsonl", rows)
    run_dir = tmp_path / "run"
    cfg = tmp_path / "sft.toml"
    cfg.write_text(SFT_TOML.format(run_dir=run_dir, model=vlm_dir, data=data))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node=2",
        f"--master-port={free_port_block(1)}",
        "-m",
        "primerl.sft_entry",
        "@",
        str(cfg),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stdout + out.stderr
    losses = [json.loads(line)["trainer/loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    print("losses", losses)
    assert len(losses) == 3 and all(np.isfinite(losses)) and losses[2] < losses[0], losses

    def tensors(folder):
        return {k: v for f in folder.glob("*.safetensors") for k, v in load_file(f).items()}

    source, published = tensors(vlm_dir), tensors(run_dir / "weights" / "step_2")
    assert sorted(source) == sorted(published)
    tower = [n for n in source if n.startswith("model.visual.")]
    assert tower and all(torch.equal(source[n], published[n]) for n in tower)
    text = [n for n in source if n.startswith("model.language_model.") and n.endswith("proj.weight")]
    assert text and all(not torch.equal(source[n], published[n]) for n in text)
