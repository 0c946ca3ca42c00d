"""A group of single-turn rollouts as one request: render once, sample n = group_size, score.

    plan, why = single_turn_plan(env, name, harness_id)   # plan None: the environment needs episodes
    rollouts = await group_rollouts(plan, task, ctx, n=8, sample_ids=[...], group_id=3)

An episode of a plain verifiers taskset under primerl's chat harness, when its tasks have no
tools, is exactly one model call: the prompt is rendered with the model's chat template, one
reply is sampled, and the task's rewards score the trace. verifiers runs each such episode on
its own (a runtime, an interception server the harness posts to, the training client's request
to vLLM, the trace's scoring): about 4 ms of the orchestrator's CPU a rollout and one HTTP
request to the server each, which on a 2-core machine was most of a reverse-text step.

Here the group's rollouts share that work. The prompt is rendered once by the same renderer
verifiers' training client uses (its `ElasticRendererPool`), the server samples all of the
group's replies from one `/inference/v1/generate` request with `n` = group size (the prompt is
processed once and the replies decode in one batch), each reply is parsed by that renderer
into the same `Response` the training client builds, committed to a fresh trace through
verifiers' own graph (`prepare_turn` / `commit`), and scored by the task's own `score`. So a
rollout carries the same prompt tokens, reply, logprobs, rewards and metrics as the episode.

What decides it (`single_turn_plan`): the environment is verifiers' `SingleAgentEnv` played by
the `primerl-chat` harness, and its tasks declare nothing a single model call would skip: no
tools or toolsets, no `@stop` or `@intercept` hooks, no judges, no overridden task `setup` /
`finalize` / `stage_verifier`, no reward or metric that needs a runtime, no token limits on
the agent. Anything else runs whole episodes as before, and so does a task whose prompt holds
images. One difference remains and is by design: a reply that reads as a tool call ends the
rollout (the task has no tools to run), where the chat harness would answer it with "no tool
named ..." and ask again.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from primerl_protocol.rollouts import Rollout

from primerl_envs.rollouts import trace_to_rollout

if TYPE_CHECKING:
    from renderers import Message

HARNESS = "primerl-chat"
TASK_HOOKS = ("setup", "finalize", "stage_verifier")
"""Task methods a single model call would not run: a task overriding one needs episodes."""


class ServerAnswerError(ValueError):
    """The server's answer to a group request cannot be read (names what was wrong)."""


@dataclass
class SingleTurnPlan:
    """What a group request needs of its environment, found once when the environment starts."""

    name: str
    agent: Any
    """The resolved AgentConfig of the one seat (recorded on each trace, as verifiers does)."""
    timeout_s: float | None


def _overrides(cls: type, base: type, name: str) -> bool:
    return getattr(cls, name, None) is not getattr(base, name, None)


def single_turn_plan(env, name: str, harness_id: str) -> tuple[SingleTurnPlan | None, str]:
    """(a plan when `env`'s episodes are single model calls, else None; why not, or "").

    `env` is a started verifiers Env; only what is known before any task runs decides (a task
    whose prompt turns out to hold images still runs as an episode)."""
    import verifiers.v1 as vf
    from verifiers.v1.envs.single_agent.env import SingleAgentEnv
    from verifiers.v1.utils.decorators import discover_decorated

    if type(env) is not SingleAgentEnv:
        return None, f"its env class {type(env).__name__} runs its own episodes"
    if harness_id != HARNESS:
        return None, f"harness {harness_id!r} is not {HARNESS!r}"
    taskset = env.taskset
    task_cls = type(taskset).task_type()
    if task_cls.toolsets(taskset.config.task) or taskset.toolsets(taskset.config):
        return None, "its tasks have tools"
    for hook in TASK_HOOKS:
        if _overrides(task_cls, vf.Task, hook):
            return None, f"its task class overrides {hook}()"
    if taskset.config.task.judges:
        return None, "its tasks have judges"
    probe = object.__new__(task_cls)  # the hooks are the class's and the config's: no task data needed
    probe.config = taskset.config.task
    if probe.hooks("stop") or discover_decorated(probe, "intercept"):
        return None, "its tasks have @stop or @intercept hooks"
    for fn in (*probe.hooks("reward"), *probe.hooks("metric")):
        if _needs_runtime(fn):
            return None, f"{fn.__name__} needs a runtime"
    agent = env.config.agent
    limits = [k for k in ("max_input_tokens", "max_output_tokens", "max_total_tokens") if getattr(agent, k) is not None]
    if limits:
        return None, f"the agent has token limits ({', '.join(limits)})"
    timeout = env.config.timeout.episode
    return SingleTurnPlan(name=name, agent=agent, timeout_s=timeout), ""


