"""Config sections of primerl-algos: the loss (trainer side), advantages and filters
(orchestrator side). Loaded without importing torch.

Each `type` names a built-in implementation or a plugin by import path
("my_package.my_module:my_function").
"""

from __future__ import annotations

from typing import Literal

from primerl_protocol.config import Config


class LossConfig(Config):
    """The policy-gradient loss the trainer optimises."""

    type: str = "aipo"
    """Built-in loss name (aipo, ppo, dppo, gspo, cispo) or a plugin `module:function`."""
    ratio_max: float = 8.0
    """AIPO: the importance ratio pi/mu is truncated at this value (delta)."""
    eps_low: float = 0.2
    """PPO/GRPO clip: lower clip range of the ratio (1 - eps_low)."""
    eps_high: float = 0.28
    """PPO/GRPO clip: upper clip range of the ratio (1 + eps_high)."""
    normalization: Literal["tokens", "sequence", "constant"] = "tokens"
    """Divide the summed token losses by the batch's loss tokens, per sequence, or a constant."""
    constant: float = 1.0
    """The divisor when normalization = "constant" (Dr. GRPO uses the max completion length)."""


class AdvantageConfig(Config):
    """How rewards of a group become per-token advantages."""

    type: str = "grpo"
    """Built-in estimator (grpo, drgrpo, rloo, maxrl) or a plugin `module:function`."""
    std_normalize: bool = False
    """Divide group-centred rewards by the group's standard deviation."""
    length_penalty: float = 0.0
    """Subtract this times (completion tokens / max tokens) from each reward."""


class FilterConfig(Config):
    """Which rollouts and groups never reach the trainer (each drop is counted and reported)."""

    zero_advantage: bool = True
    """Drop groups whose advantages are all zero (they carry no gradient)."""
    errored: bool = True
    """Drop rollouts whose environment raised."""
    empty: bool = True
    """Drop rollouts with no completion tokens."""
    truncated: bool = False
    """Drop rollouts cut at the token or turn limit."""
    min_tokens: int = 0
    """Drop rollouts with fewer completion tokens than this."""
    max_tokens: int | None = None
    """Drop rollouts with more completion tokens than this."""
    reward_range: tuple[float, float] | None = None
    """Drop rollouts whose reward falls outside [low, high]."""
    plugins: list[str] = []
    """Extra filters by import path (`module:function`), applied after the built-in ones."""
