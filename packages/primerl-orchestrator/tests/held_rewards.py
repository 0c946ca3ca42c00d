"""A reverse-text taskset whose reward holds back one task's rollouts: the first rollout scored
names the task, and every rollout of that task waits in its reward until a test sets RELEASED
(this module's global, read in the orchestrator's process). Its group finishes late, as a
group on a slow environment or a slow server does."""

import asyncio

import verifiers.v1 as vf
from primerl_envs.tasks import AnswerData
from primerl_reverse_text import ReverseTextConfig, ReverseTextTaskset

__all__ = ["HeldTaskset"]

RELEASED = False
HELD: list[str] = []
"""The answer of the task held back (set by the first rollout scored)."""


class HeldTask(vf.Task[AnswerData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=1.0)
    async def held(self, trace: vf.Trace):
        if not HELD:
            HELD.append(self.data.answer)
        while self.data.answer == HELD[0] and not RELEASED:
            await asyncio.sleep(0.05)
        return 0.5


class HeldTaskset(vf.Taskset[HeldTask, ReverseTextConfig]):
    def load(self):
        for task in ReverseTextTaskset.load(self):
            yield HeldTask(task.data, task.config)
