"""Config section of primerl-envs: which verifiers environments to train and evaluate on."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from primerl_protocol.config import Config


class EnvConfig(Config):
    """One verifiers environment and its arguments."""

    id: str
    """Built-in name (reverse-text, ...), an installed package, or a local module path."""
    args: dict[str, Any] = {}
    """Keyword arguments passed to the environment's loader."""
    weight: Annotated[float, msgspec.Meta(gt=0)] = 1.0
    """Share of training tasks drawn from this environment, relative to the others."""
    mode: Literal["in_process", "server"] = "in_process"
    """Run the environment inside the orchestrator, or served as a separate process."""


class EnvsConfig(Config):
    """Training mix and eval environments."""

    train: list[EnvConfig] = []
    """Environments tasks are drawn from for training, in proportion to their weights."""
    eval: list[EnvConfig] = []
    """Environments used for evals (online and `primerl eval`)."""
