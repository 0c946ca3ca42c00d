"""Write a validated config back out as TOML (what `--dry-run` prints and runs save)."""

from __future__ import annotations

import os
import typing
from pathlib import Path

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


def write_private(path: str | Path, text: str) -> None:
    """Write `text` readable by its owner only (0600, whatever the umask): configs of a run
    hold its admin token, which lets whoever reads it swap the servers' weights."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)  # an existing file keeps its mode through O_CREAT
        os.write(fd, text.encode())
    finally:
        os.close(fd)
