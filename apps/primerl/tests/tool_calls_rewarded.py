"""The built-in tool-use taskset (its tasks, tools and multi-turn episodes) with a reward that a
random tiny model's rollouts differ in: a tenth per tool call plus a hundredth per character of
the last reply. Its own reward (the exact boxed value) is 0 for every such rollout, so every
group would have zero advantage and nothing would train."""

import verifiers.v1 as vf
from primerl_tool_use import ToolUseTask as _ToolUseTask
from primerl_tool_use import ToolUseTaskset

__all__ = ["CallsRewardedTaskset"]


class CallsRewardedTask(_ToolUseTask):
    @vf.reward(weight=1.0)
    async def calls(self, trace: vf.Trace) -> float:
        calls = sum(len(m.tool_calls or []) for m in trace.messages if m.role == "assistant")
        return 0.1 * calls + 0.01 * len(trace.last_reply or "")


class CallsRewardedTaskset(ToolUseTaskset):
    def load(self):
        for task in super().load():
            yield CallsRewardedTask(task.data, task.config)
