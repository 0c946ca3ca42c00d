"""Config section of primerl-trainer (RL and SFT). Loaded without importing torch."""

from __future__ import annotations

import os
from typing import Annotated, Literal

import msgspec
from primerl_algos.config import LossConfig
from primerl_protocol.config import Config, NonNegative, Positive, SharedConfig


class OptimizerConfig(Config):
    """AdamW and gradient clipping."""

    lr: Annotated[float, msgspec.Meta(gt=0)] = 1e-6
    """Peak learning rate."""
    weight_decay: Annotated[float, msgspec.Meta(ge=0)] = 0.01
    """Decoupled weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW's (beta1, beta2)."""
    max_grad_norm: Annotated[float, msgspec.Meta(gt=0)] = 1.0
    """Clip the global gradient norm to this (inf: no clipping)."""
    cpu_offload: bool = False
    """Keep optimizer state in CPU memory. Ignored, with a warning, on a CPU trainer (nothing to
    offload there)."""


class SchedulerConfig(Config):
    """Learning-rate schedule."""

    type: Literal["constant", "linear", "cosine"] = "constant"
    """Shape after warm-up: constant, linear decay or cosine decay to min_lr_ratio x lr."""
    warmup_steps: NonNegative = 0
    """Steps of linear warm-up to lr: step s < warmup_steps runs at lr * (s + 1) / (warmup_steps + 1)."""
    min_lr_ratio: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.0
    """Final learning rate of the decaying schedules, as a fraction of lr."""


class CheckpointConfig(Config):
    """Sharded (DCP) checkpoints for resuming."""

    interval: NonNegative = 50
    """Write a checkpoint every this many steps, and at the end (0: only at the end)."""
    keep: NonNegative = 2
    """Checkpoints kept on disk (0: all)."""


class WeightsConfig(Config):
    """Weights published for inference after each step."""

    keep: Positive = 3
    """Published weight folders kept on disk (older ones are removed)."""
    keep_every: NonNegative = 0
    """Also keep, for later evals (`primerl eval run=RUN_DIR`), the folder of every step N where
    N + 1 is a multiple of this (the weights after 100, 200, ... optimizer steps: policies 100,
    200, ...); 0: keep only the newest `keep`."""
    dtype: Literal["bfloat16", "float32"] = "bfloat16"
    """Data type of the published weights."""
    transport: Literal["folder", "memory"] = "folder"
    """How each step's weights reach the inference servers: "folder", a published folder
    (run_dir/weights/step_N) every server reads; "memory", streamed from the trainer to every
    server's workers, one layer at a time (docs/inference.md, "Weights in memory"); RL only, not
    with trainer.lora yet."""
    folder_every: NonNegative = 10
    """With transport = "memory": also publish the folder of every step N where N + 1 is a
    multiple of this, and of the last step (for evals of past steps, and for a server that did
    not receive a step in memory); 0: only the last step's."""
    servers: list[str] = []
    """With transport = "memory": the inference servers' URLs (`primerl rl` fills them in); their
    admin token comes from $PRIMERL_ADMIN_TOKEN."""
    admin_token: str | None = None
    """With transport = "memory": the servers' admin token (None: $PRIMERL_ADMIN_TOKEN, which
    `primerl rl` sets; `--slurm` writes it here, in a config only the run's owner can read).
    Never logged (redacted from W&B's config)."""
    workers_per_server: Positive = 1
    """With transport = "memory": each server's workers (its tensor-parallel size; `primerl rl`
    fills it in)."""
    host: str | None = None
    """With transport = "memory": the address the servers reach the trainer's rank 0 at (None:
    rank 0's address on its route to the first server; 127.0.0.1 when that is on its machine)."""
    timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 300.0
    """With transport = "memory": a server's join or update that takes longer fails, for that
    server only (it is named in the trainer's log; the others and the run go on)."""
    overlap: bool = True
    """With transport = "memory": rank 0 sends each step's weights from a thread while the next
    step trains (the gathers and packing stay in the step; the sending, which the servers pace,
    does not). Costs a copy of the published weights in rank 0's host memory (pinned on GPUs),
    kept between steps; false: sent layer by layer before the next step starts, one layer's
    buffer at a time."""


