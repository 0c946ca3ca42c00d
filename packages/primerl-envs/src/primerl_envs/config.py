"""Config section of primerl-envs: which verifiers environments to train and evaluate on."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from primerl_protocol.config import Config, Positive


class EnvConfig(Config):
    """One verifiers environment and its arguments."""

    id: str
    """Built-in name (reverse-text, alphabet-sort, math, tool-use, code, shapes, swe, terminal, search), an installed taskset
    package's id, or the path of a local module (a .py file or a package folder)."""
    args: dict[str, Any] = {}
    """Fields of the taskset's config (verifiers `TasksetConfig`), e.g. `num_tasks`."""
    name: str | None = None
    """Name in metrics and logs (default: the id, without a path)."""
    weight: Annotated[float, msgspec.Meta(gt=0)] = 1.0
    """Share of training tasks drawn from this environment, relative to the others."""
    mode: Literal["in_process", "server"] = "in_process"
    """Run the environment inside the orchestrator, or served by a separate process
    (verifiers' env server over ZeroMQ)."""
    harness: str = "primerl-chat"
    """verifiers harness that plays the tasks (primerl's in-process chat loop by default;
    `null` is verifiers' own, one process per rollout)."""
    max_turns: Positive | None = None
    """Most model calls per rollout; the rollout is cut there (marked truncated)."""
    max_episode_tokens: Positive | None = None
    """Most tokens the model may generate over one rollout (all its turns); the rollout is cut
    once its turns reach it (checked between turns, so the turn that crosses it completes;
    marked truncated). Each turn's own bound is orchestrator.sampling.max_tokens."""
    timeout_s: Annotated[float, msgspec.Meta(gt=0)] | None = None
    """Wall-clock limit of one rollout in seconds; the rollout is cut there (an error)."""
    batch_groups: bool = True
    """Single-turn tasks without tools (primerl_envs.single_turn decides which, at start): a
    group's rollouts go to the server as one request for group_size replies and are scored
    without an episode each (same prompt tokens, rewards and metrics). false: every rollout
    runs as its own verifiers episode."""

    @property
    def display_name(self) -> str:
        if self.name:
            return self.name
        return self.id.rstrip("/").rsplit("/", 1)[-1].removesuffix(".py")


class EnvsConfig(Config):
    """Training mix and eval environments."""

    train: list[EnvConfig] = []
    """Environments tasks are drawn from for training, in proportion to their weights."""
    eval: list[EnvConfig] = []
    """Environments used for evals (online and `primerl eval`)."""
