"""GPU placement of `primerl rl` (a pure function of the config: no GPU needed to test it),
and the trainer's CPU threads."""

import os

import msgspec
import pytest
from primerl.configs import RLConfig
from primerl.errors import RunError
from primerl.launch import gpu_plan, trainer_threads
from primerl_inference.config import InferenceConfig
from primerl_protocol.config import ModelConfig, TransportConfig


def cfg(ranks=2, colocate=False, trainer_gpus=None, **inference):
    return RLConfig(
        model=ModelConfig(name="m"),
        transport=TransportConfig(trainer_ranks=ranks),
        inference=InferenceConfig(**inference),
        colocate=colocate,
        trainer_gpus=trainer_gpus,
    )


def test_cpu_has_no_gpus():
    assert gpu_plan(cfg(), "cpu") == ([], [])


def test_default_split_inference_first_then_trainer():
    # 2 replicas x tensor parallel 2 = GPUs 0-3 for inference, the trainer's 2 ranks on 4 and 5
    assert gpu_plan(cfg(ranks=2, num_replicas=2, tensor_parallel_size=2), "cuda") == ([0, 1, 2, 3], [4, 5])


def test_explicit_gpus_and_colocation():
    assert gpu_plan(cfg(ranks=2, gpus=[6, 7], num_replicas=2, trainer_gpus=[0, 1]), "cuda") == ([6, 7], [0, 1])
    assert gpu_plan(cfg(ranks=1, colocate=True), "cuda") == ([0], [0])


def test_bad_plans_are_named():
    with pytest.raises(RunError, match=r"trainer_gpus \[0, 1\] overlap inference GPUs \[0\]; set colocate = true"):
        gpu_plan(cfg(ranks=2, trainer_gpus=[0, 1]), "cuda")
    with pytest.raises(RunError, match=r"trainer_ranks = 2 but the trainer gets GPUs \[3\]"):
        gpu_plan(cfg(ranks=2, trainer_gpus=[3]), "cuda")


def test_trainer_threads_share_the_cores_only_when_training_and_generation_alternate():
    cores = len(os.sched_getaffinity(0))
    on_policy = msgspec.structs.replace(
        cfg(ranks=1), orchestrator=msgspec.structs.replace(cfg().orchestrator, max_async_level=0)
    )
    assert trainer_threads(on_policy, []) == cores
    two_ranks = msgspec.structs.replace(on_policy, transport=TransportConfig(trainer_ranks=2))
    assert trainer_threads(two_ranks, []) == max(1, cores // 2)
    assert trainer_threads(cfg(ranks=1), []) == 1  # max_async_level 1 (the default): vLLM computes meanwhile
    assert trainer_threads(on_policy, [0]) == 1  # GPUs
