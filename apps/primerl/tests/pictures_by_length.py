"""The built-in shapes taskset rewarded a hundredth per character of the reply, which a random
tiny vision-language model's rollouts differ in (its own exact-answer reward is 0 for every
such rollout: every group would have zero advantage and the weights would never move)."""

import verifiers.v1 as vf
from primerl_shapes import ShapesTask, ShapesTaskset

__all__ = ["LengthRewardedTaskset"]


class LengthRewardedTask(ShapesTask):
    @vf.reward(weight=1.0)
    async def exact(self, trace: vf.Trace) -> float:
        return 0.01 * len(trace.last_reply or "")


class LengthRewardedTaskset(ShapesTaskset):
    def load(self):
        for task in super().load():
            yield LengthRewardedTask(task.data, task.config)
