"""primerl's patches of other packages (`PATCHES`): each named, with the versions it was
written for (a warning when another is installed, a test that fails) and when to remove it,
applied once by `install()` from the entry of each process that runs environments.

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
import itertools
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("primerl.envs")

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
    if not isinstance(logprobs, Mapping):
        return choice
    content = logprobs.get("content")
    if not isinstance(content, list) or not content:
        return choice
    if not all(isinstance(e, Mapping) and "token" not in e and "token_id" in e for e in content):
        return choice
    entries = [{**e, "token": f"token_id:{e['token_id']}"} for e in content]
    return {**choice, "logprobs": {**logprobs, "content": entries}}


def _version(text: str) -> tuple[int, ...]:
    """The leading numbers of a version string: "2.14.4" -> (2, 14, 4), "0.1.12.dev1" -> (0, 1, 12)."""
    out = []
    for part in text.split("."):
        digits = "".join(itertools.takewhile(str.isdigit, part))
        if not digits:
            break
        out.append(int(digits))
        if digits != part:
            break
    return tuple(out)


@dataclass(frozen=True)
class Patch:
    """One change primerl makes to another package, with what it was written for."""

    name: str
    package: str
    """The distribution whose code it changes (its installed version is checked)."""
    versions: tuple[str, str]
    """[lowest, first past) of the versions it was written and tested against."""
    remove_when: str
    """When the patch is no longer needed, so that it can be removed."""
    apply: Callable[[], None]

    def installed(self) -> str:
        from importlib.metadata import version

        return version(self.package)

    def covers(self, installed: str) -> bool:
        low, past = self.versions
        return _version(low) <= _version(installed) < _version(past)


def _renderers_token_ids() -> None:
    from renderers import client as renderers_client

    original = renderers_client._parse_completion_logprobs

    def parse(choice: Mapping[str, Any], completion_ids: list[int]) -> list[float]:
        return original(_normalise(choice), completion_ids)

    renderers_client._parse_completion_logprobs = parse


def _verifiers_aiohttp_client() -> None:
    import httpx
    from httpx_aiohttp import HttpxAiohttpClient
    from verifiers.v1.clients import base as vf_base

    def build_async_httpx(config) -> httpx.AsyncClient:
        return HttpxAiohttpClient(timeout=httpx.Timeout(**config.timeout.model_dump()), limits=vf_base.DEFAULT_LIMITS)

    vf_base.build_async_httpx = build_async_httpx


def _verifiers_strict_scores() -> None:
    from verifiers.v1.trace import Trace

    record_reward, record_metric = Trace.record_reward, Trace.record_metric

    def strict_reward(self, name: str, value: Any, weight: Any = 1.0) -> None:
        record_reward(self, name, _strict(self, "reward", name, value), _strict(self, "weight of reward", name, weight))

    def strict_metric(self, name: str, value: Any) -> None:
        record_metric(self, name, _strict(self, "metric", name, value))

    Trace.record_reward, Trace.record_metric = strict_reward, strict_metric


def _pydantic_factory_check_memo() -> None:
    from pydantic._internal import _fields as pydantic_fields

    takes_data = pydantic_fields.takes_validated_data_argument
    remembered = functools.lru_cache(maxsize=4096)(takes_data)

    def takes_validated_data_argument(default_factory) -> bool:
        try:
            return remembered(default_factory)
        except TypeError:  # an unhashable factory
            return takes_data(default_factory)

    pydantic_fields.takes_validated_data_argument = takes_validated_data_argument


PATCHES = (
    Patch(
        "renderers' logprob parser reads vLLM's tokens-mode entries",
        "renderers",
        ("0.1.12", "0.1.13"),
        'renderers accepts {"token_id": N} entries, or vLLM answers token_id:N strings in tokens mode',
        _renderers_token_ids,
    ),
    Patch(
        "verifiers' model clients on aiohttp",
        "verifiers",
        ("0.4.0", "0.4.1"),
        "httpx's pool no longer scans every connection per request event, or verifiers builds its own "
        "client on aiohttp (measure bench/orchestrator.py with and without)",
        _verifiers_aiohttp_client,
    ),
    Patch(
        "verifiers' score recording strict about numbers",
        "verifiers",
        ("0.4.0", "0.4.1"),
        "verifiers refuses rewards and metrics that are not numbers itself",
        _verifiers_strict_scores,
    ),
    Patch(
        "pydantic's default-factory check memoised",
        "pydantic",
        ("2.14.0", "2.15.0"),
        "pydantic caches takes_validated_data_argument (or no longer calls it per model_construct)",
        _pydantic_factory_check_memo,
    ),
)
"""Every patch, applied in this order by `install`."""


def install() -> None:
    """Apply every patch of PATCHES once per process (idempotent), from the entry of each process
    that runs environments (the orchestrator, `primerl eval`, an environment's server). A patch
    whose package is at a version it was not written for is still applied, with a warning that
    names it, the versions and when to remove it (tests/test_compat_patches fails then, so a
    dependency bump cannot pass unnoticed); one whose target is gone fails naming it."""
    global _installed
    if _installed:
        return
    for patch in PATCHES:
        installed = patch.installed()
        if not patch.covers(installed):
            log.warning(
                "primerl patch %r was written for %s %s to before %s, and %s is installed: check whether it "
                "is still needed and right (remove it when %s)",
                patch.name,
                patch.package,
                *patch.versions,
                installed,
                patch.remove_when,
            )
        try:
            patch.apply()
        except (ImportError, AttributeError) as err:
            raise RuntimeError(
                f"primerl patch {patch.name!r} cannot be applied to {patch.package} {installed} "
                f"({type(err).__name__}: {err}); it was written for {patch.versions[0]} to before "
                f"{patch.versions[1]}"
            ) from None
    _installed = True
