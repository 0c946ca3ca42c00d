"""Evals: k rollouts of each task of the eval environments, scored as avg@k and pass@k.

For a task with n rollouts of which c solved it (reward >= the pass threshold):
  avg@k   mean reward over the k rollouts, averaged over tasks
  pass@k  1 - C(n - c, k) / C(n, k), the unbiased estimate of "at least one of k solves it"
          (Chen et al., 2021), averaged over tasks; with n = k it is 1 if any rollout solved it
  pass@1  c / n averaged over tasks
Errored rollouts count as unsolved with reward 0 (and are reported as `error_rate`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from pathlib import Path

from primerl_envs.environment import Environment

from primerl_orchestrator.config import EvalRunConfig
from primerl_orchestrator.generate import Generator, open_environments, start_generator

log = logging.getLogger("primerl.orchestrator")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k rollouts drawn without replacement from n (c of
    them correct) is correct."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def score_tasks(rewards_per_task: list[list[float]], k: int, threshold: float) -> dict[str, float]:
    """avg@k, pass@1 and pass@k over tasks, each given its list of n >= k rewards."""
    if not rewards_per_task:
        return {}
    avg, p1, pk = [], [], []
    for rewards in rewards_per_task:
        n, c = len(rewards), sum(r >= threshold for r in rewards)
        avg.append(sum(rewards) / n)
        p1.append(c / n)
        pk.append(pass_at_k(n, c, k))
    t = len(rewards_per_task)
    return {f"avg@{k}": sum(avg) / t, "pass@1": sum(p1) / t, f"pass@{k}": sum(pk) / t}


async def evaluate(
    envs: list[Environment], gen: Generator, settings, *, max_tokens: int, concurrency: int,
) -> dict[str, float]:
    """`eval/<env>/...` metrics of every environment in `envs` (EvalSettings `settings`).
    A single-turn environment's k samples of a task go as one request (Generator.play_group);
    `concurrency` bounds the rollouts in flight either way."""
    k = settings.num_samples
    limit = asyncio.Semaphore(concurrency)
    group_limit = asyncio.Semaphore(max(1, concurrency // k))
    sampling = {"temperature": settings.temperature}
    out: dict[str, float] = {}
    t0 = time.monotonic()

    async def task_rollouts(env, task, task_index: int) -> list:
        ids = [task_index * k + i for i in range(k)]
        if env.single_turn is not None:
            async with group_limit:
                group = await gen.play_group(env, task, sample_ids=ids, group_id=task_index,
                                             max_tokens=max_tokens, sampling=sampling)
            if group is not None:
                return group

        async def one(sample_id: int):
            async with limit:
                rollouts = await gen.play(env, task, sample_id=sample_id, group_id=task_index,
                                          max_tokens=max_tokens, sampling=sampling)
            return rollouts[0]

        return list(await asyncio.gather(*(one(i) for i in ids)))

    for env in envs:
        n_tasks = len(env.tasks) if settings.max_tasks is None else min(settings.max_tasks, len(env.tasks) or settings.max_tasks)
        if n_tasks == 0:
            raise ValueError(f"eval environment {env.name!r} has an endless taskset: set eval.max_tasks")
        tasks = [env.tasks.at(i) for i in range(n_tasks)]
        per_task = await asyncio.gather(*(task_rollouts(env, t, ti) for ti, t in enumerate(tasks)))
        results = [((0.0 if r.error else r.reward), r.error is not None, r.num_completion_tokens)
                   for rollouts in per_task for r in rollouts]
        rewards = [[results[ti * k + i][0] for i in range(k)] for ti in range(n_tasks)]
        for name, value in score_tasks(rewards, k, settings.pass_threshold).items():
            out[f"eval/{env.name}/{name}"] = value
        out[f"eval/{env.name}/error_rate"] = sum(e for _, e, _ in results) / len(results)
        out[f"eval/{env.name}/completion_tokens"] = sum(t for _, _, t in results) / len(results)
        out[f"eval/{env.name}/tasks"] = float(n_tasks)
    out["time/eval"] = time.monotonic() - t0
    return out


def published_steps(run: str | Path) -> list[tuple[int, Path, str, str]]:
    """(step, folder, checksum, format) of every complete published folder of a run, in order
    (format: full weights or a LoRA adapter, primerl_protocol.weights)."""
    from primerl_protocol import rundir
    from primerl_protocol.weights import MARKER, format_of

    out = []
    for step, folder in rundir.complete_steps(Path(run) / rundir.WEIGHTS, MARKER):
        meta = json.loads((folder / MARKER).read_text())
        out.append((step, folder, meta["checksum"], format_of(meta)))
    return out


async def eval_run(cfg: EvalRunConfig, urls: list[str], admin_token: str | None) -> list[dict]:
    """`primerl eval`: the eval environments on `cfg.model`, or on each published step of
    `cfg.run` (policy N + 1 = the weights after step N); results appended to
    `run_dir/evals.jsonl`, steps already there are not evaluated again."""
    if not cfg.envs.eval:
        raise ValueError("no eval environments: add at least one [[envs.eval]] entry")
    out_path = Path(cfg.run_dir) / "evals.jsonl"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    done = set()
    if out_path.exists():
        done = {json.loads(line).get("policy") for line in out_path.read_text().splitlines() if line.strip()}
    e = cfg.eval
    results = []
    async with contextlib.AsyncExitStack() as stack:
        envs = await open_environments(stack, cfg.envs.eval, cfg.seed)
        gen = await start_generator(stack, cfg.model, urls, admin_token)
        if cfg.run is None:
            targets = [(0, None, None, None)]
        else:
            targets = [(step + 1, *published) for step, *published in published_steps(cfg.run)]
            if not targets:
                raise ValueError(f"{cfg.run} has no published weights (weights/step_N folders)")
        for policy, folder, digest, fmt in targets:
            if policy in done:
                log.info("policy %d already evaluated in %s", policy, out_path)
                continue
            if folder is not None:
                await gen.pool.load_weights(str(folder), policy, digest, fmt)
            metrics = await evaluate(envs, gen, e, max_tokens=e.max_tokens or 1024, concurrency=256)
            record = {"policy": policy, "model": cfg.model.name if folder is None else str(folder), **metrics}
            with out_path.open("a") as f:
                f.write(json.dumps(record) + "\n")
            log.info("policy %d | %s", policy, " ".join(f"{k.removeprefix('eval/')} {v:.3f}"
                                                        for k, v in metrics.items() if "@" in k))
            results.append(record)
    return results
