"""The memory of one vLLM server's GPU, before it starts: weights, the profile run's activations,
what is left for the KV cache under `gpu_memory_utilization`, and how many sequences it holds.

    shape = ServedShape(...)                  # from the model's shape (primerl.plan builds it)
    m = server_memory(shape, ServerLayout(tp=2), gpu_gib=80, seq_len=16384, in_flight=64)
    m.parts, m.kv_bytes, m.seqs_fit, m.problems()

vLLM's own rule (vllm/v1/worker/gpu_worker.py, determine_available_memory): the KV cache gets
`gpu_memory_utilization x total` minus the weights, the peak of a profile run (a forward of
max_num_batched_tokens tokens and a sampler over max_num_seqs sequences) and the memory outside
torch (the CUDA context, NCCL); CUDA graphs are captured afterwards, outside that share, so
they need the (1 - utilization) left over. It refuses to start when the cache cannot hold one
sequence of max_model_len (seq_len here) tokens.

Where each number comes from:
- weights: the shape's parameters at the served dtype (formula): bf16 2 bytes; FP8 (online or a
  block-FP8 checkpoint) 1 byte for the linear layers plus a float32 scale per 128 x 128 block,
  the embedding and the output head kept bf16 (vLLM quantises Linear layers only). Tensor
  parallelism slices every layer over tp GPUs (the vocabulary too); vLLM's data parallelism
  replicates them, and with expert parallelism the routed experts are split over tp x dp.
- the KV cache per token (formula, at the KV dtype: the model's bf16, or fp8): softmax attention
  2 x kv_heads x head_dim, the kv heads split over tp (replicated when fewer than tp); MLA the
  shared latent and its RoPE part (every TP rank holds them); DSA's indexer key in fp8 with a
  float32 scale per 128; sliding-window layers hold at most their window per sequence;
  recurrent layers (Gated DeltaNet, Mamba2) a state per sequence (conv and SSM states, bf16).
- the profile run's peak and the memory outside torch: ESTIMATES, not measured (vLLM is not
  installed on the GPU machine this project measures on): the forward's largest transient
  (the residual, the attention projections and the MLP's widest intermediate for
  max_num_batched_tokens tokens, bf16) or the sampler's logits over max_num_seqs x vocab in
  float32 three times over (logits, probabilities, sorted), whichever is larger;
  NON_TORCH_GIB and CUDA_GRAPHS_GIB below.
- max_num_batched_tokens and max_num_seqs: vLLM's defaults for an API server on GPUs of >= 70 GiB
  (8,192 and 1,024; vllm/engine/arg_utils.py, _set_default_max_num_seqs_and_batched_tokens_args),
  unless inference.extra_args sets them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

GIB = 2**30
NON_TORCH_GIB = 1.0
"""CUDA context, cuBLAS workspaces and NCCL buffers of one worker (estimate: vLLM's start-up log
reports 0.5-1.5 GiB 'non-torch memory' on H100s; not measured here)."""
CUDA_GRAPHS_GIB = 1.0
"""The CUDA graphs vLLM captures after sizing the cache, outside gpu_memory_utilization's share
(estimate: its log's 'Graph capturing finished ... took 0.4-1.5 GiB'; not measured here)."""
DEFAULT_BATCHED_TOKENS = 8192
DEFAULT_MAX_SEQS = 1024
FP8_BLOCK = 128


@dataclass(frozen=True)
class KVLayer:
    """One layer's cache: `per_token` bytes at 2 bytes an element (bf16) for every token a
    sequence holds (at most `window` of them), `split` heads that tensor parallelism divides
    (0: every TP rank holds all of it), `fixed_fp8` bytes a token that stay fp8 whatever the KV
    dtype (DSA's index keys), or `state` bytes a sequence for recurrent layers."""

    per_token: int = 0
    split: int = 0
    window: int | None = None
    fixed_fp8: float = 0.0
    state: int = 0


@dataclass(frozen=True)
class ServedShape:
    """What a server's memory depends on, from the model's shape."""

    dense_params: int
    """Every parameter but the routed experts and the embedding/output head."""
    expert_params: int
    """The routed experts' parameters (0 for a dense model)."""
    vocab_params: int
    """The embedding and the output head (once when tied)."""
    hidden_size: int
    vocab_size: int
    widest_per_token: int
    """The widest intermediate a token makes in one layer (elements): a dense MLP's 3 x
    intermediate, an MoE's top_k x 3 x expert width, or the attention's q, k and v."""
    kv_layers: list[KVLayer] = field(default_factory=list)


@dataclass(frozen=True)
class ServerLayout:
    """One server (a replica): its parallelism and what it serves in."""

    tp: int = 1
    dp: int = 1
    expert_parallel: bool = False
    fp8_weights: bool = False
    """inference.quantization = "fp8", or a block-FP8 checkpoint served as it is."""
    fp8_kv: bool = False
    gpu_memory_utilization: float = 0.9
    max_batched_tokens: int = DEFAULT_BATCHED_TOKENS
    max_seqs: int = DEFAULT_MAX_SEQS


@dataclass
class ServerMemory:
    """Bytes on each GPU of one server."""

    parts: dict[str, float]
    """weights, activations (profile run), non-torch; the KV cache gets what is left of budget."""
    budget: float
    """gpu_memory_utilization x the GPU's memory."""
    total: float
    """The GPU's memory."""
    kv_bytes: float
    """What vLLM gives the KV cache (can be negative: it does not start)."""
    kv_per_seq: float
    """KV bytes one sequence of seq_len tokens takes on this GPU."""
    seq_len: int
    in_flight: int
    """Sequences the orchestrator keeps in flight on this server (each DP rank its share)."""

    @property
    def seqs_fit(self) -> int:
        return max(0, math.floor(self.kv_bytes / self.kv_per_seq)) if self.kv_per_seq > 0 else 10**9

    def problems(self) -> list[str]:
        """Why vLLM would not start ([] when it would)."""
        used = sum(self.parts.values())
        out = []
        if self.kv_bytes < self.kv_per_seq:
            out.append(
                f"the KV cache gets {self.kv_bytes / GIB:.1f} GiB of the {self.budget / GIB:.1f} GiB vLLM may use "
                f"(weights {self.parts['weights'] / GIB:.1f}, activations {self.parts['activations'] / GIB:.1f}, "
                f"outside torch {self.parts['non-torch'] / GIB:.1f}): less than one sequence of {self.seq_len:,} "
                f"tokens ({self.kv_per_seq / GIB:.2f} GiB); vLLM refuses to start"
            )
        if self.total - self.budget < CUDA_GRAPHS_GIB * GIB and used <= self.budget:
            out.append(
                f"gpu_memory_utilization leaves {(self.total - self.budget) / GIB:.1f} GiB outside vLLM's share, "
                f"less than its CUDA graphs take (~{CUDA_GRAPHS_GIB:.1f} GiB): it may run out of memory capturing them"
            )
        return out

    def short_of_concurrency(self) -> bool:
        """The cache holds fewer whole sequences than are in flight (vLLM preempts and recomputes)."""
        return self.seqs_fit < self.in_flight


def kv_bytes_per_seq(shape: ServedShape, layout: ServerLayout, seq_len: int) -> float:
    """KV bytes of one sequence of `seq_len` tokens on one GPU of the server."""
    elem = 0.5 if layout.fp8_kv else 1.0  # per_token counts bf16 bytes
    total = 0.0
    for layer in shape.kv_layers:
        share = 1.0 if not layer.split else max(1, layer.split // layout.tp) / layer.split
        if layer.state:
            total += layer.state * share
            continue
        tokens = seq_len if layer.window is None else min(seq_len, layer.window)
        total += tokens * (layer.per_token * elem * share + layer.fixed_fp8)
    return total


def weight_bytes(shape: ServedShape, layout: ServerLayout) -> float:
    """Weights on one GPU of the server."""
    per = 1.0 + 4.0 / FP8_BLOCK**2 if layout.fp8_weights else 2.0
    experts_over = layout.tp * layout.dp if layout.expert_parallel else layout.tp
    return (
        shape.dense_params * per / layout.tp
        + shape.expert_params * per / experts_over
        + 2.0 * shape.vocab_params / layout.tp
    )


def activation_bytes(shape: ServedShape, layout: ServerLayout) -> float:
    """The profile run's transient peak (an estimate: module docstring)."""
    forward = layout.max_batched_tokens * (4 * shape.hidden_size + shape.widest_per_token / layout.tp) * 2
    sampler = layout.max_seqs * shape.vocab_size * 4 * 3
    return max(forward, sampler)


def server_memory(
    shape: ServedShape, layout: ServerLayout, *, gpu_gib: float, seq_len: int, in_flight: int
) -> ServerMemory:
    """The memory of each GPU of a server laid out as `layout`, serving sequences of up to
    `seq_len` tokens with `in_flight` of them at once over the whole server."""
    total = gpu_gib * GIB
    parts = {
        "weights": weight_bytes(shape, layout),
        "activations": activation_bytes(shape, layout),
        "non-torch": NON_TORCH_GIB * GIB,
    }
    budget = layout.gpu_memory_utilization * total
    return ServerMemory(
        parts=parts,
        budget=budget,
        total=total,
        kv_bytes=budget - sum(parts.values()),
        kv_per_seq=kv_bytes_per_seq(shape, layout, seq_len),
        seq_len=seq_len,
        in_flight=math.ceil(in_flight / layout.dp),
    )
