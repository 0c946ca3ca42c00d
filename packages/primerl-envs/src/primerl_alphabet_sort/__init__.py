"""alphabet-sort: the model is given words and must list them in alphabetical order.

Reward: 1.0 for the exact sorted list; otherwise the longest-common-subsequence ratio of the
reply's words against the sorted words (so a nearly sorted list earns partial credit), times
0.5. Words are separated by single spaces in both prompt and answer.
"""

from __future__ import annotations

import random
import string

import verifiers.v1 as vf
from primerl_envs.scoring import lcs_ratio
from primerl_envs.tasks import AnswerData

__all__ = ["AlphabetSortTaskset"]


class AlphabetSortTask(vf.Task[AnswerData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=1.0)
    async def sorted_words(self, trace: vf.Trace) -> float:
        got = (trace.last_reply or "").split()
        want = self.data.answer.split()
        return 1.0 if got == want else 0.5 * lcs_ratio(got, want)


class AlphabetSortConfig(vf.TasksetConfig):
    num_tasks: int = 1000
    """How many word lists to generate."""
    min_words: int = 3
    """Fewest words per list."""
    max_words: int = 5
    """Most words per list."""
    word_length: int = 4
    """Letters per word."""
    instruction: str = "sort: "
    """Text put before the words in the prompt."""
    seed: int = 0
    """Seed of the generated data."""


class AlphabetSortTaskset(vf.Taskset[AlphabetSortTask, AlphabetSortConfig]):
    def load(self):
        cfg = self.config
        rng = random.Random(cfg.seed)
        for i in range(cfg.num_tasks):
            n = rng.randint(cfg.min_words, cfg.max_words)
            words = ["".join(rng.choice(string.ascii_lowercase) for _ in range(cfg.word_length)) for _ in range(n)]
            yield AlphabetSortTask(
                AnswerData(id=f"sort-{i}", prompt=cfg.instruction + " ".join(words), answer=" ".join(sorted(words))),  # pyright: ignore[reportCallIssue] (verifiers' Field(default, ...) positional defaults read as required)
                cfg.task,
            )
