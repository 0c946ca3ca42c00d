"""SFT data: rows of a JSONL or Parquet file (or a `datasets` name) -> token samples whose loss
mask covers only the assistant's tokens.

A row is either {"messages": [{"role", "content"}, ...]} or {"prompt": ..., "completion": ...}
where each is a string (a user / an assistant message) or a list of messages. The model's own
chat template (through its tokenizer) renders the conversation; the tokens each assistant
message adds are found by rendering the conversation up to it: everything the template adds
for the assistant message is trained on, everything else is context.

Images (vision-language models): a message's content may be a list of OpenAI parts,
{"type": "text", "text": ...} and {"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}.
Each image is read once (RGB, inline data URLs only: primerl_protocol.images.decode_data_url)
and must be at a size the model's processor keeps (sides multiples of patch x merge, within its
pixel bounds); the samples then hold it as its file (a 448 x 448 JPEG: ~40 KB against 600 KB of
pixels), decoded again when its row is built. The template renders it as one image token
(Qwen-VL's `<|vision_start|><|image_pad|><|vision_end|>`), which is widened to the image's
tokens as the processor widens it. Image tokens are context, never trained on.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from pathlib import Path

from primerl_algos.types import Sample
from primerl_protocol.images import (
    Image,
    ImageError,
    ImageSpec,
    ModelImages,
    decode_data_url,
    grid_of,
    image_tokens,
    kept_size_problem,
)

log = logging.getLogger("primerl.trainer")


class DataError(ValueError):
    """Bad SFT data: names the file and row."""


def read_rows(path: str) -> list[dict]:
    """Rows from a .jsonl/.json file, a .parquet file, a folder of them, or a `datasets` name."""
    p = Path(path)
    if p.is_dir():
        files = sorted([*p.glob("*.jsonl"), *p.glob("*.parquet")])
        if not files:
            raise DataError(f"{p}: no .jsonl or .parquet files in this folder")
        return [row for f in files for row in read_rows(str(f))]
    if p.suffix in (".jsonl", ".json") and p.exists():
        rows = []
        for i, line in enumerate(p.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise DataError(f"{p}, line {i}: not JSON ({err})") from None
        return rows
    if p.suffix == ".parquet" and p.exists():
        import pyarrow.parquet as pq

        return pq.read_table(p).to_pylist()
    if p.exists():
        raise DataError(f"{p}: unsupported file type (use .jsonl or .parquet)")
    if p.suffix in (".jsonl", ".json", ".parquet") or p.is_absolute() or path.startswith((".", "~")):
        # a file path, not a dataset name: say so, rather than what the Hub says of it
        raise DataError(f"{path}: no such file")
    try:
        import datasets  # pyright: ignore[reportMissingImports]  # optional, not a dependency: for dataset names
    except ImportError:
        raise DataError(f"{path}: no such file, and `datasets` is not installed to load it by name") from None
    try:
        return list(datasets.load_dataset(path, split="train"))
    except Exception as err:  # offline, no such dataset, no train split: named, not a traceback
        raise DataError(
            f"{path}: no such file, and `datasets` cannot load it by name ({type(err).__name__}: {err})"
        ) from None


def _messages(row: dict, where: str) -> list[dict]:
    if "messages" in row:
        msgs = row["messages"]
    elif "prompt" in row and "completion" in row:
        prompt, completion = row["prompt"], row["completion"]
        msgs = ([{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)) + (
            [{"role": "assistant", "content": completion}] if isinstance(completion, str) else list(completion)
        )
    else:
        raise DataError(f"{where}: a row needs `messages`, or `prompt` and `completion`; it has {sorted(row)}")
    if not isinstance(msgs, list) or not all(isinstance(m, dict) and "role" in m and "content" in m for m in msgs):
        raise DataError(f"{where}: messages must be a list of {{role, content}} objects")
    if not any(m["role"] == "assistant" for m in msgs):
        raise DataError(f"{where}: no assistant message to train on")
    return msgs


def tokenize(tokenizer, messages: list[dict], where: str) -> tuple[list[int], list[bool]]:
    """Token ids of the rendered conversation and the mask of the assistants' tokens."""

    def render(msgs, generation_prompt: bool) -> list[int]:
        out = tokenizer.apply_chat_template(msgs, tokenize=True, add_generation_prompt=generation_prompt)
        return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)

    ids = render(messages, False)
    mask = [False] * len(ids)
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start = len(render(messages[:i], True)) if i else 0
        upto = render(messages[: i + 1], False)
        if ids[: len(upto)] != upto:
            raise DataError(
                f"{where}: the chat template renders message {i} differently in longer conversations; "
                "cannot tell which tokens are the assistant's"
            )
        for t in range(start, len(upto)):
            mask[t] = True
    return ids, mask


