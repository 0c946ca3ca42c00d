"""Evals: k rollouts of each task of the eval environments, scored as avg@k and pass@k.

For a task with n rollouts of which c solved it (reward >= the pass threshold):
  avg@k   mean reward over the k rollouts, averaged over tasks
  pass@k  1 - C(n - c, k) / C(n, k), the unbiased estimate of "at least one of k solves it"
          (Chen et al., 2021), averaged over tasks; with n = k it is 1 if any rollout solved it
  pass@1  c / n averaged over tasks
Errored rollouts count as unsolved with reward 0 (and are reported as `error_rate`); the first
error of each environment is logged, and `primerl eval` stops (EvalError, nothing recorded) at a
policy where every rollout of an environment errored: a score of 0 would measure nothing.

Policies and folders: `weights/step_N` (the trainer's step N, counted from 0) holds the weights
after N + 1 optimizer steps, which the servers serve as policy N + 1; the model a run starts
from is policy 0 (primerl_protocol.rundir). Online evals and evals.jsonl count policies; the
console names the folder beside it.
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
from primerl_protocol import rundir

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


class EvalError(RuntimeError):
    """Every rollout of an eval environment errored: nothing was measured (says which
    environment, which policy, and the first error)."""


async def evaluate(
    envs: list[Environment],
    gen: Generator,
    settings,
    *,
    max_tokens: int,
    concurrency: int,
) -> dict[str, float]:
    """`eval/<env>/...` metrics of every environment in `envs` (EvalSettings `settings`), the
    errored rollouts logged (`evaluate_with_errors`)."""
    return (await evaluate_with_errors(envs, gen, settings, max_tokens=max_tokens, concurrency=concurrency))[0]


async def evaluate_with_errors(
    envs: list[Environment],
    gen: Generator,
    settings,
    *,
    max_tokens: int,
    concurrency: int,
) -> tuple[dict[str, float], dict[str, str]]:
    """The metrics of `evaluate`, and {environment: its first rollout's error} for each
    environment whose rollouts errored; each of those is logged with the count (a warning, an
    error when every rollout errored). A single-turn environment's k samples of a task go as
    one request (Generator.play_group); `concurrency` bounds the rollouts in flight either way."""
    k = settings.num_samples
    limit = asyncio.Semaphore(concurrency)
    group_limit = asyncio.Semaphore(max(1, concurrency // k))
    sampling = {"temperature": settings.temperature}
    out: dict[str, float] = {}
    first_errors: dict[str, str] = {}
    t0 = time.monotonic()

    async def task_rollouts(env, task, task_index: int) -> list:
        ids = [task_index * k + i for i in range(k)]
        if env.single_turn is not None:
            async with group_limit:
                group = await gen.play_group(
                    env, task, sample_ids=ids, group_id=task_index, max_tokens=max_tokens, sampling=sampling
                )
            if group is not None:
                return group

        async def one(sample_id: int):
            async with limit:
                rollouts = await gen.play(
                    env, task, sample_id=sample_id, group_id=task_index, max_tokens=max_tokens, sampling=sampling
                )
            return rollouts[0]

        return list(await asyncio.gather(*(one(i) for i in ids)))

    for env in envs:
        n_tasks = (
            len(env.tasks)
            if settings.max_tasks is None
            else min(settings.max_tasks, len(env.tasks) or settings.max_tasks)
        )
        if n_tasks == 0:
            raise ValueError(f"eval environment {env.name!r} has an endless taskset: set eval.max_tasks")
        tasks = [env.tasks.at(i) for i in range(n_tasks)]
        per_task = await asyncio.gather(*(task_rollouts(env, t, ti) for ti, t in enumerate(tasks)))
        rollouts = [r for group in per_task for r in group]
        results = [((0.0 if r.error else r.reward), r.error is not None, r.num_completion_tokens) for r in rollouts]
        rewards = [[results[ti * k + i][0] for i in range(k)] for ti in range(n_tasks)]
        for name, value in score_tasks(rewards, k, settings.pass_threshold).items():
            out[f"eval/{env.name}/{name}"] = value
        errored = [r.error for r in rollouts if r.error is not None]
        if errored:
            first_errors[env.name] = _shorten(errored[0])
            log.log(
                logging.ERROR if len(errored) == len(rollouts) else logging.WARNING,
                "eval of %s: %d of %d rollouts errored; the first: %s",
                env.name,
                len(errored),
                len(rollouts),
                first_errors[env.name],
            )
        out[f"eval/{env.name}/error_rate"] = len(errored) / len(results)
        out[f"eval/{env.name}/completion_tokens"] = sum(t for _, _, t in results) / len(results)
        out[f"eval/{env.name}/tasks"] = float(n_tasks)
    out["time/eval"] = time.monotonic() - t0
    return out, first_errors


def _shorten(error: str, limit: int = 2000) -> str:
    return error if len(error) <= limit else f"{error[:limit]} ... ({len(error) - limit} more characters)"


def policy_label(record: dict) -> str:
    """How the console names an evaluated policy: the folder of a run's step, or the model."""
    if record.get("step") is None:
        return f"{record['model']} (policy {record['policy']})"
    return f"weights/step_{record['step']} (policy {record['policy']})"


def published_steps(run: str | Path) -> list[tuple[int, Path, str, str]]:
    """(step, folder, checksum, format) of every complete published folder of a run, in order
    (format: full weights or a LoRA adapter, primerl_protocol.weights)."""
    from primerl_protocol.weights import MARKER, format_of

    out = []
    for step, folder in rundir.complete_steps(rundir.RunDir(run).weights, MARKER):
        meta = json.loads((folder / MARKER).read_text())
        out.append((step, folder, meta["checksum"], format_of(meta)))
    return out


async def eval_run(cfg: EvalRunConfig, urls: list[str], admin_token: str | None) -> list[dict]:
    """`primerl eval`: the eval environments on `cfg.model` (policy 0), or on each published step
    of `cfg.run` (weights/step_N, policy N + 1); results appended to `run_dir/evals.jsonl`
    (`policy`, `step`: N or None for the model, `model`: what was served, the metrics), policies
    already there are not evaluated again. EvalError at the first policy where every rollout of
    an environment errored (nothing is recorded for it, so a rerun evaluates it again)."""
    out_path = rundir.RunDir(cfg.run_dir).evals
    out_path.parent.mkdir(parents=True, exist_ok=True)
    done = set()
    if out_path.exists():
        done = {json.loads(line).get("policy") for line in out_path.read_text().splitlines() if line.strip()}
    e = cfg.eval
    model = cfg.model
    assert model is not None, "EvalRunConfig.__post_init__ sets the model (the run's, when none is given)"
    results = []
    # (policy, step, (folder, checksum, format) of the published step; None: the model itself)
    targets: list[tuple[int, int | None, tuple[Path, str, str] | None]]
    if cfg.run is None:
        targets = [(0, None, None)]
    else:
        targets = [(step + 1, step, (folder, digest, fmt)) for step, folder, digest, fmt in published_steps(cfg.run)]
        if not targets:
            raise ValueError(f"{cfg.run} has no published weights (weights/step_N folders)")
    async with contextlib.AsyncExitStack() as stack:
        envs = await open_environments(stack, cfg.envs.eval, cfg.seed)
        gen = await start_generator(stack, model, urls, admin_token)
        for policy, step, published in targets:
            record = {"policy": policy, "step": step, "model": model.name if published is None else str(published[0])}
            if policy in done:
                log.info("%s already evaluated in %s", policy_label(record), out_path)
                continue
            if published is not None:
                folder, digest, fmt = published
                await gen.pool.load_weights(str(folder), policy, digest, fmt)
            metrics, first_errors = await evaluate_with_errors(
                envs, gen, e, max_tokens=e.max_tokens or 1024, concurrency=256
            )
            for env in envs:
                if metrics[f"eval/{env.name}/error_rate"] == 1.0:
                    raise EvalError(
                        f"every rollout of eval environment {env.name!r} errored on {policy_label(record)}, "
                        f"so nothing was recorded for it; the first error: {first_errors[env.name]}"
                    )
            record |= metrics
            rundir.append_record(out_path, record)
            log.info(
                "%s | %s",
                policy_label(record),
                " ".join(f"{k.removeprefix('eval/')} {v:.3f}" for k, v in metrics.items() if "@" in k),
            )
            results.append(record)
    return results
