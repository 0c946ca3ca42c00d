"""Load verifiers environments from primerl's config and run their episodes.

    env = Environment(EnvConfig(id="reverse-text", args={"num_tasks": 100}))
    async with env:                                   # starts its serving resources
        task = env.tasks.next()                       # data position is env.tasks.position
        traces = await env.run(task, model_context(url, model, tokenizer, sampling))

An environment is a verifiers `Taskset` (plus, optionally, its own `Env` subclass) loaded by
id, exactly as `vf-eval` loads it, so users' environments run unmodified. What primerl
overrides, because verifiers' defaults reach for a vendor's cloud: the runtime (verifiers'
default is a remote sandbox; here `subprocess`), the model client (always our own vLLM servers,
through verifiers' training client so traces carry token ids and logprobs) and the harness
(primerl's in-process chat loop, see primerl_chat). Nothing is pushed anywhere.

`mode = "server"` runs the environment in a child process with verifiers' env server (ZeroMQ)
and sends it each task; the orchestrator's event loop then never runs environment code.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import multiprocessing
import random
import sys
from collections.abc import Iterator
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

from primerl_protocol.rollouts import Rollout

from primerl_envs import compat
from primerl_envs.config import EnvConfig
from primerl_envs.registry import BUILTIN, EnvLoadError, explain
from primerl_envs.rollouts import first_traceback, trace_to_rollout


def resolve_taskset_id(env_id: str) -> str:
    """The verifiers taskset id for a config id: built-in name, installed id, or local path.

    A local path (a `.py` file or a package folder) has its parent folder put on `sys.path`
    and is then loaded by its module name, as verifiers loads any taskset.
    """
    if env_id in BUILTIN:
        return BUILTIN[env_id]
    if env_id.endswith(".py") or "/" in env_id or env_id.startswith("."):
        path = Path(env_id).expanduser()
        if not path.exists():
            raise EnvLoadError(f"environment {env_id!r}: no such file or folder ({path.resolve()})")
        parent = str(path.resolve().parent)
        if parent not in sys.path:
            sys.path.insert(0, parent)
        return path.stem if path.is_file() else path.name
    return env_id


def verifiers_config(cfg: EnvConfig):
    """The verifiers env config for `cfg`: its taskset with `args`, every agent role played by
    the configured harness in a local runtime with the configured turn and time limits."""
    import verifiers.v1 as vf
    from pydantic import ValidationError
    from verifiers.v1.configs.agent import agent_config_fields

    taskset_id = resolve_taskset_id(cfg.id)
    taskset = {"id": taskset_id, **cfg.args}
    agent: dict[str, Any] = {
        "runtime": {"type": "subprocess"},
        "harness": {"id": cfg.harness},
        "network_notice": False,
    }
    if cfg.max_turns is not None:
        agent["max_turns"] = cfg.max_turns
    if cfg.max_episode_tokens is not None:
        agent["max_output_tokens"] = cfg.max_episode_tokens
    where = f"environment {cfg.display_name!r} (id {cfg.id!r})"
    try:
        plain = vf.resolve_env_config({"taskset": taskset})
        roles = agent_config_fields(plain)
        raw: dict[str, Any] = {"taskset": taskset, **{role: agent for role in roles}}
        if cfg.timeout_s is not None:
            raw["timeout"] = {"episode": cfg.timeout_s}
        return vf.resolve_env_config(raw)
    except ValidationError as e:
        raise EnvLoadError(f"{where}: bad arguments (envs.*.args): {e}") from e
    except Exception as e:  # noqa: BLE001 - the user's module: not found, a missing import, the classic API, ...
        raise explain(cfg, taskset_id, e) from e


class TaskStream:
    """Tasks of a taskset in a reproducible order, resumable from a position.

    A finite taskset is read once and cycled through in epochs, each shuffled with
    `seed + epoch`; an infinite one is read in order. `position` counts the tasks handed out,
    so saving it and building a new stream with it continues exactly where this one was.
    """

    def __init__(self, taskset, seed: int = 0, position: int = 0, shuffle: bool = True) -> None:
        self.seed = seed
        self.shuffle = shuffle
        self.position = 0
        self._infinite = not taskset.bounded
        self._iter: Iterator | None = iter(taskset) if self._infinite else None
        self._tasks = [] if self._infinite else list(taskset)
        if not self._infinite and not self._tasks:
            raise EnvLoadError(f"taskset {type(taskset).__name__} has no tasks")
        self._epoch = -1
        self._order: list[int] = []
        for _ in range(position):
            self.next()

    def _order_for(self, epoch: int) -> list[int]:
        order = list(range(len(self._tasks)))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def next(self):
        if self._infinite:
            assert self._iter is not None
            task = next(self._iter)
        else:
            epoch, index = divmod(self.position, len(self._tasks))
            if epoch != self._epoch:
                self._epoch, self._order = epoch, self._order_for(epoch)
            task = self._tasks[self._order[index]]
        self.position += 1
        return task

    def at(self, position: int):
        """The task handed out at `position` (finite tasksets), without moving the stream."""
        if self._infinite:
            raise EnvLoadError("an endless taskset has no random access; only `next()`")
        epoch, index = divmod(position, len(self._tasks))
        order = self._order if epoch == self._epoch else self._order_for(epoch)
        return self._tasks[order[index]]

    def __len__(self) -> int:
        return 0 if self._infinite else len(self._tasks)


def _serve(config_data: dict, address: str, paths: list[str], queue) -> None:
    """Child process of a served environment: verifiers' env server on `address`."""
    for p in paths:
        if p not in sys.path:
            sys.path.insert(0, p)
    compat.install()
    from verifiers.v1.serve import serve_env

    serve_env(max_workers=1, address=address, address_queue=queue, config_data=config_data)


