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

`install()` also makes verifiers' score recording strict about what a number is. verifiers
stores `float(value)` of whatever a reward or metric function returned: the string "1.0"
becomes a reward of 1.0, and NaN or infinity pass as they are. Here a value that is not a
number (a string, None, a list; anything without `__float__`) is recorded as NaN and its
`repr` kept in `trace.info["primerl/bad_scores"]`, so `rollouts.trace_to_rollout` can name it
when it marks the rollout errored; scoring goes on (the other rewards are still recorded).

`install()` also memoises pydantic's check of whether a field's `default_factory` takes the
validated data (`pydantic._internal._fields.takes_validated_data_argument`, an
`inspect.signature` of the factory). pydantic 2.14 runs it for every defaulted field of every
`model_construct`, and verifiers builds a graph node that way for each turn: for a builtin
factory such as `list` inspect parses its text signature each time, which was about a fifth of
the orchestrator's CPU time in the reverse-text example (py-spy, 128 rollouts a step). The
answer depends on the factory alone; unhashable factories are checked as before.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

_installed = False
BAD_SCORES = "primerl/bad_scores"
"""Key of trace.info: what each reward or metric that was not a number returned (its repr)."""


def as_score(value: Any) -> float | None:
    """`value` as a float when it is a number (bool, int, float, numpy scalar, 0-d tensor,
    Fraction...), else None. Text is not a number, even text that reads as one."""
    if isinstance(value, (str, bytes, bytearray)) or not hasattr(value, "__float__"):
        return None
    try:
        return float(value)
    except (TypeError, ValueError, OverflowError):  # e.g. a tensor of several elements
        return None


def _strict(trace, kind: str, name: str, value: Any) -> float:
    number = as_score(value)
    if number is None:
        trace.info.setdefault(BAD_SCORES, []).append(f"{kind} {name!r} returned {_shown(value)}, not a number")
        return float("nan")
    return number


def _shown(value: Any) -> str:
    text = repr(value)
    return (text if len(text) <= 80 else text[:80] + "...") + f" ({type(value).__name__})"


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
    """Patch renderers' logprob parser, verifiers' HTTP client and its score recording, and
    memoise pydantic's default-factory check, once per process (idempotent)."""
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

    from verifiers.v1.trace import Trace

    record_reward, record_metric = Trace.record_reward, Trace.record_metric

    def strict_reward(self, name: str, value: Any, weight: Any = 1.0) -> None:
        record_reward(self, name, _strict(self, "reward", name, value), _strict(self, "weight of reward", name, weight))

    def strict_metric(self, name: str, value: Any) -> None:
        record_metric(self, name, _strict(self, "metric", name, value))

    Trace.record_reward, Trace.record_metric = strict_reward, strict_metric

    from pydantic._internal import _fields as pydantic_fields

    takes_data = pydantic_fields.takes_validated_data_argument
    remembered = functools.lru_cache(maxsize=4096)(takes_data)

    def takes_validated_data_argument(default_factory) -> bool:
        try:
            return remembered(default_factory)
        except TypeError:  # an unhashable factory
            return takes_data(default_factory)

    pydantic_fields.takes_validated_data_argument = takes_validated_data_argument
    _installed = True
