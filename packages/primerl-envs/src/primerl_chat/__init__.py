"""An in-process chat harness for verifiers environments.

verifiers' own `null` harness runs its chat loop as a separate `uv run --script` process per
rollout (about 2.6 s of start-up each on a warm uv cache, and a PyPI resolution on a cold one).
RL on small models runs thousands of short rollouts a step, so primerl's default harness runs the
same loop inside the environment's process: verifiers' harness contract allows this ("the
interception is the contract, not the process"), every model call still goes through the
interception endpoint, so the trace records tokens, logprobs and tool calls exactly as with
`null`. Tools come from the task's MCP toolsets through verifiers' own MCP helpers.

The model calls are plain HTTP posts to the interception endpoint on one aiohttp session per
event loop: the OpenAI SDK on httpx spent about half of the orchestrator's CPU time in
httpcore's connection-pool bookkeeping at 64 rollouts in flight (bench/orchestrator.py).

Id for configs: `primerl-chat` (`agent.harness.id`); primerl sets it by default.
"""

from __future__ import annotations

import asyncio
import json
import weakref
from contextlib import AsyncExitStack

import aiohttp
import verifiers.v1 as vf
from verifiers.v1.harnesses.utils import mcp as vf_mcp

__all__ = ["ChatHarness", "close_session", "http_session", "initial_messages"]


class ChatHarnessConfig(vf.HarnessConfig):
    """The in-process chat loop: model turns until a reply without tool calls."""


class ModelCallError(RuntimeError):
    """The interception endpoint refused a model call while the rollout was still running."""


class ChatHarness(vf.Harness[ChatHarnessConfig]):
    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_MCP = True
    SUPPORTS_RESUME = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(
        self,
        ctx: vf.ModelContext,
        trace: vf.Trace,
        runtime: vf.Runtime,
        endpoint: str,
        secret: str,
        mcp_urls: dict[str, str],
        data: vf.TaskData,
        tool_interception_url: str | None = None,
    ) -> vf.ProgramResult:
        messages = initial_messages(*self.resolve_prompt(data))
        async with AsyncExitStack() as stack:
            tools: list[dict] = []
            dispatch: dict = {}
            servers: dict = {}
            if mcp_urls:
                spec = {
                    "mcpServers": {
                        name: {"url": url, "timeout": self.config.tool_timeout} for name, url in mcp_urls.items()
                    }
                }
                tools, dispatch, servers = await vf_mcp.connect_mcp(spec, stack)
            call = _ModelCall(endpoint.rstrip("/") + "/chat/completions", secret)
            await self._loop(call, ctx.model, messages, tools, dispatch, servers, trace)
        return vf.ProgramResult(exit_code=0, stdout="", stderr="")

    async def _loop(self, call, model, messages, tools, dispatch, servers, trace) -> None:
        while True:
            body: dict = {"model": model, "messages": messages}
            if tools:
                body["tools"] = tools
            try:
                completion = await call(body)
            except ModelCallError:
                # The interception refuses a turn once a limit or @stop ended the rollout;
                # the trace already says why. Anything else is a real failure (the
                # interception keeps the model's own error for the trace).
                if trace.stop_condition is not None:
                    return
                raise
            message = {k: v for k, v in completion["choices"][0]["message"].items() if v is not None}
            messages.append(message)
            if not message.get("tool_calls") or trace.stop_condition is not None:
                return
            limit = next_turn_refused(trace)
            if limit is not None:  # no model turn would read the results: the tools do not run
                trace.stop(limit)
                return
            for tool_call in message["tool_calls"]:
                messages.append(await _run_tool(tool_call, dispatch, servers))


def initial_messages(system_prompt: str | None, prompt) -> list[dict]:
    """The chat a task opens with: its system prompt, if any, then its prompt (text as one user
    message, or the task's messages). The batched single-turn path (primerl_envs.single_turn)
    sends the same."""
    messages: list[dict] = []
    if system_prompt:
        messages.append({"role": "system", "content": system_prompt})
    if isinstance(prompt, str):
        messages.append({"role": "user", "content": prompt})
    elif prompt:
        messages.extend(m.model_dump(mode="json", exclude_none=True) for m in prompt)
    return messages


class _ModelCall:
    def __init__(self, url: str, secret: str) -> None:
        self.url = url
        self.headers = {"Authorization": f"Bearer {secret}"}

    async def __call__(self, body: dict) -> dict:
        async with http_session().post(self.url, json=body, headers=self.headers) as response:
            raw = await response.read()
        if response.status != 200:
            raise ModelCallError(f"model call answered HTTP {response.status}: {raw[:300]!r}")
        return json.loads(raw)


_SESSIONS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def http_session() -> aiohttp.ClientSession:
    """One HTTP session per event loop, shared by every rollout's model calls."""
    loop = asyncio.get_running_loop()
    session = _SESSIONS.get(loop)
    if session is None or session.closed:
        session = _SESSIONS[loop] = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),
            timeout=aiohttp.ClientTimeout(total=None, connect=10.0),
        )
    return session


async def close_session() -> None:
    """Close this event loop's session (the environments call it when they stop)."""
    session = _SESSIONS.pop(asyncio.get_running_loop(), None)
    if session is not None:
        await session.close()


def next_turn_refused(trace) -> str | None:
    """The limit (max_turns, token caps) that refuses the rollout's next model turn, if one does:
    verifiers' interception checks the same before serving a turn. Tools called in a turn after
    which none may follow must not run (they may change a sandbox the judge then reads)."""
    from verifiers.v1.session import RolloutLimits

    config = getattr(trace.agent, "config", None)
    if config is None:
        return None
    caps = ("max_turns", "max_input_tokens", "max_output_tokens", "max_total_tokens")
    return RolloutLimits(**{k: getattr(config, k, None) for k in caps}).reached(trace)


async def _run_tool(call: dict, dispatch: dict, servers: dict) -> dict:
    function = call.get("function") or {}
    name = function.get("name", "")
    try:
        args = json.loads(function.get("arguments") or "{}")
    except json.JSONDecodeError as e:
        content = f"error: invalid JSON in tool arguments ({e})"
    else:
        if not isinstance(args, dict):
            content = f"error: tool arguments must be a JSON object, got {type(args).__name__}"
        elif name not in dispatch:
            content = f"error: no tool named {name!r}; available: {sorted(dispatch)}"
        else:
            content = await vf_mcp.call_mcp(servers, dispatch, name, args)
    return {"role": "tool", "tool_call_id": call.get("id"), "name": name, "content": content}
