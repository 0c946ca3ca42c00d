"""The data the algorithms work on: rollouts (as the orchestrator collects them) and samples
(token sequences ready to train on). msgspec Structs, so the orchestrator can checkpoint them.

A rollout is one episode of an environment: one or more turns, a reward, maybe an error.
Trajectory merging (merging.py) turns its turns into one or more samples; advantages
(advantages.py) and filters (filters.py) work on groups of rollouts of the same task; packing
(packing.py) lays samples into the trainer's rows.
"""

from __future__ import annotations

import math

import msgspec

BAD_SCORE = "BadScore"
"""Error type of a rollout whose reward or metric was not a finite number (it never trains,
whatever the filters say: `Rollout.bad_score`)."""


class Turn(msgspec.Struct, kw_only=True):
    """One model call: the exact prompt tokens it saw and the tokens it sampled."""

    prompt_ids: list[int]
    completion_ids: list[int]
    completion_logprobs: list[float]
    """Inference logprob of each completion token."""


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


class Sample(msgspec.Struct, kw_only=True):
    """One token sequence to train on: prompt and completion tokens, with per-token data."""

    sample_id: int
    """The rollout it came from."""
    part: int = 0
    """Which sample of that rollout (multi-turn rollouts whose turns do not extend each other
    give several)."""
    token_ids: list[int]
    loss_mask: list[bool]
    """True for tokens the policy sampled (trained on); False for prompt and environment tokens."""
    inference_logprobs: list[float]
    """Inference logprob per token (0.0 where not sampled)."""
    advantage: float = 0.0
    temperature: float = 1.0
    policy_step: int = 0

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if len(self.loss_mask) != n or len(self.inference_logprobs) != n:
            raise ValueError(
                f"sample {self.sample_id}: token_ids ({n}), loss_mask ({len(self.loss_mask)}) and "
                f"inference_logprobs ({len(self.inference_logprobs)}) differ in length"
            )

    def __len__(self) -> int:
        return len(self.token_ids)
