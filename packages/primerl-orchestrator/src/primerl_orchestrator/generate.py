"""Rollouts of an environment's task on the server pool: routing, retries, policy tags.

Each rollout leases the least-loaded healthy server for its whole episode (every turn goes
to the same server, whose prefix cache holds the conversation so far) and is tagged with the
policy version that server served when the rollout started: the oldest policy any of its
tokens can come from, which is what the off-policy bound needs. A rollout that failed at the
model call (verifiers records a `ProviderError`) makes the pool probe its server; when the
server is at fault the rollout runs again, from the start, on another one.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from primerl_envs.config import EnvConfig
from primerl_envs.environment import Environment, model_context
from primerl_protocol.config import ModelConfig
from primerl_protocol.rollouts import Rollout

from primerl_orchestrator.servers import Server, ServerPool

log = logging.getLogger("primerl.orchestrator")

AGENT_SLOTS = 8
"""Sample ids of rollout i of group g are (g * group_size + i) * AGENT_SLOTS + j for the j-th
agent's trace of the episode (j = 0 for single-agent environments)."""

MODEL_ERRORS = ("ProviderError", "InterceptionError")
"""verifiers' error types for a failed model call (vs. the environment's own failures)."""


Played = TypeVar("Played", bound=list[Rollout] | None)
"""What an episode gives: rollouts (Environment.rollouts), or None where the environment cannot
play a whole group in one request (Environment.group_rollouts)."""


def is_model_error(error: str | None) -> bool:
    return error is not None and any(error.startswith(t) or f"; {t}" in error for t in MODEL_ERRORS)


class Generator:
    def __init__(self, pool: ServerPool, model: str, tokenizer: str, *, max_retries: int = 2) -> None:
        self.pool, self.model, self.tokenizer = pool, model, tokenizer
        self.max_retries = max_retries
        self._contexts: dict[tuple, tuple[str, object]] = {}
        """(server url, max_tokens, sampling) -> (the model requests name, its verifiers context)."""
        self.retries = 0
        """Rollouts run again because their server failed."""

    def context(self, url: str, max_tokens: int, sampling: dict, model: str | None = None):
        """The verifiers context for requests to `url` naming `model` (default: the base model;
        a server serving an adapter policy: its adapter, `Server.model`)."""
        model = model or self.model
        key = (url, max_tokens, tuple(sorted(sampling.items())))
        held = self._contexts.get(key)
        if held is None or held[0] != model:  # one per server and sampling: verifiers reuses its client
            extra = {k: v for k, v in sampling.items() if k != "temperature"}
            # a new adapter replaces the context of the old one (rollouts still running hold theirs)
            held = self._contexts[key] = (
                model,
                model_context(
                    url,
                    model,
                    self.tokenizer,
                    temperature=sampling["temperature"],
                    max_tokens=max_tokens,
                    extra_sampling=extra,
                ),
            )
        return held[1]

    async def play(
        self,
        env: Environment,
        task,
        *,
        sample_id: int,
        group_id: int,
        max_tokens: int,
        sampling: dict,
    ) -> list[Rollout]:
        """One episode of `task` as rollouts (never raises for what went wrong in the episode).

        `sampling`: the request's sampling fields, with at least `temperature` (training sends
        SamplingConfig.request()); what it leaves out the server takes from the model's
        generation_config.json."""

        def run(server, ctx):
            return env.rollouts(
                task,
                ctx,
                sample_id=sample_id,
                group_id=group_id,
                temperature=sampling["temperature"],
                policy_step=server.version,
            )

        return await self._retrying(run, max_tokens, sampling, f"rollout {sample_id} (env {env.name})")

    async def play_group(
        self,
        env: Environment,
        task,
        *,
        sample_ids: list[int],
        group_id: int,
        max_tokens: int,
        sampling: dict,
    ) -> list[Rollout] | None:
        """A whole group of `task` from one request to one server (`Environment.group_rollouts`),
        or None when the environment or the task needs an episode per rollout (then `play`)."""

        def run(server, ctx):
            return env.group_rollouts(
                task,
                ctx,
                n=len(sample_ids),
                sample_ids=sample_ids,
                group_id=group_id,
                temperature=sampling["temperature"],
                policy_step=server.version,
            )

        return await self._retrying(run, max_tokens, sampling, f"group {group_id} (env {env.name})")

    async def _retrying(
        self, run: Callable[[Server, object], Awaitable[Played]], max_tokens: int, sampling: dict, what: str
    ) -> Played:
        """`run(server, ctx)` on a leased server, again on another one while the server was at
        fault (up to max_retries times)."""
        attempt = 0
        while True:
            async with self.pool.lease() as server:
                rollouts = await run(server, self.context(server.url, max_tokens, sampling, server.model))
            if rollouts is None:
                return rollouts
            failed = next((r.error for r in rollouts if is_model_error(r.error)), None)
            if failed is None or attempt >= self.max_retries:
                return rollouts
            if not await self.pool.report_failure(server, failed):
                return rollouts  # the server is fine: the request itself failed (e.g. too long)
            attempt += 1
            self.retries += 1
            log.info("%s failed on %s; retrying on another server", what, server.url)


async def open_environments(stack: contextlib.AsyncExitStack, configs: list[EnvConfig], seed: int) -> list[Environment]:
    """The environments of `configs`, started, and stopped when `stack` closes."""
    return [await stack.enter_async_context(Environment(c, seed=seed)) for c in configs]


async def start_generator(
    stack: contextlib.AsyncExitStack,
    model: ModelConfig,
    urls: list[str],
    admin_token: str | None,
    *,
    logprobs_mode: str | None = None,
    any_policy: bool = False,
    max_retries: int = 2,
    wait_s: float = 0.0,
) -> Generator:
    """A Generator over a started ServerPool of `urls` (closed when `stack` closes): the set-up
    the training loop and `primerl eval` share. Raises NoServerError when none serves `model`
    (after waiting up to `wait_s` for servers that are still starting: ServerPool.start)."""
    pool = ServerPool(urls, model.name, admin_token, logprobs_mode=logprobs_mode)
    stack.push_async_callback(pool.close)
    await pool.start(any_policy=any_policy, wait_s=wait_s)
    return Generator(pool, model.name, model.tokenizer or model.name, max_retries=max_retries)
