"""A reverse-text taskset whose reward function misbehaves on some rollouts, as a user's
environment might: the n-th call (in this process) returns VALUES[n % len(VALUES)]."""

import itertools

import verifiers.v1 as vf
from primerl_envs.tasks import AnswerData
from primerl_reverse_text import ReverseTextConfig, ReverseTextTaskset

__all__ = ["FlakyTaskset"]

VALUES = [0.2, float("nan"), 0.9, float("inf"), 0.4, float("-inf"), 0.6, "1.0", 0.1, None, 0.8, 0.3]
BAD = 5
"""How many of VALUES are not finite numbers."""
_calls = itertools.count()


class FlakyTask(vf.Task[AnswerData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=1.0)
    async def flaky(self, trace: vf.Trace):
        return VALUES[next(_calls) % len(VALUES)]


class FlakyTaskset(vf.Taskset[FlakyTask, ReverseTextConfig]):
    def load(self):
        for task in ReverseTextTaskset.load(self):
            yield FlakyTask(task.data, task.config)
