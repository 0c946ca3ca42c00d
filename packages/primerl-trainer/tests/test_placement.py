"""Placing the model: `cpu_offload` on a CPU trainer (no GPU) is ignored with one warning, and the
step runs; FSDP2's CPUOffloadPolicy there died pinning memory ("Cannot access accelerator device
when none is available"). A one-rank gloo group in this process."""

import logging

import pytest
import torch
from primerl_models import load_model
from primerl_models.tiny import build_tiny_model
from primerl_trainer.config import OptimizerConfig
from primerl_trainer.optim import build_optimizer
from primerl_trainer.placement import parallelize
from primerl_trainer.testing import one_rank_group


@pytest.fixture
def d(monkeypatch):
    with one_rank_group(monkeypatch) as d:
        yield d


def test_cpu_offload_on_a_cpu_trainer_is_ignored_with_a_warning_and_the_step_runs(tmp_path, d, caplog):
    assert d.device.type == "cpu"
    model = load_model(build_tiny_model(tmp_path, "qwen3", num_layers=2, init_std=0.2))
    with caplog.at_level(logging.WARNING, logger="primerl.trainer"):
        parallelize(model, d.device, bf16=False, cpu_offload=True)
    warned = [r.getMessage() for r in caplog.records if "cpu_offload" in r.getMessage()]
    assert len(warned) == 1 and "ignored" in warned[0] and "CPU trainer" in warned[0]
    opt = build_optimizer(model, OptimizerConfig(cpu_offload=True), d.device)
    before = [p.detach().full_tensor().clone() for p in model.parameters()]
    ids = torch.randint(0, 50, (1, 12))
    model.logits(ids, torch.arange(12)[None]).logsumexp(-1).sum().backward()
    opt.step()
    after = [p.detach().full_tensor() for p in model.parameters()]
    assert all(p.device.type == "cpu" for p in after) and any(not torch.equal(a, b) for a, b in zip(after, before))