IMAGE_PARTS = ("image_url", "image")


def _image_url(part: dict) -> object:
    """The URL of an image part: OpenAI's {"image_url": {"url"}} (or a bare string), or
    transformers' {"type": "image", "url" | "image"}."""
    if part.get("type") == "image_url":
        url = part.get("image_url")
        return url.get("url") if isinstance(url, dict) else url
    return part.get("url") or part.get("image")


def split_images(messages: list[dict], where: str) -> tuple[list[dict], list[object]]:
    """The messages as the chat template takes them (each image part {"type": "image"}, a
    part's keys that are None, as Parquet fills them, left out) and the image URLs, in order."""
    out, urls = [], []
    for m in messages:
        content = m["content"]
        if not isinstance(content, list):
            out.append(m)
            continue
        parts = []
        for part in content:
            if not isinstance(part, dict):
                raise DataError(f"{where}: a message's content parts must be objects, got {type(part).__name__}")
            if part.get("type") in IMAGE_PARTS:
                urls.append(_image_url(part))
                parts.append({"type": "image"})
            else:
                parts.append({k: v for k, v in part.items() if v is not None})
        out.append({**m, "content": parts})
    return out, urls


def with_images(
    ids: list[int], mask: list[bool], images: list[Image], spec: ImageSpec, image_token_id: int, where: str
) -> tuple[list[int], list[bool]]:
    """`ids` with each image's single image token widened to its image_tokens (as the
    processor widens it), none of them trained on."""
    slots = [t for t, token in enumerate(ids) if token == image_token_id]
    if len(slots) != len(images):
        raise DataError(
            f"{where}: {len(images)} images but the chat template renders {len(slots)} image tokens "
            f"(id {image_token_id}); each image part must render as one"
        )
    out_ids, out_mask, start = [], [], 0
    for slot, image in zip(slots, images, strict=True):
        n = image_tokens(grid_of(image.height, image.width, spec), spec)
        out_ids += ids[start:slot] + [image_token_id] * n
        out_mask += mask[start:slot] + [False] * n
        start = slot + 1
    return out_ids + ids[start:], out_mask + mask[start:]


def decode_images(urls: list[object], spec: ImageSpec, where: str) -> list[Image]:
    images = []
    for k, url in enumerate(urls, 1):
        try:
            # held as its file; decoded per row. A URL that is not a string (JSON data) is refused
            # by decode_data_url itself (an ImageError naming it), though its parameter says str.
            image = decode_data_url(url, keep_encoded=True)
        except ImageError as err:
            raise DataError(f"{where}, image {k}: {err}") from None
        if (problem := kept_size_problem(image.height, image.width, spec)) is not None:
            raise DataError(f"{where}, image {k}: {problem}")
        images.append(image)
    return images


def load_samples(path: str, tokenizer, seq_len: int, vision: ModelImages | None = None) -> tuple[list[Sample], Counter]:
    """Token samples of a data file; samples longer than seq_len are dropped and counted.
    `vision`: the model's image settings and image token id (None: a text model, which
    refuses rows with images)."""
    samples, dropped = [], Counter()
    for i, row in enumerate(read_rows(path)):
        where = f"{path}, row {i}"
        messages, urls = split_images(_messages(row, where), where)
        images: list[Image] = []
        if urls:
            if vision is None:
                raise DataError(
                    f"{where}: {len(urls)} images, but the model has no vision tower (a text model): "
                    "give a vision-language model or rows without images"
                )
            images = decode_images(urls, vision[0], where)
        ids, mask = tokenize(tokenizer, messages, where)
        if vision is not None:  # also: a text row must not hold image tokens without images
            ids, mask = with_images(ids, mask, images, *vision, where)
        if len(ids) > seq_len:
            dropped["longer_than_seq_len"] += 1
            continue
        if not any(mask):
            dropped["nothing_to_train"] += 1
            continue
        samples.append(
            Sample(sample_id=i, token_ids=ids, loss_mask=mask, inference_logprobs=[0.0] * len(ids), images=images)
        )
    if not samples:
        raise DataError(f"{path}: no usable samples ({dict(dropped) or 'the file is empty'})")
    if dropped:
        log.warning("%s: dropped %s", path, dict(dropped))
    return samples, dropped
