"""Config sections of primerl-algos: the loss (trainer side), advantages and filters
(orchestrator side). Loaded without importing torch.

Each `type` names a built-in implementation or a plugin by import path
("my_package.my_module:my_function").
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from primerl_protocol.config import Config

# The built-in names (the registries in losses.py/advantages.py; a test keeps them in step).
BUILTIN_LOSSES = ("aipo", "cispo", "dppo", "gspo", "ppo")
BUILTIN_ADVANTAGES = ("drgrpo", "grpo", "maxrl", "rloo")


def _check_name(kind: str, name: str, builtin: tuple[str, ...]) -> None:
    if name not in builtin and ":" not in name:
        raise ValueError(
            f"unknown {kind} {name!r}: built-in ones are {', '.join(builtin)}; "
            "a plugin is given as 'package.module:function'"
        )


class LossConfig(Config):
    """The policy-gradient loss the trainer optimises (formulas: docs/algorithms.md)."""

    type: str = "aipo"
    """Built-in loss (aipo, cispo, dppo, gspo, ppo) or a plugin `module:function`."""
    ratio_max: Annotated[float, msgspec.Meta(gt=0)] = 8.0
    """aipo: the importance ratio pi/mu is truncated at this value (delta)."""
    eps_low: Annotated[float, msgspec.Meta(ge=0)] = 0.2
    """ppo, gspo, cispo: lower clip range of the ratio, 1 - eps_low."""
    eps_high: Annotated[float, msgspec.Meta(ge=0)] = 0.28
    """ppo, gspo, cispo: upper clip range of the ratio, 1 + eps_high."""
    prob_delta: Annotated[float, msgspec.Meta(gt=0, le=1)] = 0.2
    """dppo: mask tokens whose probability moved more than this towards their advantage."""
    kl_coef: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    """dppo: weight of the squared log-ratio penalty (pi - mu)^2."""
    importance_correction: Literal["none", "tis", "mis"] = "none"
    """Weight token losses by min(r, cap) (tis) or drop tokens with r outside [1/cap, cap] (mis)."""
    importance_cap: Annotated[float, msgspec.Meta(gt=1)] = 2.0
    """The cap of tis/mis."""
    normalization: Literal["tokens", "sequence", "constant"] = "tokens"
    """Divide summed token losses by the batch's loss tokens, per sequence, or a constant."""
    constant: Annotated[float, msgspec.Meta(gt=0)] = 1.0
    """normalization = "constant": loss = sum / (sequences x constant); Dr. GRPO uses the max completion length."""

    def __post_init__(self) -> None:
        _check_name("loss", self.type, BUILTIN_LOSSES)


class AdvantageConfig(Config):
    """How the rewards of a group become advantages (formulas: docs/algorithms.md)."""

    type: str = "grpo"
    """grpo (mean-centred, std-normalised), drgrpo (mean-centred), rloo (leave-one-out),
    maxrl (relative to the group mean), or a plugin `module:function`."""
    length_penalty: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    """Subtract this times (completion tokens / max tokens) from each reward first."""

    def __post_init__(self) -> None:
        _check_name("advantage", self.type, BUILTIN_ADVANTAGES)


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
    """Extra rollout filters by import path (`module:function`, taking a list of rollouts and
    returning a keep flag for each), applied after the built-in ones."""
