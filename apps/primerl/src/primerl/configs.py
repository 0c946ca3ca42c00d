"""The root config of each command: the shared values plus the sections the command needs.

Each process's own root is defined by its package (TrainerRunConfig and SFTRunConfig in
primerl_trainer.config, OrchRunConfig and EvalRunConfig in primerl_orchestrator.config,
InferenceRunConfig in primerl_inference.config); a command adds what only it needs (the
Slurm job) and `primerl rl` joins them all.

`primerl rl` reads an RLConfig; when it starts the trainer, orchestrator and inference it
hands each the projection of the same config onto its own root (`cfg.project(TrainerRunConfig)`),
so shared values are written once and never copied.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from primerl_envs.config import EnvsConfig
from primerl_inference.config import LORA_RANKS, InferenceConfig, InferenceRunConfig, lora_rank_for
from primerl_orchestrator.config import EvalRunConfig, OrchestratorConfig, OrchRunConfig
from primerl_protocol.config import Config, NonNegative, Port, Positive, SharedConfig
from primerl_trainer.config import SFTRunConfig, TrainerConfig, TrainerRunConfig

__all__ = [
    "EvalConfig",
    "InferenceRunConfig",
    "OrchRunConfig",
    "PlanConfig",
    "RLConfig",
    "SFTConfig",
    "SlurmConfig",
    "TrainerRunConfig",
]


class SlurmConfig(Config):
    """`--slurm`: the sbatch job that runs this config on a Slurm cluster (docs/slurm.md)."""

    inference_nodes: NonNegative = 1
    """Nodes running inference servers (rl, eval): each runs `inference.num_replicas` servers."""
    trainer_nodes: Positive = 1
    """Nodes of the trainer (rl, sft): torchrun over them, `transport.trainer_ranks` ranks in all."""
    gpus_per_node: NonNegative = 8
    """GPUs per node (0: CPU nodes, for tests and demos)."""
    partition: str | None = None
    """Slurm partition (--partition)."""
    account: str | None = None
    """Slurm account (--account)."""
    time: str = "24:00:00"
    """Time limit of the job (--time)."""
    job_name: str | None = None
    """Job name (default: primerl-<command>-<run directory name>)."""
    exclusive: bool = True
    """Ask for whole nodes (--exclusive)."""
    setup: str = ""
    """Shell lines sourced by the job and before every role on every node: modules, a virtual
    environment (`source /shared/primerl/.venv/bin/activate`), NCCL settings. Empty: the bin
    folder of the Python that rendered the job goes first on PATH (a shared-file-system venv)."""
    container_image: str | None = None
    """Run every role in this container image (srun --container-image, pyxis/enroot)."""
    container_mounts: list[str] = []
    """Mounts for the container (srun --container-mounts), e.g. the shared run directory."""
    log_dir: str | None = None
    """Where the job's output and each role's log go (default: RUN_DIR/slurm)."""
    sbatch_args: list[str] = []
    """Extra #SBATCH lines, e.g. ["--qos=high", "--constraint=h100"]."""
    rendezvous_port: Port = 29500
    """Port of torchrun's c10d rendezvous on the first trainer node."""
    server_timeout_s: Positive = 1800
    """Fail the job when an inference server is not up after this many seconds."""


