"""The root config of each command: the shared values plus the sections the command needs.

`primerl rl` reads an RLConfig; when it starts the trainer, orchestrator and inference it
hands each the projection of the same config onto its own root (`cfg.project(TrainerRunConfig)`),
so shared values are written once and never copied.
"""

from __future__ import annotations

import msgspec
from primerl_envs.config import EnvsConfig
from primerl_inference.config import InferenceConfig
from primerl_orchestrator.config import EvalSettings, OrchestratorConfig
from primerl_protocol.config import SharedConfig
from primerl_trainer.config import SFTDataConfig, TrainerConfig


class TrainerRunConfig(SharedConfig):
    """`primerl-trainer`: one torchrun rank group of the RL trainer."""

    trainer: TrainerConfig = msgspec.field(default_factory=TrainerConfig)
    """The FSDP2 trainer: optimizer, schedule, loss, checkpoints, weight publishing."""


class InferenceRunConfig(SharedConfig):
    """`primerl-inference`: the vLLM servers."""

    inference: InferenceConfig = msgspec.field(default_factory=InferenceConfig)
    """vLLM servers: replicas, parallelism, admin token."""


class OrchRunConfig(SharedConfig):
    """`primerl-orch`: the rollout loop."""

    orchestrator: OrchestratorConfig = msgspec.field(default_factory=OrchestratorConfig)
    """Rollout loop: batch and group size, off-policy bound, sampling, advantages, filters."""
    inference: InferenceConfig = msgspec.field(default_factory=InferenceConfig)
    """Where the inference servers are."""
    envs: EnvsConfig = msgspec.field(default_factory=EnvsConfig)
    """Training and eval environments."""


class RLConfig(SharedConfig):
    """`primerl rl`: a whole asynchronous RL run on this machine."""

    trainer: TrainerConfig = msgspec.field(default_factory=TrainerConfig)
    """The FSDP2 trainer: optimizer, schedule, loss, checkpoints, weight publishing."""
    orchestrator: OrchestratorConfig = msgspec.field(default_factory=OrchestratorConfig)
    """Rollout loop: batch and group size, off-policy bound, sampling, advantages, filters."""
    inference: InferenceConfig = msgspec.field(default_factory=InferenceConfig)
    """vLLM servers: replicas, parallelism, admin token."""
    envs: EnvsConfig = msgspec.field(default_factory=EnvsConfig)
    """Training and eval environments."""
    trainer_gpus: list[int] | None = None
    """GPUs of the trainer, one rank each (default: the GPUs after inference's); ignored on CPU."""
    colocate: bool = False
    """Inference and trainer share the same GPUs (lower inference.gpu_memory_utilization to
    leave the trainer room)."""


class SFTConfig(SharedConfig, kw_only=True):
    """`primerl sft`: supervised fine-tuning."""

    data: SFTDataConfig
    """Training data (JSONL/Parquet with prompt/completion or messages)."""
    trainer: TrainerConfig = msgspec.field(default_factory=TrainerConfig)
    """The FSDP2 trainer (its loss section is not used)."""


class EvalConfig(SharedConfig):
    """`primerl eval`: evaluate a model, or every published step of a run."""

    inference: InferenceConfig = msgspec.field(default_factory=InferenceConfig)
    """vLLM servers that generate the eval rollouts."""
    envs: EnvsConfig = msgspec.field(default_factory=EnvsConfig)
    """The eval environments (`envs.eval`)."""
    eval: EvalSettings = msgspec.field(default_factory=EvalSettings)
    """Samples per task and sampling temperature."""
    run: str | None = None
    """Evaluate each published step in this run directory instead of `model`."""
