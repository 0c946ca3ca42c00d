"""Which rollouts and groups reach the trainer. Every drop is counted under its reason.

    kept, report = select(rollouts, filter_cfg, advantage_cfg, max_tokens)

1. Rollout filters, in order: bad score (a reward or metric that was not a finite number;
   always on), errored, empty (no completion tokens), truncated, too short, too long, reward
   outside the range, then plugins. A dropped rollout takes no part in its group's advantage
   (an errored rollout's reward means nothing): the baseline is the other members'.
2. Advantages per group over the remaining rollouts; a group whose advantages are not all
   finite (a plugin estimator's fault) is dropped (`non_finite_advantage`).
3. Group filter: groups whose advantages are all zero carry no gradient and are dropped.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from primerl_protocol.rollouts import Rollout

from primerl_algos.advantages import compute_advantages
from primerl_algos.config import AdvantageConfig, FilterConfig
from primerl_algos.registry import Registry

ROLLOUT_FILTERS: Registry = Registry("filter")


@dataclass
class FilterReport:
    """Rollouts dropped per reason, and what was kept."""

    dropped: Counter = field(default_factory=Counter)
    kept: int = 0

    def merge(self, other: FilterReport) -> None:
        self.dropped.update(other.dropped)
        self.kept += other.kept

    @property
    def total(self) -> int:
        return self.kept + sum(self.dropped.values())


def _reason(r: Rollout, cfg: FilterConfig) -> str | None:
    tokens = r.num_completion_tokens
    if r.bad_score:  # not configurable: a NaN or infinite reward must never reach the weights
        return "bad_score"
    if cfg.errored and r.error is not None:
        return "errored"
    if cfg.empty and tokens == 0:
        return "empty"
    if cfg.truncated and r.truncated:
        return "truncated"
    if tokens < cfg.min_tokens:
        return "too_short"
    if cfg.max_tokens is not None and tokens > cfg.max_tokens:
        return "too_long"
    if cfg.reward_range is not None and not cfg.reward_range[0] <= r.reward <= cfg.reward_range[1]:
        return "reward_out_of_range"
    return None


def filter_rollouts(rollouts: Sequence[Rollout], cfg: FilterConfig) -> tuple[list[Rollout], FilterReport]:
    report = FilterReport()
    kept = []
    for r in rollouts:
        reason = _reason(r, cfg)
        if reason is None:
            kept.append(r)
        else:
            report.dropped[reason] += 1
    for name in cfg.plugins:
        flags = list(ROLLOUT_FILTERS.get(name)(kept))
        if len(flags) != len(kept):
            raise ValueError(f"filter plugin {name!r} returned {len(flags)} flags for {len(kept)} rollouts")
        report.dropped[name] += flags.count(False)
        kept = [r for r, keep in zip(kept, flags) if keep]
    report.kept = len(kept)
    return kept, report


def select(
    rollouts: Sequence[Rollout],
    filters: FilterConfig,
    advantage: AdvantageConfig,
    max_tokens: int,
) -> tuple[list[tuple[Rollout, float]], FilterReport]:
    """(rollout, advantage) pairs that train, and the report of everything dropped."""
    kept, report = filter_rollouts(rollouts, filters)
    groups: dict[int, list[Rollout]] = defaultdict(list)
    for r in kept:
        groups[r.group_id].append(r)
    out: list[tuple[Rollout, float]] = []
    for members in groups.values():
        adv = compute_advantages(
            [r.reward for r in members], [r.num_completion_tokens for r in members], advantage, max_tokens
        )
        if not np.all(np.isfinite(adv)):  # a plugin's estimator, or a length penalty gone wrong
            report.dropped["non_finite_advantage"] += len(members)
            report.kept -= len(members)
            continue
        if filters.zero_advantage and not adv.any():
            report.dropped["zero_advantage"] += len(members)
            report.kept -= len(members)
            continue
        out.extend(zip(members, adv.tolist()))
    return out, report
