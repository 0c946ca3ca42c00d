"""A resume with changed optimizer settings trains with the new ones: a loaded optimizer and
LambdaLR carry the lr, weight decay and betas they were saved with, so without
`optim.apply_settings` a resume with a new lr went on with the old one, silently. Real DCP
checkpoints on a one-rank gloo group in this process."""

import pytest
import torch
from primerl_trainer.checkpoint import Checkpointer
from primerl_trainer.config import OptimizerConfig, SchedulerConfig
from primerl_trainer.optim import apply_settings, build_optimizer, build_scheduler, lr_factor
from primerl_trainer.testing import one_rank_group


@pytest.fixture
def d(monkeypatch):
    with one_rank_group(monkeypatch) as d:
        yield d


def parts(opt_cfg: OptimizerConfig, sched_cfg: SchedulerConfig, max_steps: int):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = build_optimizer(model, opt_cfg, torch.device("cpu"))
    return model, opt, build_scheduler(opt, sched_cfg, max_steps)


def test_a_resume_trains_with_the_configured_lr_weight_decay_and_betas(tmp_path, d):
    schedule = SchedulerConfig(type="linear", warmup_steps=0)
    model, opt, sched = parts(OptimizerConfig(lr=1e-3, weight_decay=0.01), schedule, max_steps=10)
    for _ in range(4):  # 4 steps on the linear decay
        model(torch.ones(2, 8)).square().sum().backward()
        opt.step()
        sched.step()
    Checkpointer(tmp_path, 2, d).save(3, model, opt, sched, {"next_step": 4})

    new = OptimizerConfig(lr=5e-3, weight_decay=0.1, betas=(0.8, 0.95))
    model, opt, sched = parts(new, schedule, max_steps=10)
    ckpt = Checkpointer(tmp_path, 2, d)
    ckpt.load(ckpt.latest(), model, opt, sched)
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-3 * lr_factor(4, schedule, 10))  # what torch restores
    changed = apply_settings(opt, sched, new)
    assert changed == ["lr 0.001 -> 0.005", "weight_decay 0.01 -> 0.1", "betas (0.9, 0.999) -> (0.8, 0.95)"]
    group = opt.param_groups[0]
    assert group["lr"] == pytest.approx(5e-3 * lr_factor(4, schedule, 10))  # the new peak at the resumed step
    assert group["weight_decay"] == 0.1 and group["betas"] == (0.8, 0.95)
    assert sched.get_last_lr() == [group["lr"]]
    opt.step()
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(5e-3 * lr_factor(5, schedule, 10))
    assert opt.state[next(iter(model.parameters()))]["step"] > 0  # the moments were restored, not reset
    assert apply_settings(opt, sched, new) == []  # nothing changed: nothing said