def _needs_runtime(fn) -> bool:
    import inspect

    param = inspect.signature(fn).parameters.get("runtime")
    return param is not None and param.default is inspect.Parameter.empty


def has_images(messages: list[dict]) -> bool:
    return any(
        isinstance(m.get("content"), list)
        and any(isinstance(p, dict) and p.get("type") != "text" for p in m["content"])
        for m in messages
    )


async def group_rollouts(
    plan: SingleTurnPlan,
    task,
    ctx,
    *,
    n: int,
    sample_ids: list[int],
    group_id: int,
    temperature: float = 1.0,
    policy_step: int = 0,
) -> list[Rollout] | None:
    """The `n` rollouts of one group of `task` from one request (None: the task's prompt needs
    an episode, e.g. it holds images). Never raises for what went wrong in the request or the
    scoring: a failed request makes `n` errored rollouts whose error starts with
    "ProviderError" (the caller may retry elsewhere); an unreadable answer, errored rollouts
    naming what was wrong."""
    import primerl_chat

    messages = primerl_chat.initial_messages(task.data.system_prompt, task.data.prompt)
    if has_images(messages):
        return None
    meta = {"group_id": group_id, "env": plan.name, "temperature": temperature, "policy_step": policy_step}
    started = time.time()
    try:
        async with asyncio.timeout(plan.timeout_s):
            traces = await _sample_and_score(plan, task, ctx, messages, n, started)
    except TimeoutError:
        error = f"TimeoutError: the group's request and scoring took over {plan.timeout_s:g}s (envs.*.timeout_s)"
        return [Rollout(sample_id=s, turns=[], error=error, truncated=True, **meta) for s in sample_ids]
    except _RequestFailed as e:
        return [Rollout(sample_id=s, turns=[], error=f"ProviderError: {e}", **meta) for s in sample_ids]
    except ServerAnswerError as e:
        return [Rollout(sample_id=s, turns=[], error=f"ServerAnswerError: {e}", **meta) for s in sample_ids]
    return [trace_to_rollout(t, sample_id=s, **meta) for t, s in zip(traces, sample_ids, strict=True)]


class _RequestFailed(RuntimeError):
    pass


async def _sample_and_score(plan: SingleTurnPlan, task, ctx, messages: list[dict], n: int, started: float) -> list:
    from verifiers.v1.clients.train import ElasticRendererPool
    from verifiers.v1.dialects import ChatDialect

    client = ctx.client
    sampling = ctx.sampling.model_dump(exclude_none=True)
    template_kwargs = sampling.pop("chat_template_kwargs", None)
    cache_salt = sampling.pop("cache_salt", None)  # a request field, as the training client sends it
    pool = ElasticRendererPool(
        client.renderer_model_name or ctx.model,
        client.renderer,
        chat_template_kwargs=template_kwargs,
        multiplex=client.multiplex,
    )
    prompt = ChatDialect().parse_request({"model": ctx.model, "messages": messages}).messages
    # cast: initial_messages' chat dicts (role, content, ...) are the renderers' Message, in shape
    chat = cast("list[Message]", messages)
    async with pool.acquire() as slot:
        renderer = slot.renderer
        rendered = await slot.run(lambda: renderer.render(chat, add_generation_prompt=True))
        params = {
            **sampling,
            "n": n,
            "logprobs": 1,
            "skip_special_tokens": False,
            "stop_token_ids": renderer.get_stop_token_ids(),
        }
        if not params.get("stop"):  # the reply is parsed from its ids: the server need not decode text
            params.setdefault("detokenize", False)
        body = {"model": ctx.model, "token_ids": rendered.token_ids, "sampling_params": params}
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        data = await _post(client, body)
        choices = _choices(data, n)
        results = [_result(c, rendered, renderer, data) for c in choices]
    traces = [_committed_trace(plan, task, prompt, ctx.model, result, started) for result in results]
    await asyncio.gather(*(_score(plan, task, trace) for trace in traces))
    return traces


async def _post(client, body: dict) -> dict:
    import aiohttp
    import primerl_chat

    url = client.base_url.rstrip("/").removesuffix("/v1") + "/inference/v1/generate"
    headers = dict(client.headers or {})
    if key := os.environ.get(client.api_key_var or ""):
        headers["Authorization"] = f"Bearer {key}"
    try:
        async with primerl_chat.http_session().post(url, json=body, headers=headers) as response:
            raw = await response.read()
    except (aiohttp.ClientError, OSError) as e:
        raise _RequestFailed(f"{url}: {type(e).__name__}: {e}") from e
    if response.status != 200:
        raise _RequestFailed(f"{url} answered HTTP {response.status}: {raw[:300]!r}")
    try:
        data = json.loads(raw)
    except ValueError as e:
        raise ServerAnswerError(f"{url} answered something that is not JSON ({e}): {raw[:200]!r}") from e
    if not isinstance(data, dict):
        raise ServerAnswerError(f"{url} answered a JSON {type(data).__name__}, not an object")
    return data