class ParallelConfig(Config):
    """How the trainer's ranks (torchrun's, or transport.trainer_ranks) split the work: a mesh of dp
    data-parallel groups of cp ranks each (dp x cp = the ranks), every parameter sharded over
    all of them by FSDP2; MoE experts split over ep ranks besides. See docs/trainer.md."""

    dp: Positive | None = None
    """Data-parallel groups: each trains on its own packed rows (default: ranks / cp)."""
    cp: Positive = 1
    """Context parallelism: the ranks of a data-parallel group split each row between them
    (Ulysses attention over heads); needs the attention heads divisible by it. For rows too
    long for one rank's activations."""
    ep: Positive = 1
    """Expert parallelism: each MoE layer's experts are split over this many ranks (which must
    divide the ranks and the experts), tokens travel to their experts by all-to-all."""

    def layout(self, ranks: int, ranks_key: str = "transport.trainer_ranks") -> tuple[int, int, int]:
        """(dp, cp, ep) on `ranks` ranks (said by `ranks_key`); ValueError naming the keys when
        they do not fit."""
        where = "trainer.parallel"
        if ranks % self.cp:
            raise ValueError(f"{where}.cp = {self.cp} does not divide the trainer's {ranks} ranks ({ranks_key})")
        dp = ranks // self.cp
        if self.dp is not None and self.dp != dp:
            raise ValueError(
                f"{where}.dp x {where}.cp = {self.dp} x {self.cp} = {self.dp * self.cp}, but the "
                f"trainer has {ranks} ranks ({ranks_key}); they must multiply to it"
            )
        if ranks % self.ep:
            raise ValueError(f"{where}.ep = {self.ep} does not divide the trainer's {ranks} ranks ({ranks_key})")
        return dp, self.cp, self.ep


class LoRAConfig(Config):
    """Low-rank adapters on the chosen linear layers; the base weights frozen, without optimizer state.

    Each chosen layer computes W x + (alpha / rank) B A dropout(x). Published as the adapter
    alone (PEFT's layout, the servers load it beside the base weights) or folded into full
    weights (`publish`)."""

    rank: Positive = 16
    """Rank r of each adapter (A: [r, in], B: [out, r])."""
    alpha: Annotated[float, msgspec.Meta(gt=0)] = 32.0
    """The update is scaled by alpha / r."""
    dropout: Annotated[float, msgspec.Meta(ge=0, lt=1)] = 0.0
    """Dropout on the adapter's input (training only)."""
    targets: list[str] = msgspec.field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    """Linear layers by the last part of their name (a glob, e.g. "*_proj"); every layer's that matches."""
    experts: bool = False
    """Also adapt every MoE layer's routed experts: each expert's gate, up and down projections
    get their own A and B (stacked over the experts, sharded with them under expert
    parallelism; no dropout). Published merged only: vLLM's LoRA does not take them."""
    publish: Literal["adapter", "merged"] = "adapter"
    """What each step publishes for inference. adapter: the adapter alone, in PEFT's layout
    (adapter_config.json, adapter_model.safetensors, the served model's Hugging Face names),
    which the servers load beside their base weights: megabytes a step instead of the whole
    model. merged: full weights W + (alpha / rank) B A, loaded like any full update, for layer
    kinds vLLM does not serve as adapters or servers started without LoRA."""


class TrainerConfig(Config):
    """The FSDP2 trainer."""

    parallel: ParallelConfig = msgspec.field(default_factory=ParallelConfig)
    """The mesh: data-parallel groups, context and expert parallelism."""

    micro_batch_tokens: Positive | None = None
    """Tokens per micro-batch row (default: the shared seq_len)."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer in the backward pass to save memory."""
    compile: bool = False
    """torch.compile each decoder layer."""
    keep_logits: bool = False
    """Keep each micro-batch's logits from the forward to the backward instead of recomputing
    them (one output-projection matmul less per step; micro_batch_tokens x vocab x 2 bytes more
    memory: 8 GB at 16k tokens of a 248k vocabulary). Only where the loss is not computed in the
    forward (loss_in_forward), which saves the same matmul without the memory."""
    loss_in_forward: bool = True
    """Compute the loss's gradients inside the forward, chunk by chunk while each chunk's logits
    exist (primerl_models.chunked_token_loss): one output-projection matmul less per micro-batch
    and no logits kept. Where the loss allows it: SFT's NLL and the token-local RL losses
    (primerl_algos.losses.TOKEN_LOCAL: aipo, cispo, ppo, dppo; not gspo), on rows not split by
    context parallelism (rows sharing prompts included); elsewhere the logprobs' backward as before."""
    attention: Literal["auto", "sdpa", "varlen", "flex"] = "auto"
    """Attention back-end (primerl_models.attention): auto picks SDPA on CPU and for
    single-document rows, varlen (flash) kernels for packed rows on GPUs."""
    dtype: Literal["bfloat16", "float32"] = "bfloat16"
    """Compute dtype of the model (float32 master weights are kept by FSDP2 either way)."""
    precision: Literal["bf16", "fp8"] = "bf16"
    """Matmul precision of the decoder layers' linear projections (docs/trainer.md, "Precision").
    bf16: every matmul in trainer.dtype. fp8: the attention and MLP projections (q/k/v/o, gate/up/
    down, linear-attention and shared-expert projections) run as FP8 e4m3 matmuls with row-wise
    scales, forward and backward (torchao's "rowwise" recipe); master weights, optimizer state,
    embeddings, lm_head, norms, routers and routed experts stay as in bf16. Needs GPUs of CUDA
    compute capability 8.9 or newer (H100, H200, L40S, B200), trainer.dtype = "bfloat16" and no
    trainer.lora; faster with trainer.compile, which fuses the casts into the ops before them."""
    optimizer: OptimizerConfig = msgspec.field(default_factory=OptimizerConfig)
    """Optimizer."""
    scheduler: SchedulerConfig = msgspec.field(default_factory=SchedulerConfig)
    """Learning-rate schedule."""
    loss: LossConfig = msgspec.field(default_factory=LossConfig)
    """RL loss (ignored by SFT)."""
    checkpoint: CheckpointConfig = msgspec.field(default_factory=CheckpointConfig)
    """Checkpoints."""
    weights: WeightsConfig = msgspec.field(default_factory=WeightsConfig)
    """Weight publishing."""
    lora: LoRAConfig | None = None
    """Train low-rank adapters instead of the whole model (the `[trainer.lora]` table turns it on)."""
    freeze_vision: bool = True
    """Keep a vision-language model's vision tower frozen (no gradients, no optimizer state);
    false trains it with the rest. Models without a tower ignore it."""

    def __post_init__(self) -> None:
        if not self.freeze_vision and self.lora is not None:
            raise ValueError(
                "trainer.freeze_vision = false with trainer.lora: LoRA freezes the base model, the "
                "vision tower included (and never adapts it); drop one of them"
            )
        if self.weights.transport == "memory" and self.lora is not None:
            raise ValueError(
                'trainer.weights.transport = "memory" with trainer.lora: adapters travel by folder '
                'only (for now); use transport = "folder"'
            )
        if self.precision == "fp8" and self.lora is not None:
            raise ValueError(
                'trainer.precision = "fp8" with trainer.lora: FP8 training of adapted layers is not supported '
                '(yet); use trainer.precision = "bf16" with LoRA'
            )
        if self.precision == "fp8" and self.dtype != "bfloat16":
            raise ValueError(
                f'trainer.precision = "fp8" with trainer.dtype = "{self.dtype}": FP8 matmuls run from the '
                'bf16 activations and weights of trainer.dtype = "bfloat16"; set it, or precision = "bf16"'
            )


