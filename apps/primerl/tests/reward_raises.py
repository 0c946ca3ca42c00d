"""The built-in reverse-text taskset with a reward function that raises on every rollout, as a
user's bug would: verifiers records a TaskError raised from the ZeroDivisionError below."""

import verifiers.v1 as vf
from primerl_envs.tasks import AnswerData
from primerl_reverse_text import ReverseTextConfig, ReverseTextTaskset

__all__ = ["RaisingTaskset"]


def score(reply: str) -> float:
    return len(reply) / (len(reply) - len(reply))


class RaisingTask(vf.Task[AnswerData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=1.0)
    async def similarity(self, trace: vf.Trace) -> float:
        return score(trace.last_reply or "")


class RaisingTaskset(vf.Taskset[RaisingTask, ReverseTextConfig]):
    def load(self):
        for task in ReverseTextTaskset.load(self):
            yield RaisingTask(task.data, task.config)
