"""Rollouts: what an environment's episode leaves for the orchestrator and the algorithms.

A rollout is one episode of a task: one or more turns (the exact prompt tokens each model call
saw and the tokens it sampled, with their inference logprobs), a reward, maybe an error.
Plain msgspec Structs with no torch behind them, so primerl-envs makes them without
installing the trainer's stack, and the orchestrator can checkpoint them.
"""

from __future__ import annotations

import math

import msgspec

from primerl_protocol.images import Image

TRACEBACK_CHARS = 16_000
"""Most characters of a traceback a rollout keeps (its first and last halves: a chain's root
cause comes first, the exception finally raised last)."""
BAD_SCORE = "BadScore"
"""Error type of a rollout whose reward or metric was not a finite number (it never trains,
whatever the filters say: `Rollout.bad_score`)."""


class Turn(msgspec.Struct, kw_only=True):
    """One model call: the exact prompt tokens it saw and the tokens it sampled."""

    prompt_ids: list[int]
    completion_ids: list[int]
    completion_logprobs: list[float]
    """Inference logprob of each completion token."""
    images: list[Image] = []
    """The prompt's images, in the order of their placeholder runs in `prompt_ids` (a
    vision-language model's server expanded each image to its run of image tokens)."""


class Rollout(msgspec.Struct, kw_only=True):
    """One episode of a task, with what the orchestrator knows about it."""

    sample_id: int
    """Unique id of this rollout."""
    group_id: int
    """Rollouts of the same task (compared by the advantage) share a group id."""
    turns: list[Turn]
    reward: float = 0.0
    temperature: float = 1.0
    policy_step: int = 0
    """The policy step of the weights that generated it."""
    truncated: bool = False
    """Cut at the token or turn limit rather than finished."""
    error: str | None = None
    """What went wrong in the environment, if anything (such rollouts never train)."""
    traceback: str | None = None
    """The traceback of the exception behind `error`, when there was one (at most
    TRACEBACK_CHARS characters); the orchestrator logs the first of each kind."""
    env: str = ""
    """Which environment it came from."""
    metrics: dict[str, float] = {}
    """Per-rollout metrics the environment recorded (its named rewards and metrics)."""

    @property
    def num_completion_tokens(self) -> int:
        return sum(len(t.completion_ids) for t in self.turns)

    @property
    def bad_score(self) -> bool:
        """Its environment scored it with something that is not a finite number."""
        return (self.error or "").startswith(BAD_SCORE) or not math.isfinite(self.reward)


class RolloutSample(msgspec.Struct, kw_only=True):
    """One rollout as text, for people to read: a line of the run's rollouts file and a row of
    the W&B samples table (primerl_orchestrator.samples makes them every few steps)."""

    step: int
    """The trainer step whose batch the rollout was part of."""
    policy_step: int
    """The policy that generated it."""
    env: str
    group_id: int
    sample_id: int
    prompt: str
    """The first model call's prompt, decoded (chat template and special tokens included)."""
    completion: str
    """Everything after that prompt, decoded: the sampled tokens, and for a multi-turn rollout
    the tool results and user turns in between."""
    reward: float
    rewards: dict[str, float] = {}
    """The environment's named rewards (and metrics), as it scored them."""
    advantage: float | None = None
    """Its advantage, or None when it did not train (filtered, or longer than a row)."""
    error: str | None = None
    truncated: bool = False
    completion_tokens: int = 0