class PlanConfig(Config):
    """`primerl plan`: the memory each GPU of the run needs, checked before every launch on GPUs
    (docs/plan.md)."""

    gpu_memory_gib: Annotated[float, msgspec.Meta(gt=0)] | None = None
    """Memory of each GPU in GiB (an H100 80, an H200 139.8). None: the first visible GPU's
    (nvidia-smi); with none visible (a CPU run, a login node) nothing is checked."""
    host_memory_gib: Annotated[float, msgspec.Meta(gt=0)] | None = None
    """Host memory of each trainer node in GiB (`free -g`'s total), against which the plan checks
    what the trainer's ranks on a node keep there (trainer.optimizer.cpu_offload). None: this
    machine's (/proc/meminfo's MemTotal) for a run here; with --slurm that check is skipped."""
    check: bool = True
    """Refuse a launch the plan says does not fit, naming the keys to change (false: print the
    plan's verdict and start anyway)."""


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
    """GPUs of the trainer, one rank each; ignored on CPU. On one machine, default: the GPUs
    after inference's (colocated: inference's). With --slurm, the GPU indices of each trainer
    node (0 to slurm.gpus_per_node - 1; default: all of them), transport.trainer_ranks =
    slurm.trainer_nodes x len(trainer_gpus): without colocate, inference and trainer then share
    the job's nodes, the servers on each node's other GPUs (docs/slurm.md, "One node, split")."""
    colocate: bool = False
    """Inference and trainer share the same GPUs (the trainer trainer_gpus of them, if set);
    with --slurm, the same nodes. vLLM's share of each GPU: inference.gpu_memory_utilization,
    unset what the memory plan says the trainer leaves (docs/plan.md)."""
    slurm: SlurmConfig = msgspec.field(default_factory=SlurmConfig)
    """The sbatch job of `primerl rl --slurm`."""
    plan: PlanConfig = msgspec.field(default_factory=PlanConfig)
    """Whether the run fits its GPUs (`primerl plan`), checked before it starts."""

    def __post_init__(self) -> None:
        """Values the trainer and the orchestrator must agree on, checked before anything starts
        (otherwise the trainer refuses batches the orchestrator never sends again)."""
        self.trainer.parallel.layout(self.transport.ranks)
        rows = self.trainer.micro_batch_tokens
        if rows is not None and rows < self.seq_len:
            raise ValueError(
                f"trainer.micro_batch_tokens = {rows} is below seq_len = {self.seq_len}: the orchestrator packs "
                f"rows of up to seq_len tokens and the trainer would refuse every full one; leave it unset or >= seq_len"
            )
        if self.orchestrator.share_prompts:
            if (cp := self.trainer.parallel.cp) > 1:
                raise ValueError(
                    f"orchestrator.share_prompts = true with trainer.parallel.cp = {cp}: rows whose samples share a "
                    "prompt are not split over context-parallel ranks; set one of them off (or leave "
                    "orchestrator.share_prompts unset: it is then off with context parallelism)"
                )
            if self.trainer.attention == "varlen":
                raise ValueError(
                    'orchestrator.share_prompts = true with trainer.attention = "varlen": varlen kernels cannot attend '
                    'to a shared prompt; use trainer.attention = "auto" (flex attention on GPUs) or "flex"'
                )
        k, keep = self.orchestrator.max_async_level, self.trainer.weights.keep
        if keep <= k:
            raise ValueError(
                f"trainer.weights.keep = {keep} with orchestrator.max_async_level = {k}: the trainer may publish "
                f"{k} steps past the policy the servers are loading, so a kept window of {keep} can remove the folder "
                f"they still need; set trainer.weights.keep >= {k + 1}"
            )
        self._serve_adapters()

    def _serve_adapters(self) -> None:
        """A trainer that publishes LoRA adapters needs servers that load them: LoRA on, room
        for the adapters of every policy rollouts may still run on (max_async_level + 1), and a
        rank that holds them (checked against the model by `primerl rl` before it starts:
        launch.check). Settings that contradict it are refused, naming the keys."""
        lora, inf = self.trainer.lora, self.inference
        if lora is None or lora.publish != "adapter":
            return
        why = (
            'trainer.lora.publish = "adapter" (the default with [trainer.lora]): the servers load each step\'s adapter'
        )
        if inf.enable_lora is False:
            raise ValueError(
                f"inference.enable_lora = false, but {why}; leave inference.enable_lora unset (or true), "
                f'or publish merged weights: trainer.lora.publish = "merged"'
            )
        if inf.max_lora_rank is not None and inf.max_lora_rank < lora.rank:
            raise ValueError(
                f"inference.max_lora_rank = {inf.max_lora_rank} is below trainer.lora.rank = {lora.rank}, "
                f"and {why}; leave inference.max_lora_rank unset, or set it >= {lora.rank}"
            )
        if lora_rank_for(lora.rank) is None:
            raise ValueError(
                f"trainer.lora.rank = {lora.rank} is above the largest rank vLLM serves ({LORA_RANKS[-1]}), "
                f'and {why}; use a smaller rank, or trainer.lora.publish = "merged"'
            )
        inf.enable_lora = True
        if inf.max_loras is None:
            inf.max_loras = self.orchestrator.max_async_level + 1


class SFTConfig(SFTRunConfig, kw_only=True):
    """`primerl sft`: supervised fine-tuning."""

    slurm: SlurmConfig = msgspec.field(default_factory=SlurmConfig)
    """The sbatch job of `primerl sft --slurm`."""


class EvalConfig(EvalRunConfig):
    """`primerl eval`: evaluate a model, or every published step of a run."""

    slurm: SlurmConfig = msgspec.field(default_factory=SlurmConfig)
    """The sbatch job of `primerl eval --slurm`."""
