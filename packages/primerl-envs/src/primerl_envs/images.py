"""Images of a prompt, read for training: the trainer recomputes what the server's image
processor made of each picture, so the orchestrator keeps the pictures themselves, decoded
(primerl_protocol.images.decode_data_url says what is taken)."""

from __future__ import annotations

from primerl_protocol.images import ImageError, decode_data_url
from primerl_protocol.rollouts import Image

__all__ = ["ImageError", "decode_data_url", "message_images"]


def _get(obj, key: str):
    return obj.get(key) if isinstance(obj, dict) else getattr(obj, key, None)


def message_images(message, cache: dict[str, Image]) -> list[Image]:
    """The images of a message's content parts (a verifiers message or its dict form), in
    order (`cache`: by URL)."""
    content = _get(message, "content")
    if not isinstance(content, list):
        return []
    out = []
    for part in content:
        if _get(part, "type") != "image_url":
            continue
        url = _get(_get(part, "image_url"), "url")
        image = cache.get(url)
        if image is None:
            image = cache[url] = decode_data_url(url)
        out.append(image)
    return out
