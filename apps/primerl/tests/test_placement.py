"""GPU placement of `primerl rl` (a pure function of the config: no GPU needed to test it)."""

import pytest
from primerl.configs import RLConfig
from primerl.launch import RunError, gpu_plan
from primerl_inference.config import InferenceConfig
from primerl_protocol.config import ModelConfig, TransportConfig


def cfg(ranks=2, colocate=False, trainer_gpus=None, **inference):
    return RLConfig(model=ModelConfig(name="m"), transport=TransportConfig(trainer_ranks=ranks),
                    inference=InferenceConfig(**inference), colocate=colocate, trainer_gpus=trainer_gpus)


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
