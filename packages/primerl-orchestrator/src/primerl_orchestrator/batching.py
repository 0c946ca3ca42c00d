"""Finished groups -> one step's TrainBatches (one per trainer rank) and the step's metrics.

    batches, metrics = build_step(step, groups, cfg, seq_len=4096, num_ranks=8)

Filters, then advantages per group (primerl_algos.filters.select), then each kept rollout's
turns merged into samples (merging.merge_turns), samples longer than a row dropped and
counted, then packed and balanced over the ranks (packing; with `share_prompts`, the samples
of one prompt laid with that prompt once: packing.shared_prompts). A step whose groups leave
nothing to train on still gets its batches (padding rows only, the trainer steps on nothing),
so step numbers never skip.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
from primerl_algos.filters import select
from primerl_algos.merging import merge_turns
from primerl_algos.packing import build_batches, plan_packing, shared_prompts
from primerl_algos.types import Sample
from primerl_protocol.rollouts import Rollout


@dataclass
class Group:
    """The rollouts of one task (group_size episodes), as the loop collects them."""

    group_id: int
    env: str
    position: int
    """The task's position in its environment's task stream (for resuming)."""
    rollouts: list[Rollout] = field(default_factory=list)
    advantages: dict[int, float] = field(default_factory=dict)
    """Sample id -> advantage of its rollouts that train (filled by build_step)."""

    @property
    def policy_step(self) -> int:
        """The oldest policy any of its rollouts started on."""
        return min((r.policy_step for r in self.rollouts), default=0)


def _stats(prefix: str, values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    a = np.asarray(values, dtype=np.float64)
    return {f"{prefix}/mean": float(a.mean()), f"{prefix}/min": float(a.min()), f"{prefix}/max": float(a.max())}


def rollout_metrics(rollouts: list[Rollout]) -> dict[str, float]:
    """Rewards (overall, per environment, and each named reward as `reward/<name>`), the
    environments' own metrics (`metric/<name>`), truncation and error rates, lengths. Named
    rewards and metrics are means over the rollouts that recorded them (errored ones excluded)."""
    n = len(rollouts)
    if not n:
        return {}
    clean = [r for r in rollouts if r.error is None]
    out = _stats("reward", [r.reward for r in clean])
    by_env: dict[str, list[float]] = defaultdict(list)
    named: dict[str, list[float]] = defaultdict(list)
    for r in clean:
        by_env[r.env].append(r.reward)
        for key, value in r.metrics.items():  # rollouts.trace_to_rollout names rewards reward/<name>
            named[key if key.startswith("reward/") else f"metric/{key}"].append(value)
    for env, rewards in sorted(by_env.items()):
        out[f"reward/{env}/mean"] = float(np.mean(rewards))
    for key, values in sorted(named.items()):
        # a reward named mean, min or max would overwrite the totals: it gets a suffix
        out[key if key not in out else f"{key}_reward"] = float(np.mean(values))
    out["rollouts/count"] = float(n)
    out["rollouts/truncated_rate"] = sum(r.truncated for r in rollouts) / n
    out["rollouts/error_rate"] = (n - len(clean)) / n
    out |= _stats("rollouts/completion_tokens", [float(r.num_completion_tokens) for r in rollouts])
    return out


def build_step(
    step: int,
    groups: list[Group],
    cfg,
    *,
    seq_len: int,
    num_ranks: int,
    pad_token_id: int = 0,
) -> tuple[list, dict[str, float]]:
    """(TrainBatch per rank, metrics) of `step` from `groups`, with `cfg` an OrchestratorConfig."""
    rollouts = [r for g in groups for r in g.rollouts]
    kept, report = select(rollouts, cfg.filters, cfg.advantage, cfg.sampling.max_tokens)
    samples: list[Sample] = []
    too_long = 0
    trained: set[int] = set()
    by_group = {g.group_id: g for g in groups}
    for rollout, advantage in kept:
        for sample in merge_turns(rollout, advantage):
            if len(sample) > seq_len:
                too_long += 1
            else:
                samples.append(sample)
                trained.add(rollout.sample_id)
                by_group[rollout.group_id].advantages[rollout.sample_id] = advantage
    shared = shared_prompts(samples, seq_len) if cfg.share_prompts else []
    plan = plan_packing([len(s) for s in samples], seq_len, num_ranks, shared=shared)
    batches = build_batches(samples, plan, step, pad_token_id)
    metrics = rollout_metrics(rollouts)
    for reason, count in sorted(report.dropped.items()):
        metrics[f"filter/{reason}"] = float(count)
    metrics["filter/longer_than_row"] = float(too_long)
    metrics["rollouts/trained"] = float(len(trained))
    metrics["rollouts/filtered"] = float(len(rollouts) - len(trained))
    metrics["batch/samples"] = float(len(samples))
    if images := sum(len(s.images) for s in samples):
        metrics["batch/images"] = float(images)
    metrics["batch/loss_tokens"] = float(batches[0].num_loss_tokens)
    metrics["batch/rows_per_rank"] = float(plan.rows_per_rank)
    metrics["batch/sample_tokens"] = float(sum(len(s) for s in samples))
    metrics["batch/row_tokens"] = metrics["batch/sample_tokens"] - sum(n for _, n in plan.prefixes.values())
    if samples:
        lag = np.array([step - s.policy_step for s in samples], dtype=np.float64)
        metrics["off_policy/mean"] = float(lag.mean())
        metrics["off_policy/max"] = float(lag.max())
    return batches, metrics
