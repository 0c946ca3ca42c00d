"""math: arithmetic and word problems with an exact-answer verifier.

The model must end its reply with `\\boxed{answer}`; the reward is 1.0 when the last boxed
answer equals the reference exactly (numerically: `7/2` equals `3.5`), else 0.0. A metric
`boxed` records whether any boxed answer was given. Problems are generated from `seed`:
`kind = "arithmetic"` (a op b with + - *), `"word"` (templated word problems), or `"mixed"`.
"""

from __future__ import annotations

import random

import verifiers.v1 as vf
from primerl_envs.scoring import boxed_answer_matches, last_boxed
from primerl_envs.tasks import AnswerData

__all__ = ["MathTaskset"]

WORD_PROBLEMS = [
    ("{name} has {a} apples and buys {b} more. How many apples does {name} have now?", lambda a, b: a + b),
    ("{name} had {a} marbles and gave away {b}. How many marbles are left?", lambda a, b: a - b),
    ("There are {a} boxes with {b} pens in each box. How many pens are there?", lambda a, b: a * b),
    ("{name} reads {b} pages a day. How many pages does {name} read in {a} days?", lambda a, b: a * b),
]
NAMES = ["Ann", "Bo", "Cy", "Di", "Ed"]


class MathTask(vf.Task[AnswerData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        return 1.0 if boxed_answer_matches(trace.last_reply or "", self.data.answer) else 0.0

    @vf.metric
    async def boxed(self, trace: vf.Trace) -> float:
        return 0.0 if last_boxed(trace.last_reply or "") is None else 1.0


class MathConfig(vf.TasksetConfig):
    num_tasks: int = 1000
    """How many problems to generate."""
    kind: str = "mixed"
    """arithmetic, word or mixed."""
    max_operand: int = 20
    """Largest operand."""
    instruction: str = "Put the final answer in \\boxed{}. "
    """Text put before each problem."""
    seed: int = 0
    """Seed of the generated data."""


class MathTaskset(vf.Taskset[MathTask, MathConfig]):
    def load(self):
        cfg = self.config
        if cfg.kind not in ("arithmetic", "word", "mixed"):
            raise ValueError(f"math: kind must be arithmetic, word or mixed, got {cfg.kind!r}")
        rng = random.Random(cfg.seed)
        for i in range(cfg.num_tasks):
            a, b = rng.randint(1, cfg.max_operand), rng.randint(1, cfg.max_operand)
            kind = cfg.kind if cfg.kind != "mixed" else rng.choice(["arithmetic", "word"])
            if kind == "arithmetic":
                op = rng.choice("+-*")
                question = f"{a} {op} {b} = ?"
                answer = {"+": a + b, "-": a - b, "*": a * b}[op]
            else:
                template, solve = rng.choice(WORD_PROBLEMS)
                a, b = max(a, b), min(a, b)
                question = template.format(name=rng.choice(NAMES), a=a, b=b)
                answer = solve(a, b)
            data = AnswerData(id=f"math-{i}", prompt=cfg.instruction + question, answer=str(answer))  # pyright: ignore[reportCallIssue] (verifiers' Field(default, ...) positional defaults read as required)
            yield MathTask(data, cfg.task)
