"""A reverse-text taskset whose reward function always raises, as a user's broken one does:
every rollout errors."""

import verifiers.v1 as vf
from primerl_envs.tasks import AnswerData
from primerl_reverse_text import ReverseTextConfig, ReverseTextTaskset

__all__ = ["RaisingTaskset"]

MESSAGE = "the user's reward function is broken"


class RaisingTask(vf.Task[AnswerData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=1.0)
    async def broken(self, trace: vf.Trace):
        raise KeyError(MESSAGE)


class RaisingTaskset(vf.Taskset[RaisingTask, ReverseTextConfig]):
    def load(self):
        for task in ReverseTextTaskset.load(self):
            yield RaisingTask(task.data, task.config)
