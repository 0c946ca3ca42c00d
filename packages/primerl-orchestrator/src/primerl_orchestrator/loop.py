"""The orchestrator: one asyncio process between the environments, inference and the trainer.

    asyncio.run(Orchestrator(cfg).run())      # cfg: shared values + orchestrator, inference, envs

Three tasks share the state below:
- the producer starts groups (group_size rollouts of one task, drawn from the training mix)
  while the rollouts in flight stay under `max_in_flight` and the next group would land in a
  batch its policy may feed: a group started on policy v may train at step v + k at the latest
  (k = max_async_level), so it starts only if the batch it is expected to land in, the current
  one plus the groups already started ahead of it, is <= v + k. With k = 0 this is synchronous
  RL: the groups of step N start when the servers serve policy N.
- the builder takes finished groups (in the order they finish) into step N's batch. A group
  whose oldest rollout is older than N - k is dropped and counted (`off_policy/dropped`),
  never trained on; its place is filled by another. Then filters, advantages, merging,
  packing, and each trainer rank gets its TrainBatch over ZeroMQ; a slow trainer blocks the
  send (and so, through the rule above, the producer).
- the policy listener takes the trainer's PolicyReady(step N) and has every server load it
  as policy N + 1 (the weights after N + 1 optimizer steps): full weights in place of the
  old ones, or a LoRA adapter beside the base weights (servers.py) that requests then name. Online evals run at policy
  versions that are multiples of `eval.interval`, beside training rollouts of the same policy;
  the next weight load waits for them, so each eval sees one policy.

Each step's metrics ride to the trainer with rank 0's batch (logged there with the trainer's,
on one step axis, to metrics.jsonl and W&B), are printed here and appended to
`run_dir/orchestrator/metrics.jsonl`; every few steps, some of the step's rollouts as text
ride along too (samples.py: the rollouts file, the W&B samples table). health.py logs the
first traceback of each kind of rollout error and stops a run whose rollouts error too much
for too long. The resume state rides along as well: the data position of every environment,
the next group id, and the groups started but not yet trained on (they are run again after a
resume). The trainer stores it in its checkpoint; a restarted orchestrator reads the newest
checkpoint, continues at the next step and waits for the trainer to publish the restored
weights. Nothing is repeated or skipped: every group id is trained exactly once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from pathlib import Path

from primerl_envs.environment import Environment, EnvMix, preload
from primerl_protocol import (
    AsyncReceiver,
    AsyncSender,
    BatchMessage,
    PolicyMessage,
    PolicyReady,
    Shutdown,
    TransportTimeout,
)
from primerl_protocol.images import model_images
from primerl_protocol.rundir import CheckpointError, RunDir, append_record, latest_checkpoint
from primerl_protocol.serving import LOGPROBS_MODE

from primerl_orchestrator.batching import Group, build_step
from primerl_orchestrator.config import OrchRunConfig
from primerl_orchestrator.evals import evaluate
from primerl_orchestrator.generate import AGENT_SLOTS, open_environments, start_generator
from primerl_orchestrator.health import Health, step_summary
from primerl_orchestrator.images import check_images, refuse_task_images
from primerl_orchestrator.samples import Samples

log = logging.getLogger("primerl.orchestrator")
RATE_WINDOW = 10
"""Steps over which rollouts/per_s and rollouts/tokens_per_s are measured."""


class OrchestratorError(RuntimeError):
    """The run cannot go on (no servers, the trainer stopped, bad resume state); says why."""


class Orchestrator:
    def __init__(self, cfg: OrchRunConfig) -> None:
        o = cfg.orchestrator
        self.cfg, self.o = cfg, o
        self.G, self.T, self.k = o.group_size, o.batch_size // o.group_size, o.max_async_level
        self.run_dir = Path(cfg.run_dir)
        self.paths = RunDir(cfg.run_dir)
        self.out_dir = self.paths.orchestrator
        self.step = 0
        """The step whose batch is being built."""
        self.next_group = 0
        self.version: int | None = 0
        """Policy version the servers serve (None: waiting for the trainer's first publish)."""
        self.redo: deque[tuple[int, str, int]] = deque()
        """(group id, env, task position) of groups to run again first (from a resume)."""
        self.running: dict[int, Group] = {}
        self.in_flight = 0
        """Training rollouts running now (a group's finished rollouts free their places at
        once, so one slow rollout does not hold its whole group's share of max_in_flight)."""
        self.done: deque[Group] = deque()
        self.taken = 0
        """Groups already in the batch being built."""
        self.failure: BaseException | None = None
        self.trainer_stopped: str | None = None
        self._cond = asyncio.Condition()
        self._tasks: set[asyncio.Task] = set()
        self._eval_task: asyncio.Task | None = None
        self._eval_metrics: dict[str, float] = {}
        # counters since the last step
        # Generation rates over the last RATE_WINDOW steps: (time, rollouts, tokens) finished so
        # far at each step's close. One step alone is no window: groups of consecutive steps
        # run together and finish within milliseconds of each other.
        self._finished = [0, 0]
        self._rate_marks: deque[tuple[float, int, int]] = deque(maxlen=RATE_WINDOW + 1)
        self._load_s = 0.0
        self.stale_dropped = 0
        """Rollouts dropped for being older than the bound, over the run."""
        self.dropped_groups: list[int] = []
        """Ids of the groups dropped for being older than the bound."""
        self.last_sent_at: float | None = None
        """Monotonic time the last batch was handed to the trainer."""
        self.generation_started: float | None = None
        """Monotonic time the first group started."""
        self.on_group = None
        """Called with every finished group (for benchmarks and tools)."""
        self.vision = None
        """The model's image settings (primerl_protocol.images.model_images; None: a text model)."""
        self.health = Health(o.max_error_rate, o.error_patience)
        """Rollout errors logged and counted, steps that train nothing, the error-rate stop."""
        self.samples = Samples(o.samples, self.out_dir)
        """Rollouts kept as text (its tokenizer is set when the run starts)."""

    # -- set-up -----------------------------------------------------------------------

    async def run(self) -> None:
        cfg = self.cfg
        if not cfg.envs.train:
            raise OrchestratorError("no training environments: add at least one [[envs.train]] entry")
        if not cfg.inference.resolved_admin_token():
            raise OrchestratorError(
                "inference.admin_token (or $PRIMERL_ADMIN_TOKEN) is not set: the orchestrator could "
                "not tell the servers to load new weights"
            )
        self.out_dir.mkdir(parents=True, exist_ok=True)
        async with contextlib.AsyncExitStack() as stack:
            self.envs = await open_environments(stack, cfg.envs.train, cfg.seed)
            # eval environments are started only when online evals are on
            self.eval_envs = await open_environments(stack, cfg.envs.eval if self.o.eval.interval else [], cfg.seed)
            self.by_name = {e.name: e for e in self.envs}
            for e in self.envs:
                log.info(
                    "environment %s: %s",
                    e.name,
                    "one request per group (single-turn)"
                    if e.single_turn
                    else f"one episode per rollout ({e.single_turn_why})",
                )
            self.mix = EnvMix(self.envs)
            self._resume()
            if cfg.max_steps is not None and self.step >= cfg.max_steps:
                # The checkpoint is the last step's: the trainer has nothing to train or publish.
                log.info(
                    "the run is complete: resumed at step %d of max_steps %d; nothing to do", self.step, cfg.max_steps
                )
                return
            # the first model call's imports and tokenizer, while the servers may still be loading
            preload(cfg.model.tokenizer or cfg.model.name)
            self.samples.tokenizer = cfg.model.tokenizer or cfg.model.name
            # Resumed, the servers may serve anything: the trainer publishes its restored weights first.
            self.vision = model_images(cfg.model.name)
            self.gen = await start_generator(
                stack,
                cfg.model,
                cfg.inference.server_urls(),
                cfg.inference.resolved_admin_token(),
                logprobs_mode=LOGPROBS_MODE,
                any_policy=self.version is None,
                max_retries=self.o.max_retries,
                # servers started beside this process may still be loading
                wait_s=cfg.inference.startup_timeout_s,
            )
            self.pool = self.gen.pool
            self._open_sockets(stack)
            log.info(
                "orchestrator: %d servers (%d healthy), %d x %d rollouts per step, max_async_level %d, from step %d",
                len(self.pool.servers),
                len(self.pool.healthy()),
                self.T,
                self.G,
                self.k,
                self.step,
            )
            finished, why = False, "the orchestrator stopped"
            try:
                self._spawn(self._listen_policy())
                self._spawn(self._produce())
                if self.version == 0:
                    self._maybe_eval(0)
                await self._build()
                await self._finish()
                finished = True
            except Exception as err:
                why = f"the orchestrator stopped: {str(err).splitlines()[0] if str(err) else type(err).__name__}"
                raise
            finally:
                for task in list(self._tasks) + ([self._eval_task] if self._eval_task else []):
                    task.cancel()
                await asyncio.gather(*self._tasks, return_exceptions=True)
                if not finished:
                    await self._tell_trainer_to_stop(why)

    def _open_sockets(self, stack: contextlib.AsyncExitStack) -> None:
        t = self.cfg.transport
        settings = t.sockets
        self.senders = []
        for r in range(t.ranks):
            sender = AsyncSender(
                t.batch_endpoint(r), BatchMessage, channel=f"batches/rank{r}", bind=True, settings=settings
            )
            stack.callback(sender.close)
            self.senders.append(sender)
        self.policy_rx = AsyncReceiver(
            t.policy_endpoint(), PolicyMessage, channel="policy", bind=True, settings=settings
        )
        stack.callback(self.policy_rx.close)

    def _resume(self) -> None:
        try:  # the trainer makes the same choice, from the same folders
            found = latest_checkpoint(self.run_dir)
        except CheckpointError as err:
            raise OrchestratorError(str(err)) from None
        if found is None:
            return
        path, meta = found
        state = meta.get("data", {}).get("orchestrator") or {}
        self.step = int(meta["step"]) + 1
        self.version = None  # the resumed trainer publishes its restored weights first
        if not state:
            log.warning(
                "%s holds no orchestrator state: continuing at step %d with fresh data positions", path, self.step
            )
            return
        try:
            if int(state["next_step"]) != self.step:
                raise ValueError(f"its next_step {state['next_step']} is not step {self.step}")
            self.next_group = int(state["next_group"])
            self.mix.load_state(state["mix"])
            for gid, env, pos in state["redo"]:
                if env not in self.by_name:
                    raise ValueError(f"group {gid} comes from environment {env!r}, which is no longer configured")
                if not len(self.by_name[env].tasks):
                    raise ValueError(f"group {gid} of environment {env!r} cannot run again: its taskset is endless")
                self.redo.append((int(gid), env, int(pos)))
        except (KeyError, TypeError, ValueError) as err:
            raise OrchestratorError(f"cannot resume from {path}: bad orchestrator state ({err})") from None
        log.info("resuming at step %d from %s: %d unfinished groups run again", self.step, path, len(self.redo))

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None and self.failure is None:
            self.failure = task.exception()
            asyncio.get_running_loop().create_task(self._notify())

    async def _notify(self) -> None:
        async with self._cond:
            self._cond.notify_all()

    async def _until(self, predicate) -> None:
        async with self._cond:
            await self._cond.wait_for(lambda: predicate() or self.failure is not None or self.trainer_stopped)
        if self.failure is not None:
            raise self.failure
        if self.trainer_stopped and not predicate():
            raise OrchestratorError(f"the trainer stopped ({self.trainer_stopped})")

    # -- producing --------------------------------------------------------------------

    def may_start(self) -> bool:
        """Whether a new group may start now (the in-flight limit and the off-policy rule)."""
        if self.version is None:
            return False
        if self.in_flight and self.in_flight + self.G > self.o.max_in_flight:
            return False
        lands_in = self.step + (self.taken + len(self.running) + len(self.done)) // self.T
        if self.cfg.max_steps is not None and lands_in >= self.cfg.max_steps:
            return False
        return lands_in <= self.version + self.k

    async def _produce(self) -> None:
        while True:
            await self._until(self.may_start)
            await self.pool.maybe_revive()
            if self.redo:
                gid, name, pos = self.redo.popleft()
                env = self.by_name[name]
                task = env.tasks.at(pos)  # endless tasksets have no random access: this raises
            else:
                gid, env = self.next_group, self.mix.next()
                pos = env.tasks.position
                task = env.tasks.next()
                self.next_group += 1
            group = Group(gid, env.name, pos)
            self.running[gid] = group
            self.in_flight += self.G
            if self.generation_started is None:
                self.generation_started = time.monotonic()
            self._spawn(self._run_group(group, env, task))

    async def _run_group(self, group: Group, env: Environment, task) -> None:
        s = self.o.sampling
        base = group.group_id * self.G

        ids = [(base + i) * AGENT_SLOTS for i in range(self.G)]

        async def one(i: int):
            try:
                return await self.gen.play(
                    env, task, sample_id=ids[i], group_id=group.group_id, max_tokens=s.max_tokens, sampling=s.request()
                )
            finally:
                self.in_flight -= 1
                await self._notify()

        name = repr(getattr(task, "key", group.position))
        batched = None
        if (
            refused := refuse_task_images(task, self.vision, env.name, name, ids, group.group_id, self.version or 0)
        ) is not None:
            batched = refused  # its pictures cannot train: no request is made
        elif env.single_turn is not None:  # one request for the group (None: this task needs episodes)
            batched = await self.gen.play_group(
                env, task, sample_ids=ids, group_id=group.group_id, max_tokens=s.max_tokens, sampling=s.request()
            )
        if batched is not None:
            group.rollouts = batched
            self.in_flight -= self.G
            await self._notify()
        else:
            results = await asyncio.gather(*(one(i) for i in range(self.G)))
            group.rollouts = [r for rs in results for r in rs]
        check_images(group.rollouts, self.vision, env.name, name)
        self._finished[0] += len(group.rollouts)
        self._finished[1] += sum(r.num_completion_tokens for r in group.rollouts)
        del self.running[group.group_id]
        self.done.append(group)
        if self.on_group is not None:
            self.on_group(group)
        await self._notify()

    # -- building ---------------------------------------------------------------------

    async def _build(self) -> None:
        max_steps = self.cfg.max_steps
        while max_steps is None or self.step < max_steps:
            t0 = time.monotonic()
            groups, stale = [], 0
            while len(groups) < self.T:
                await self._until(lambda: bool(self.done))
                group = self.done.popleft()
                if group.policy_step < self.step - self.k:
                    stale += len(group.rollouts)
                    self.dropped_groups.append(group.group_id)
                    log.warning(
                        "dropped group %d: policy %d is older than step %d allows (max_async_level %d)",
                        group.group_id,
                        group.policy_step,
                        self.step,
                        self.k,
                    )
                    await self._notify()  # its place is free: the producer starts another
                    continue
                groups.append(group)
                self.taken += 1
            t1 = time.monotonic()
            step = self.step
            batches, metrics = build_step(
                step, groups, self.o, seq_len=self.cfg.seq_len, num_ranks=self.cfg.transport.ranks
            )
            if bad := [r for g in groups for r in g.rollouts if r.bad_score]:
                log.warning(
                    "step %d: %d rollouts will not train: their environment scored them with something "
                    "that is not a finite number (first: %s)",
                    step,
                    len(bad),
                    bad[0].error,
                )
            # One move, no await in between: the groups leave the count of started groups as
            # the step advances, so the start rule never sees them gone with the step unchanged.
            self.step, self.taken = step + 1, 0
            self.health.observe(step, [r for g in groups for r in g.rollouts], metrics)
            self.stale_dropped += stale
            if not self._rate_marks:
                self._rate_marks.append((self.generation_started or t1, 0, 0))
            self._rate_marks.append((t1, self._finished[0], self._finished[1]))
            t_then, rollouts_then, tokens_then = self._rate_marks[0]
            elapsed = max(t1 - t_then, 1e-9)
            metrics |= {
                "off_policy/dropped": float(stale),
                "off_policy/level": float(step - min(g.policy_step for g in groups)),
                "rollouts/per_s": (self._finished[0] - rollouts_then) / elapsed,
                "rollouts/tokens_per_s": (self._finished[1] - tokens_then) / elapsed,
                "rollouts/retried": float(self.gen.retries),
                "policy/version": float(self.version if self.version is not None else -1),
                "time/wait_rollouts": t1 - t0,
                "time/build": time.monotonic() - t1,
                "time/load_weights": self._load_s,
                **self.pool.stats(),
                **self._eval_metrics,
            }
            self._eval_metrics = {}
            self._load_s = 0.0
            batches[0].metrics = metrics
            batches[0].state = self.resume_state(step + 1)
            if self.samples.due(step):
                batches[0].samples = await self.samples.take(step, groups)
            t2 = time.monotonic()
            for sender, batch in zip(self.senders, batches):
                try:
                    await sender.send(batch, timeout_s=self.o.send_timeout_s)
                except TransportTimeout as err:
                    raise OrchestratorError(
                        f"the trainer did not take the batch of step {step} ({err}); is it running?"
                    ) from None
            metrics["time/send"] = time.monotonic() - t2
            self.last_sent_at = time.monotonic()
            self._log_step(step, metrics)
            if (why := self.health.stop_reason(step, metrics)) is not None:
                raise OrchestratorError(why)  # after the step's batch: the trainer trains it, then stops
            await self._notify()

    def resume_state(self, next_step: int) -> dict:
        """What a restart needs to build `next_step` and after: nothing repeated, nothing skipped."""
        unfinished = [(g.group_id, g.env, g.position) for g in [*self.running.values(), *self.done]]
        unfinished += list(self.redo)
        return {
            "next_step": next_step,
            "next_group": self.next_group,
            "mix": self.mix.state(),
            "redo": [list(u) for u in sorted(unfinished)],
        }

    def _log_step(self, step: int, m: dict[str, float]) -> None:
        reward = (
            f"reward {m['reward/mean']:.3f} [{m['reward/min']:.2f}, {m['reward/max']:.2f}]"
            if "reward/mean" in m
            else "reward -"
        )
        log.info(
            "step %d | %s | %s | off-policy %d | %.1f rollouts/s | %s tok/s | samples %d | wait %.2fs send %.2fs "
            "load %.2fs",
            step,
            reward,
            step_summary(m),
            m["off_policy/level"],
            m["rollouts/per_s"],
            f"{m['rollouts/tokens_per_s']:,.0f}",
            m["batch/samples"],
            m["time/wait_rollouts"],
            m["time/send"],
            m["time/load_weights"],
        )
        append_record(self.paths.orchestrator_metrics, {"step": step, **m})

    # -- policies and evals -----------------------------------------------------------

    def _waiting_for_policy(self) -> bool:
        """Nothing can move until the trainer publishes (the start rule holds everything back)."""
        return not self.in_flight and not self.done and not self.may_start()

    async def _listen_policy(self) -> None:
        patience = self.cfg.transport.sockets.recv_timeout_s
        while True:
            try:
                msg = await self.policy_rx.recv(timeout_s=patience)
            except TransportTimeout:
                if self._waiting_for_policy():
                    raise OrchestratorError(
                        f"waited {patience:.0f}s (transport.sockets.recv_timeout_s) for the trainer to publish "
                        + (
                            "the weights it resumed from"
                            if self.version is None
                            else f"the policy after {self.version}"
                        )
                        + f" (step {self.step} needs it); is it running?"
                    ) from None
                continue
            if isinstance(msg, Shutdown):
                self.trainer_stopped = msg.reason or "it sent Shutdown"
                await self._notify()
                return
            if not isinstance(msg, PolicyReady):
                continue
            if self._eval_task is not None:
                await asyncio.shield(self._eval_task)  # an eval sees one policy
            version = msg.step + 1
            self._load_s += await self.pool.load_weights(
                msg.location, version, msg.checksum, msg.format, served=msg.served
            )
            self.version = version
            log.info("servers serve policy %d (%s)", version, msg.location or "sent in memory")
            self._maybe_eval(version)
            await self._notify()

    def _maybe_eval(self, version: int) -> None:
        interval = self.o.eval.interval
        if not self.eval_envs or not interval or version % interval:
            return
        self._eval_task = asyncio.create_task(self._eval(version))

    async def _eval(self, version: int) -> None:
        e = self.o.eval
        try:
            metrics = await evaluate(
                self.eval_envs,
                self.gen,
                e,
                max_tokens=e.max_tokens or self.o.sampling.max_tokens,
                concurrency=self.o.max_in_flight,
            )
        except Exception as err:  # an eval failing must not stop training
            log.error("eval of policy %d failed: %s", version, err)
            return
        finally:
            self._eval_task = None
        metrics["eval/policy"] = float(version)
        self._eval_metrics |= metrics
        line = " ".join(f"{k.removeprefix('eval/')} {v:.3f}" for k, v in metrics.items() if "@" in k)
        log.info("eval of policy %d | %s", version, line)
        append_record(self.paths.orchestrator_evals, {"policy": version, **metrics})

    async def _finish(self) -> None:
        """After the last batch: wait until the trainer has published the final policy (it is
        still training the last steps, and publishes to us), then the final eval."""
        final = self.cfg.max_steps
        if final is None:
            return
        await self._until(lambda: self.version == final)
        if not self.eval_envs or not self.o.eval.interval:
            return
        if self._eval_task is not None:  # the listener started it (final is a multiple of the interval)
            await self._eval_task
        elif final % self.o.eval.interval:
            await self._eval(final)

    async def _tell_trainer_to_stop(self, reason: str) -> None:
        for sender in getattr(self, "senders", []):
            with contextlib.suppress(Exception):
                await sender.send(Shutdown(sender="orchestrator", reason=reason), timeout_s=1.0)


PER_REQUEST_LOGGERS = ("verifiers.v1.rollout", "httpx", "aiohttp.access")
"""Loggers that write a line per rollout or per HTTP request at INFO (four lines a rollout in all,
2 MB of log per 30 steps of the reverse-text example): held at WARNING, so their warnings and
errors still show."""


def configure_logging() -> None:
    """INFO to stderr with times, without the per-request lines (the orchestrator and evals)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    for name in PER_REQUEST_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)


def run(cfg: OrchRunConfig) -> None:
    """`primerl-orch`: the orchestrator until max_steps (or until stopped)."""
    configure_logging()
    asyncio.run(Orchestrator(cfg).run())
