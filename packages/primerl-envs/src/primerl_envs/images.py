"""Images of a prompt, read for training: the trainer recomputes what the server's image
processor made of each picture, so the orchestrator keeps the pictures themselves, decoded
(primerl_protocol.images.decode_data_url says what is taken).

A picture is decoded once for the orchestrator's check of its task and the rollouts of its
group (each turn of each rollout holds it again): the last DECODED pictures are kept by URL."""

from __future__ import annotations

from functools import lru_cache

from primerl_protocol.images import Image, decode_data_url

DECODED = 64
"""Pictures kept decoded (by URL): a group's, with room for the groups running beside it."""


def _get(obj, key: str):
    return obj.get(key) if isinstance(obj, dict) else getattr(obj, key, None)


@lru_cache(maxsize=DECODED)
def _decoded(url: str) -> Image:
    return decode_data_url(url)  # an ImageError is raised again for each reader, never cached


def message_images(message) -> list[Image]:
    """The images of a message's content parts (a verifiers message or its dict form), in order."""
    content = _get(message, "content")
    if not isinstance(content, list):
        return []
    out = []
    for part in content:
        if _get(part, "type") != "image_url":
            continue
        url = _get(_get(part, "image_url"), "url")
        out.append(_decoded(url) if isinstance(url, str) else decode_data_url(url))
    return out