class Environment:
    """One configured environment: its tasks, and episodes run in-process or on its server."""

    def __init__(self, cfg: EnvConfig, seed: int = 0, position: int = 0) -> None:
        import verifiers.v1 as vf

        self.cfg = cfg
        self.name = cfg.display_name
        self.vf_config = verifiers_config(cfg)
        try:
            taskset = vf.load_taskset(self.vf_config.taskset)
            self.tasks = TaskStream(taskset, seed=seed, position=position)
        except EnvLoadError:
            raise
        except Exception as e:
            raise EnvLoadError(f"environment {self.name!r}: loading its tasks failed: {e}") from e
        self._env = None
        self.single_turn = None
        """A `single_turn.SingleTurnPlan` when this environment's groups go as one request each."""
        self.single_turn_why = "not started"
        """Why not, when not."""
        self._stack: contextlib.AsyncExitStack | None = None
        self._process: BaseProcess | None = None
        self._client = None

    async def __aenter__(self) -> Environment:
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    async def start(self) -> None:
        if self.cfg.mode == "server":
            await self._start_server()
            return
        import verifiers.v1 as vf

        try:
            self._env = vf.load_environment(self.vf_config)
        except Exception as e:
            raise EnvLoadError(f"environment {self.name!r}: {e}") from e
        self._stack = contextlib.AsyncExitStack()
        await self._stack.enter_async_context(self._env.serving())
        if self.cfg.batch_groups:
            from primerl_envs.single_turn import single_turn_plan

            try:
                self.single_turn, self.single_turn_why = single_turn_plan(self._env, self.name, self.cfg.harness)
            except Exception as e:  # noqa: BLE001 - undecided is safe: episodes, as without batching
                self.single_turn_why = (
                    f"could not tell whether its episodes are single model calls ({type(e).__name__}: {e})"
                )
        else:
            self.single_turn_why = "envs.*.batch_groups is false"

    async def _start_server(self) -> None:
        from verifiers.v1.serve import EnvClient, env_config_data

        self.single_turn_why = "it is served by its own process (mode = server)"
        ctx = multiprocessing.get_context("spawn")
        queue = ctx.Queue()
        paths = [p for p in sys.path if p]
        self._process = ctx.Process(
            target=_serve,
            args=(env_config_data(self.vf_config), "tcp://127.0.0.1:0", paths, queue),
            name=f"primerl-env-{self.name}",
            daemon=True,
        )
        self._process.start()
        loop = asyncio.get_running_loop()
        try:
            address = await asyncio.wait_for(loop.run_in_executor(None, queue.get), timeout=120)
        except TimeoutError as e:
            self._process.kill()
            raise EnvLoadError(
                f"environment {self.name!r}: its server did not report an address in 120 s "
                f"(exit code {self._process.exitcode})"
            ) from e
        self._client = EnvClient(address)
        await self._client.wait_for_server_startup()

    async def stop(self) -> None:
        if self._stack is not None:
            await self._stack.aclose()
            self._stack = None
            import primerl_chat

            await primerl_chat.close_session()
        if self._client is not None:
            await self._client.close()
            self._client = None
        if self._process is not None:
            self._process.terminate()
            self._process.join(10)
            if self._process.is_alive():
                self._process.kill()
            self._process = None

    async def run(self, task, ctx) -> list:
        """One episode of `task` with the model in `ctx`; its traces (one per agent run).

        Failures inside the episode (a reward function that raised, a harness error, a time
        limit) are recorded on the traces, never raised: the caller turns them into errored
        rollouts. An episode that produced no trace at all yields one error trace record.
        """
        if self._client is not None:
            episode = await self._client.run(ctx.client, ctx.model, ctx.sampling, task.data.model_dump(mode="json"))
        elif self._env is not None:
            (slot,) = self._env.slots(task)
            episode = await self._env.run_slot(slot, ctx)
        else:
            raise RuntimeError(f"environment {self.name!r} is not started")
        if episode.traces:
            if episode.errors:
                for trace in episode.traces:
                    trace.errors.extend(episode.errors)
                    trace.ok = False
            return list(episode.traces)
        raise EpisodeError(
            f"environment {self.name!r}: episode produced no trace: "
            + "; ".join(f"{e.type}: {e.message}" for e in episode.errors),
            traceback=first_traceback(episode.errors),
        )

    async def rollouts(
        self, task, ctx, *, sample_id: int, group_id: int, temperature: float = 1.0, policy_step: int = 0
    ) -> list[Rollout]:
        """One episode of `task` as training rollouts (one per trace; ids from `sample_id` on).

        Never raises for what went wrong inside the episode: an episode that ended before any
        agent ran (e.g. past its time limit) is one rollout with `error` set and no tokens.
        """
        meta = {"group_id": group_id, "env": self.name, "temperature": temperature, "policy_step": policy_step}
        try:
            traces = await self.run(task, ctx)
        except EpisodeError as e:
            return [Rollout(sample_id=sample_id, turns=[], error=str(e), traceback=e.traceback, **meta)]
        return [trace_to_rollout(t, sample_id=sample_id + i, **meta) for i, t in enumerate(traces)]

    async def group_rollouts(
        self,
        task,
        ctx,
        *,
        n: int,
        sample_ids: list[int],
        group_id: int,
        temperature: float = 1.0,
        policy_step: int = 0,
    ) -> list[Rollout] | None:
        """A group of `n` rollouts of `task` from one request (primerl_envs.single_turn), or None
        when this environment or this task needs an episode per rollout (then use `rollouts`)."""
        if self.single_turn is None:
            return None
        from primerl_envs.single_turn import group_rollouts

        return await group_rollouts(
            self.single_turn,
            task,
            ctx,
            n=n,
            sample_ids=sample_ids,
            group_id=group_id,
            temperature=temperature,
            policy_step=policy_step,
        )


