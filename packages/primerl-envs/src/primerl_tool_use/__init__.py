"""tool-use: multi-turn arithmetic with tools.

Each task asks for `(a + b) * c`. The model has tools (`tools_add`, `tools_mul`, and a
key-value store `tools_set` / `tools_get`), called as `<tool_call>{"name": ..., "arguments":
{...}}</tool_call>`; each call's result comes back as a `tool` message and the model goes on
until it answers `\\boxed{value}`. Reward 1.0 for the exact value, else 0.0; metrics count the
tool calls. Rollouts are cut at the environment's `max_turns` (primerl's `envs.*.max_turns`).
"""

from __future__ import annotations

import random

import verifiers.v1 as vf
from primerl_envs.scoring import boxed_answer_matches
from primerl_envs.tasks import AnswerData

from primerl_tool_use.tools import Tools

__all__ = ["ToolUseTaskset"]


class ToolUseTaskConfig(vf.TaskConfig):
    tools: vf.ToolsetConfig = vf.ToolsetConfig()
    """Config of the tool server."""


class ToolUseTask(vf.Task[AnswerData, vf.State, ToolUseTaskConfig]):
    @classmethod
    def toolsets(cls, config: ToolUseTaskConfig) -> list[vf.Toolset]:
        return [Tools(config.tools)]

    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        return 1.0 if boxed_answer_matches(trace.last_reply or "", self.data.answer) else 0.0

    @vf.metric
    async def tool_calls(self, trace: vf.Trace) -> float:
        return float(sum(len(m.tool_calls or []) for m in trace.messages if m.role == "assistant"))


class ToolUseConfig(vf.TasksetConfig):
    num_tasks: int = 1000
    """How many problems to generate."""
    max_operand: int = 50
    """Largest operand."""
    seed: int = 0
    """Seed of the generated data."""
    task: ToolUseTaskConfig = ToolUseTaskConfig()
    """Config passed to each task."""


class ToolUseTaskset(vf.Taskset[ToolUseTask, ToolUseConfig]):  # pyright: ignore[reportInvalidTypeArguments] (its config is ToolUseTaskConfig; verifiers' bound is invariant)
    def load(self):
        cfg = self.config
        rng = random.Random(cfg.seed)
        for i in range(cfg.num_tasks):
            a, b, c = (rng.randint(1, cfg.max_operand) for _ in range(3))
            prompt = f"Use the tools to compute ({a} + {b}) * {c}, then answer \\boxed{{value}}."
            data = AnswerData(id=f"tools-{i}", prompt=prompt, answer=str((a + b) * c))  # pyright: ignore[reportCallIssue] (verifiers' Field(default, ...) positional defaults read as required)
            yield ToolUseTask(data, cfg.task)