class SFTDataConfig(Config):
    """Supervised fine-tuning data."""

    path: str
    """A local JSONL or Parquet file (or folder of them), or a `datasets` name."""
    eval_path: str | None = None
    """Held-out data for evals (same format)."""
    batch_size: Positive = 64
    """Samples per optimizer step."""
    shuffle: bool = True
    """Shuffle the data each epoch (seeded by the shared seed)."""
    eval_interval: NonNegative = 0
    """Score the eval split every this many steps (0: only at the end)."""


def launcher_ranks() -> int | None:
    """torchrun's world size when this process is one of its ranks, else None. (Only torchrun's
    own marker counts: a lone trainer process sets WORLD_SIZE=1 itself, primerl_trainer.distributed.)"""
    if "TORCHELASTIC_RUN_ID" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    return int(os.environ["WORLD_SIZE"])


def check_ranks(cfg: TrainerRunConfig | SFTRunConfig) -> None:
    """The trainer's ranks come from its launcher: under torchrun, transport.trainer_ranks is set
    to torchrun's count (ValueError naming both when it was set to another); else unset means
    1. Then the mesh must fit them (ValueError naming the keys)."""
    transport, world = cfg.transport, launcher_ranks()
    if world is None:
        cfg.trainer.parallel.layout(transport.ranks)
        return
    if transport.trainer_ranks not in (None, world):
        raise ValueError(
            f"transport.trainer_ranks = {transport.trainer_ranks}, but torchrun started {world} ranks (WORLD_SIZE = "
            f"{world}): leave transport.trainer_ranks unset (a trainer under torchrun takes torchrun's count) or make "
            "them agree"
        )
    transport.trainer_ranks = world
    cfg.trainer.parallel.layout(world, "torchrun's WORLD_SIZE")


class TrainerRunConfig(SharedConfig):
    """The RL trainer's root config (`primerl-trainer`; `primerl_trainer.rl.train`): the shared
    values and its own section."""

    trainer: TrainerConfig = msgspec.field(default_factory=TrainerConfig)
    """The FSDP2 trainer: optimizer, schedule, loss, checkpoints, weight publishing."""

    def __post_init__(self) -> None:
        check_ranks(self)


class SFTRunConfig(SharedConfig, kw_only=True):
    """The SFT trainer's root config (`primerl_trainer.sft.train`)."""

    data: SFTDataConfig
    """Training data (JSONL/Parquet with prompt/completion or messages)."""
    trainer: TrainerConfig = msgspec.field(default_factory=TrainerConfig)
    """The FSDP2 trainer (its loss section is not used)."""

    def __post_init__(self) -> None:
        check_ranks(self)
