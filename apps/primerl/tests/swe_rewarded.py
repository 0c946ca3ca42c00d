"""The built-in swe taskset (its synthetic instances, per-rollout sandboxes, tools and judge) with
a reward that a random tiny model's rollouts differ in: a hundredth per character of the last
reply plus a tenth per command run. Its own reward (the hidden tests passing) is 0 for every
such rollout, so every group would have zero advantage and nothing would train."""

import verifiers.v1 as vf
from primerl_swe import SweTask, SweTaskset

__all__ = ["LengthRewardedSweTaskset"]


class LengthRewardedSweTask(SweTask):
    @vf.reward(weight=1.0)
    async def length(self, trace: vf.Trace) -> float:
        return 0.01 * len(trace.last_reply or "") + 0.1 * getattr(trace.state, "commands", 0)


class LengthRewardedSweTaskset(SweTaskset):
    def load(self):
        for task in super().load():
            yield LengthRewardedSweTask(task.data, task.config)
