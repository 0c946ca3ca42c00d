"""The learning rate of every optimizer step, against the schedules' formulas written out
here, and a schedule restored from a checkpoint continuing exactly where it stopped.

The trainer runs steps 0 .. max_steps - 1; step s trains with the learning rate the scheduler
has set after s scheduler steps. With W warm-up steps, peak lr, floor m = min_lr_ratio and
progress p(s) = (s - W) / (max_steps - W):

  warm-up  s < W:  lr (s + 1) / (W + 1)            (from lr/(W+1), never 0, to lr W/(W+1))
  constant s >= W: lr
  linear   s >= W: lr (m + (1 - m)(1 - p))
  cosine   s >= W: lr (m + (1 - m)(1 + cos(pi p)) / 2)
"""

import json
import math

import pytest
import torch
from primerl_trainer.config import SchedulerConfig
from primerl_trainer.optim import build_scheduler

PEAK = 1e-3


def expected_lr(s: int, kind: str, warmup: int, max_steps: int | None, floor: float) -> float:
    if s < warmup:
        return PEAK * (s + 1) / (warmup + 1)
    if kind == "constant" or max_steps is None:
        return PEAK
    p = (s - warmup) / (max_steps - warmup)
    shape = 1 - p if kind == "linear" else (1 + math.cos(math.pi * p)) / 2
    return PEAK * (floor + (1 - floor) * shape)


def optimizer() -> torch.optim.AdamW:
    return torch.optim.AdamW([torch.nn.Parameter(torch.ones(3))], lr=PEAK)


def lrs_used(opt, sched, steps: int) -> list[float]:
    """The learning rate each of `steps` optimizer steps runs with (as the trainer steps them)."""
    used = []
    for _ in range(steps):
        used.append(opt.param_groups[0]["lr"])
        assert sched.get_last_lr()[0] == used[-1]  # what the trainer logs is what AdamW uses
        for p in opt.param_groups[0]["params"]:
            p.grad = torch.ones_like(p)
        opt.step()
        sched.step()
    return used


CASES = [  # kind, warmup, max_steps, min_lr_ratio
    ("constant", 0, 10, 0.0),
    ("constant", 4, 10, 0.0),
    ("constant", 3, None, 0.0),
    ("linear", 0, 10, 0.0),
    ("linear", 4, 10, 0.1),
    ("cosine", 0, 8, 0.0),
    ("cosine", 4, 10, 0.1),
    ("cosine", 2, None, 0.1),  # no max_steps: nothing to decay towards, constant after warm-up
]


@pytest.mark.parametrize("kind, warmup, max_steps, floor", CASES)
def test_every_step_follows_the_formula(kind, warmup, max_steps, floor):
    cfg = SchedulerConfig(type=kind, warmup_steps=warmup, min_lr_ratio=floor)
    opt = optimizer()
    steps = max_steps or 12
    used = lrs_used(opt, build_scheduler(opt, cfg, max_steps), steps)
    assert used == pytest.approx([expected_lr(s, kind, warmup, max_steps, floor) for s in range(steps)], rel=1e-12)


def test_the_boundaries_by_hand():
    """W = 4, max_steps = 10, floor 0.1; values worked out by hand, not from the formula above."""

    def run(kind):
        opt = optimizer()
        cfg = SchedulerConfig(type=kind, warmup_steps=4, min_lr_ratio=0.1)
        return [lr / PEAK for lr in lrs_used(opt, build_scheduler(opt, cfg, 10), 10)]

    for kind in ("linear", "cosine"):
        f = run(kind)
        # warm-up: 1/5, 2/5, 3/5, 4/5 (step 0 is not 0: a first step at lr 0 would be wasted)
        assert f[:4] == pytest.approx([0.2, 0.4, 0.6, 0.8])
        assert f[4] == pytest.approx(1.0)  # the end of warm-up is the peak
        # half-way through the decay (p = 3/6) both shapes are at (1 + floor) / 2
        assert f[7] == pytest.approx(0.55)
        assert max(f) == pytest.approx(1.0) and min(f) >= 0.1
    linear, cosine = run("linear"), run("cosine")
    # last step, p = 5/6: linear 0.1 + 0.9 / 6 = 0.25; cosine 0.1 + 0.9 (1 - sqrt(3)/2) / 2
    assert linear[9] == pytest.approx(0.25)
    assert cosine[9] == pytest.approx(0.1 + 0.9 * (1 - math.sqrt(3) / 2) / 2)
    # p = 1/6 on step 5: linear 0.1 + 0.9 * 5/6 = 0.85; cosine 0.1 + 0.9 (1 + sqrt(3)/2) / 2
    assert linear[5] == pytest.approx(0.85)
    assert cosine[5] == pytest.approx(0.1 + 0.9 * (1 + math.sqrt(3) / 2) / 2)
    # linear falls by the same 0.15 each decay step; cosine falls slowest at both ends
    assert [linear[s] - linear[s + 1] for s in range(4, 9)] == pytest.approx([0.15] * 5)
    drops = [cosine[s] - cosine[s + 1] for s in range(4, 9)]
    assert drops[0] < drops[2] > drops[4]


@pytest.mark.parametrize("kind, warmup, max_steps, floor", [c for c in CASES if c[2] is not None])
@pytest.mark.parametrize("stop_after", [1, 4, 7])
def test_a_restored_schedule_continues_with_the_same_learning_rates(kind, warmup, max_steps, floor, stop_after):
    """Saved as the checkpoint saves it (scheduler.state_dict() through JSON, the optimizer's own
    state dict), restored into a freshly built optimizer and scheduler (as a resumed trainer
    builds them, at step 0) and continued: the same learning rate on every later step as a
    run that never stopped."""
    cfg = SchedulerConfig(type=kind, warmup_steps=warmup, min_lr_ratio=floor)
    opt = optimizer()
    uninterrupted = lrs_used(opt, build_scheduler(opt, cfg, max_steps), max_steps)

    opt = optimizer()
    sched = build_scheduler(opt, cfg, max_steps)
    first = lrs_used(opt, sched, stop_after)
    saved_sched, saved_opt = json.loads(json.dumps(sched.state_dict())), opt.state_dict()

    opt = optimizer()
    sched = build_scheduler(opt, cfg, max_steps)
    opt.load_state_dict(saved_opt)
    sched.load_state_dict(saved_sched)
    rest = lrs_used(opt, sched, max_steps - stop_after)

    assert first + rest == uninterrupted  # exactly: the same floats
    expected = [expected_lr(s, kind, warmup, max_steps, floor) for s in range(stop_after, max_steps)]
    assert rest == pytest.approx(expected, rel=1e-12)