def preload(tokenizer: str | None = None) -> None:
    """Import now what verifiers' training client imports on its first model call: renderers
    loads the tokenizer through transformers' AutoTokenizer, which imports transformers and
    torch (4.4 s of the RL run's first step on 2 cores, py-spy). With `tokenizer`, also start
    loading the renderer every model call of the run shares (on a thread; from inside the event
    loop). The orchestrator calls this while its inference servers may still be loading.
    Without transformers installed it does nothing (renderers then names the missing extra at
    that first call)."""
    try:
        importlib.import_module("transformers").AutoTokenizer  # noqa: B018 (the lazy import itself)
    except ImportError:
        return
    if tokenizer is not None:
        from verifiers.v1.clients.train import ElasticRendererPool

        client = _client_config("http://unused", tokenizer)
        ElasticRendererPool(tokenizer, client.renderer, multiplex=client.multiplex).warm()


class EpisodeError(RuntimeError):
    """An episode that failed before any agent ran (counted as an errored rollout)."""

    def __init__(self, message: str, traceback: str | None = None) -> None:
        super().__init__(message)
        self.traceback = traceback


def model_context(
    base_url: str,
    model: str,
    tokenizer: str,
    *,
    temperature: float = 1.0,
    max_tokens: int | None = None,
    top_p: float | None = None,
    tool_parser: str | None = "qwen3",
    extra_sampling: dict | None = None,
    headers: dict[str, str] | None = None,
):
    """A verifiers model context for one of primerl's vLLM servers.

    verifiers' training client renders prompts with the model's own chat template (from the
    local `tokenizer` folder), calls the server's token-in/token-out route and records token
    ids and logprobs on the trace. `tool_parser` reads tool calls out of sampled tokens
    (`qwen3`: `<tool_call>{json}</tool_call>`).
    """
    import verifiers.v1 as vf

    client = _client_config(base_url, tokenizer, tool_parser, headers)
    sampling: dict[str, Any] = {"temperature": temperature}
    if max_tokens is not None:
        sampling["max_tokens"] = max_tokens
    if top_p is not None:
        sampling["top_p"] = top_p
    sampling.update(extra_sampling or {})
    return vf.ModelContext(model=model, client=client, sampling=vf.SamplingConfig(**sampling))


