"""reverse-text: the model is given a string and must write it backwards.

Reward: the longest-common-subsequence ratio between the reply and the reversed string
(1.0 exact, partial credit for partly right). Data is generated from `seed`: random strings of
`min_length`..`max_length` characters from `alphabet`. The prompt is the bare string (no
instruction), which tiny models learn from quickly; set `instruction` to prefix one.
"""

from __future__ import annotations

import random
import string

import verifiers.v1 as vf
from primerl_envs.scoring import lcs_ratio
from primerl_envs.tasks import AnswerData

__all__ = ["ReverseTextTaskset"]


class ReverseTextTask(vf.Task[AnswerData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=1.0)
    async def lcs(self, trace: vf.Trace) -> float:
        return lcs_ratio(trace.last_reply or "", self.data.answer)


class ReverseTextConfig(vf.TasksetConfig):
    num_tasks: int = 1000
    """How many strings to generate."""
    min_length: int = 4
    """Shortest string."""
    max_length: int = 8
    """Longest string."""
    alphabet: str = string.ascii_lowercase
    """Characters the strings are made of."""
    instruction: str = ""
    """Text put before each string in the prompt."""
    seed: int = 0
    """Seed of the generated data."""


class ReverseTextTaskset(vf.Taskset[ReverseTextTask, ReverseTextConfig]):
    def load(self):
        cfg = self.config
        rng = random.Random(cfg.seed)
        for i in range(cfg.num_tasks):
            text = "".join(rng.choice(cfg.alphabet) for _ in range(rng.randint(cfg.min_length, cfg.max_length)))
            yield ReverseTextTask(
                AnswerData(id=f"reverse-{i}", prompt=cfg.instruction + text, answer=text[::-1]),  # pyright: ignore[reportCallIssue] (verifiers' Field(default, ...) positional defaults read as required)
                cfg.task,
            )