def _choices(data: dict, n: int) -> list[dict]:
    choices = data.get("choices")
    if not isinstance(choices, list) or len(choices) != n or not all(isinstance(c, dict) for c in choices):
        got = len(choices) if isinstance(choices, list) else type(choices).__name__
        raise ServerAnswerError(f"asked for {n} replies, the answer holds {got} choices")
    return sorted(choices, key=lambda c: c.get("index", 0) if isinstance(c.get("index"), int) else 0)


def _logprobs(choice: dict, ids: list[int]) -> list[float]:
    """The sampled tokens' logprobs (vLLM's tokens mode `{"token_id": N, ...}` or text mode
    `{"token": "token_id:N", ...}`), checked against the tokens they belong to."""
    content = (choice.get("logprobs") or {}).get("content") if isinstance(choice.get("logprobs"), dict) else None
    if not isinstance(content, list) or len(content) != len(ids):
        raise ServerAnswerError(
            f"{len(ids)} sampled tokens but logprobs for {len(content) if isinstance(content, list) else 'none'}"
        )
    out = []
    for i, (entry, token) in enumerate(zip(content, ids)):
        if not isinstance(entry, dict):
            raise ServerAnswerError(f"logprob {i} is a {type(entry).__name__}, not an object")
        named = entry.get("token_id", entry.get("token"))
        if named != token and named != f"token_id:{token}":
            raise ServerAnswerError(f"logprob {i} belongs to token {named!r}, the reply's token is {token}")
        lp = entry.get("logprob")
        if isinstance(lp, bool) or not isinstance(lp, (int, float)) or not math.isfinite(lp):
            raise ServerAnswerError(f"logprob {i} is {lp!r}, not a finite number")
        out.append(float(lp))
    return out


def _result(choice: dict, rendered, renderer, data: dict) -> dict:
    """One reply as the dict `renderers.client.generate` returns for a single request."""
    from renderers.base import ToolCallParseStatus

    ids = choice.get("token_ids")
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise ServerAnswerError(f"a reply's token_ids are {str(ids)[:80]}, not a list of token ids")
    logprobs = _logprobs(choice, ids)
    parsed = renderer.parse_response(ids, prompt_ids=list(rendered.token_ids), tools=None)
    finish = choice.get("finish_reason")
    if finish == "stop" and any(tc.status == ToolCallParseStatus.OK for tc in parsed.tool_calls):
        finish = "tool_calls"
    return {
        "request_id": data.get("request_id") or "",
        "prompt_ids": list(rendered.token_ids),
        "renderer_prompt_ids": None,
        "completion_ids": ids,
        "completion_logprobs": logprobs,
        "content": parsed.content,
        "reasoning_content": parsed.reasoning_content,
        "tool_calls": parsed.tool_calls,
        "finish_reason": finish,
        "prompt_attribution": rendered,
    }


def _committed_trace(plan: SingleTurnPlan, task, prompt, model: str, result: dict, started: float):
    """A fresh trace of `task` holding the prompt and the reply, built by verifiers' own graph."""
    from verifiers.v1.clients.train import response_from_generate
    from verifiers.v1.graph import prepare_turn
    from verifiers.v1.state import state_cls
    from verifiers.v1.trace import AgentInfo, ModelCall, TimeSpan, Trace, TraceTask

    trace = Trace(
        task=TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
        state=state_cls(type(task))(),
        agent=AgentInfo(config=plan.agent),
    )
    response = response_from_generate(result, model)
    node = prepare_turn(trace, list(prompt)).commit(response)
    trace.calls.append(
        ModelCall(
            node=node,
            model=model,
            endpoint="/chat/completions",
            finish_reason=response.finish_reason,
            usage=response.usage,
            time=TimeSpan(start=started, end=time.time()),
        )
    )
    return trace


async def _score(plan: SingleTurnPlan, task, trace) -> None:
    """The task's own scoring (as verifiers scores an episode), failures recorded on the trace."""
    try:
        await task.score(trace)
    except Exception as e:  # noqa: BLE001 - a reward function that raised is the rollout's error
        trace.record_error(e)
    trace.is_completed = True
    trace.ok = not trace.errors
