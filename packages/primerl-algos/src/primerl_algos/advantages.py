"""Advantages of the rollouts of one group (one task, group_size rollouts), from their rewards.

With rewards r_1..r_G (after the optional length penalty r - lambda * tokens / max_tokens),
mean m and population standard deviation s:

  grpo    A_i = (r_i - m) / (s + 1e-6)
  drgrpo  A_i = r_i - m
  rloo    A_i = r_i - mean_{j != i} r_j = G / (G - 1) (r_i - m)      (0 when G = 1)
  maxrl   A_i = (r_i - m) / m  where m > 0, else 0

A group whose rewards are all equal gets zero advantages under every estimator.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from primerl_algos.config import AdvantageConfig
from primerl_algos.registry import Registry

AdvantageFn = Callable[[np.ndarray], np.ndarray]
ADVANTAGES: Registry[AdvantageFn] = Registry("advantage")
EPS = 1e-6


@ADVANTAGES.register("grpo")
def grpo(rewards: np.ndarray) -> np.ndarray:
    centred = rewards - rewards.mean()
    return centred / (rewards.std() + EPS)


@ADVANTAGES.register("drgrpo")
def drgrpo(rewards: np.ndarray) -> np.ndarray:
    return rewards - rewards.mean()


@ADVANTAGES.register("rloo")
def rloo(rewards: np.ndarray) -> np.ndarray:
    g = len(rewards)
    if g < 2:
        return np.zeros_like(rewards)
    return g / (g - 1) * (rewards - rewards.mean())


@ADVANTAGES.register("maxrl")
def maxrl(rewards: np.ndarray) -> np.ndarray:
    m = rewards.mean()
    if m <= 0:
        return np.zeros_like(rewards)
    return (rewards - m) / m


def compute_advantages(
    rewards: Sequence[float],
    completion_tokens: Sequence[int],
    cfg: AdvantageConfig,
    max_tokens: int,
) -> np.ndarray:
    """Advantages [G] (float64) of one group."""
    r = np.asarray(rewards, dtype=np.float64)
    if len(r) == 0:
        return r
    if cfg.length_penalty:
        r = r - cfg.length_penalty * np.asarray(completion_tokens, dtype=np.float64) / max_tokens
    if np.all(r == r[0]):
        return np.zeros_like(r)
    out = np.asarray(ADVANTAGES.get(cfg.type)(r), dtype=np.float64)
    if out.shape != r.shape:
        raise ValueError(f"advantage {cfg.type!r} returned shape {out.shape} for {len(r)} rewards")
    return out
