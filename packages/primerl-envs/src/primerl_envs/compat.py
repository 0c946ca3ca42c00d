"""Compatibility between verifiers' training client and the vLLM that serves it.

verifiers' `TrainClient` (through `renderers` 0.1.12) calls vLLM's `/inference/v1/generate`
and expects each completion logprob entry as `{"token": "token_id:N", "logprob": x}`, the
shape of the endpoint's text mode. vLLM 0.32's default tokens mode answers
`{"token_id": N, "logprob": x}` instead, so every call failed with "logprobs.content[0].token
must be 'token_id:N'". `install()` teaches the parser the tokens-mode shape: an entry whose
integer `token_id` matches is read as its placeholder string. Nothing else changes; a
mismatching token id is still refused by renderers' own check.

`install()` also gives verifiers' model clients an HTTP client on aiohttp (httpx-aiohttp's
`HttpxAiohttpClient`: httpx's interface, exceptions mapped to httpx's) instead of httpx's own
connection pool, whose bookkeeping scans every connection on every request event (quadratic
in the connections: with 64 rollouts in flight it took about a third of the orchestrator's
CPU, bench/orchestrator.py). Timeouts and limits stay verifiers' own.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

_installed = False


def _normalise(choice: Mapping[str, Any]) -> Mapping[str, Any]:
    logprobs = choice.get("logprobs")
    content = logprobs.get("content") if isinstance(logprobs, Mapping) else None
    if not isinstance(content, list) or not content:
        return choice
    if not all(isinstance(e, Mapping) and "token" not in e and "token_id" in e for e in content):
        return choice
    entries = [{**e, "token": f"token_id:{e['token_id']}"} for e in content]
    return {**choice, "logprobs": {**logprobs, "content": entries}}


def install() -> None:
    """Patch renderers' logprob parser and verifiers' HTTP client once per process (idempotent)."""
    global _installed
    if _installed:
        return
    from renderers import client as renderers_client

    original = renderers_client._parse_completion_logprobs

    def parse(choice: Mapping[str, Any], completion_ids: list[int]) -> list[float]:
        return original(_normalise(choice), completion_ids)

    renderers_client._parse_completion_logprobs = parse

    import httpx
    from httpx_aiohttp import HttpxAiohttpClient
    from verifiers.v1.clients import base as vf_base

    def build_async_httpx(config) -> httpx.AsyncClient:
        return HttpxAiohttpClient(timeout=httpx.Timeout(**config.timeout.model_dump()), limits=vf_base.DEFAULT_LIMITS)

    vf_base.build_async_httpx = build_async_httpx
    _installed = True