VLM_RENDERERS = {"qwen3_5": "Qwen35RendererConfig", "qwen3_5_moe": "Qwen35RendererConfig"}
"""Renderers (the `renderers` library's) of the vision-language families: they send a prompt's
images to the server, which expands each to its run of image tokens and returns the prompt's
tokens as the model saw them."""


def renderer_config(tokenizer: str, tool_parser: str | None = "qwen3"):
    """The renderer of the model whose tokenizer folder is `tokenizer`: a vision-language
    family's own for a checkpoint with a vision tower (thinking off: the generation prompt
    closes an empty think block), else the chat template's (DefaultRenderer)."""
    import renderers

    try:
        config = json.loads((Path(tokenizer) / "config.json").read_text())
    except (OSError, ValueError):
        config = {}
    model_type = config.get("model_type") if isinstance(config, dict) and "vision_config" in config else None
    name = VLM_RENDERERS.get(model_type) if isinstance(model_type, str) else None
    if name is not None:
        return getattr(renderers, name)(enable_thinking=False)
    return (
        renderers.DefaultRendererConfig(tool_parser=tool_parser) if tool_parser else renderers.DefaultRendererConfig()
    )


def _client_config(base_url: str, tokenizer: str, tool_parser: str | None = "qwen3", headers: dict | None = None):
    import verifiers.v1 as vf

    renderer = renderer_config(tokenizer, tool_parser)
    return vf.TrainClientConfig(  # pyright: ignore[reportCallIssue] (verifiers' Field(default, ...) positional defaults read as required)
        base_url=base_url.rstrip("/") + "/v1",
        api_key_var="PRIMERL_INFERENCE_API_KEY",
        renderer=renderer,
        renderer_model_name=tokenizer,
        headers=headers or {},
    )


class EnvMix:
    """Which training environment the next task comes from, in proportion to the weights.

    Smooth weighted round-robin: deterministic, and after any number of draws each environment's
    count is within one of `draws * weight / total` (a random choice would drift by
    ~sqrt(draws)). `state()` / `load_state()` carry it, and each environment's task position,
    across a resume.
    """

    def __init__(self, envs: list[Environment]) -> None:
        if not envs:
            raise EnvLoadError("no training environments: add at least one [[envs.train]] entry")
        names = [e.name for e in envs]
        if len(set(names)) != len(names):
            raise EnvLoadError(f"training environments need distinct names, got {names} (set envs.train.*.name)")
        self.envs = envs
        self.weights = [e.cfg.weight for e in envs]
        self.total = sum(self.weights)
        self.current = [0.0] * len(envs)

    def next(self) -> Environment:
        for i, w in enumerate(self.weights):
            self.current[i] += w
        best = max(range(len(self.envs)), key=lambda i: self.current[i])
        self.current[best] -= self.total
        return self.envs[best]

    def state(self) -> dict:
        return {"current": list(self.current), "positions": {e.name: e.tasks.position for e in self.envs}}

    def load_state(self, state: dict) -> None:
        """Continue from `state()`; task positions are fast-forwarded in each stream."""
        self.current = [float(x) for x in state["current"]]
        for env in self.envs:
            target = int(state["positions"].get(env.name, 0))
            if target < env.tasks.position:
                raise ValueError(f"environment {env.name!r} is already past position {target}")
            while env.tasks.position < target:
                env.tasks.next()
