"""Task data shared by the built-in environments."""

from __future__ import annotations

import verifiers.v1 as vf


class AnswerData(vf.TaskData):
    """A task with one reference answer."""

    answer: str
    """The reference answer the reward compares the reply with."""
