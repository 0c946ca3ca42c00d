"""Write a validated config back out as TOML (what `--dry-run` prints and runs save)."""

from __future__ import annotations

import typing

import msgspec
import tomli_w


def _drop_none(value: typing.Any) -> typing.Any:
    # TOML has no null: a None field is left out, and loading the file gives the default back.
    # That is exact because every config field that may be None defaults to None
    # (tests/test_config_rules.py checks it for every command's config).
    if isinstance(value, dict):
        return {k: _drop_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_none(v) for v in value]
    return value


def to_toml(config: msgspec.Struct) -> str:
    """The config as a TOML document that loads back into an equal config."""
    return tomli_w.dumps(_drop_none(msgspec.to_builtins(config)))
