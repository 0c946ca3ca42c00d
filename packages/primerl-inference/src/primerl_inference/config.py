"""Config section of primerl-inference: the vLLM servers. Loaded without importing vLLM."""

from __future__ import annotations

from typing import Annotated

import msgspec

from primerl_protocol.config import Config, Port, Positive


class InferenceConfig(Config):
    """vLLM OpenAI-compatible servers with primerl's admin routes."""

    host: str = "127.0.0.1"
    """Interface the servers listen on."""
    port: Port = 8000
    """Port of the first replica; replica i listens on port + i."""
    num_replicas: Positive = 1
    """Data-parallel server replicas."""
    tensor_parallel_size: Positive = 1
    """GPUs per replica (tensor parallel)."""
    gpu_memory_utilization: Annotated[float, msgspec.Meta(gt=0, le=1)] = 0.9
    """Fraction of each GPU's memory vLLM may use (lower it when colocated with the trainer)."""
    enforce_eager: bool = False
    """Disable CUDA graphs / compilation (always on for CPU)."""
    admin_token: str | None = None
    """Bearer token for the admin routes (default: $PRIMERL_ADMIN_TOKEN)."""
    extra_args: list[str] = []
    """Extra command-line arguments passed to vLLM as they are."""
