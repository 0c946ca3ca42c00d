"""An in-process chat harness for verifiers environments.

verifiers' own `null` harness runs its chat loop as a separate `uv run --script` process per
rollout (about 2.6 s of start-up each on a warm uv cache, and a PyPI resolution on a cold one).
RL on small models runs thousands of short rollouts a step, so primerl's default harness runs the
same loop inside the environment's process: verifiers' harness contract allows this ("the
interception is the contract, not the process"), every model call still goes through the
interception endpoint, so the trace records tokens, logprobs and tool calls exactly as with
`null`. Tools come from the task's MCP toolsets through verifiers' own MCP helpers.

Id for configs: `primerl-chat` (`agent.harness.id`); primerl sets it by default.
"""

from __future__ import annotations

import json
from contextlib import AsyncExitStack

import httpx
import verifiers.v1 as vf
from openai import APIStatusError, AsyncOpenAI
from verifiers.v1.harnesses.utils import mcp as vf_mcp

__all__ = ["ChatHarness"]


class ChatHarnessConfig(vf.HarnessConfig):
    """The in-process chat loop: model turns until a reply without tool calls."""


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
        system_prompt, prompt = self.resolve_prompt(data)
        messages: list[dict] = []
        if system_prompt:
            messages.append({"role": "system", "content": system_prompt})
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        elif prompt:
            messages.extend(m.model_dump(mode="json", exclude_none=True) for m in prompt)
        client = AsyncOpenAI(
            base_url=endpoint,
            api_key=secret,
            max_retries=0,
            timeout=httpx.Timeout(None, connect=10.0),
        )
        try:
            async with AsyncExitStack() as stack:
                tools: list[dict] = []
                dispatch: dict = {}
                servers: dict = {}
                if mcp_urls:
                    spec = {
                        "mcpServers": {
                            name: {"url": url, "timeout": self.config.tool_timeout}
                            for name, url in mcp_urls.items()
                        }
                    }
                    tools, dispatch, servers = await vf_mcp.connect_mcp(spec, stack)
                await self._loop(client, ctx.model, messages, tools, dispatch, servers, trace)
        finally:
            await client.close()
        return vf.ProgramResult(exit_code=0, stdout="", stderr="")

    async def _loop(self, client, model, messages, tools, dispatch, servers, trace) -> None:
        while True:
            kwargs: dict = {"model": model, "messages": messages}
            if tools:
                kwargs["tools"] = tools
            try:
                completion = await client.chat.completions.create(**kwargs)
            except APIStatusError:
                # The interception refuses a turn once a limit or @stop ended the rollout;
                # the trace already says why. Anything else is a real failure.
                if trace.stop_condition is not None:
                    return
                raise
            message = completion.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls or trace.stop_condition is not None:
                return
            for call in message.tool_calls:
                messages.append(await _run_tool(call, dispatch, servers))


async def _run_tool(call, dispatch: dict, servers: dict) -> dict:
    name = call.function.name
    try:
        args = json.loads(call.function.arguments or "{}")
    except json.JSONDecodeError as e:
        content = f"error: invalid JSON in tool arguments ({e})"
    else:
        if not isinstance(args, dict):
            content = f"error: tool arguments must be a JSON object, got {type(args).__name__}"
        elif name not in dispatch:
            content = f"error: no tool named {name!r}; available: {sorted(dispatch)}"
        else:
            content = await vf_mcp.call_mcp(servers, dispatch, name, args)
    return {"role": "tool", "tool_call_id": call.id, "name": name, "content": content}
