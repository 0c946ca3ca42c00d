"""The trainer's memory per rank, predicted from a model's shape and a layout: arithmetic on
`ModelArgs`, no model built, no GPU needed. `primerl plan` calls `trainer_memory` to say before
launch whether a run fits.

    mem = trainer_memory(args, TrainerLayout(world=8, ep=8, row_tokens=65536, activation_checkpointing=True))
    mem.peak / 2**30, mem.parts, mem.sources[...]

What is predicted is the allocator's peak (`torch.cuda.max_memory_allocated`, what every
`peak_gib` in bench/results is): the tensors alive at the worst moment of a step. The CUDA
context and the allocator's cached-but-free blocks come on top (see "Not covered").

## How a step uses memory (the phases)

One step is, for each micro-batch row (`rows` of them, one after the other: the trainer holds one
row's activations at a time), a forward (every layer saves what its backward needs), the loss
(the chunked logprobs, primerl_models.logprobs), a backward (layer L-1 down to 0, each layer's
saved tensors freed as it is done, its gradients made), then the optimizer step. The peak is the
largest of these moments, each a sum of the parts below:

- `forward i`: layer i's forward: the saved tensors of layers <= i, FSDP2's all-gathers;
- `loss`: after the forward, the loss's backward running: every layer's saved tensors + the
  loss's saved tensors and its transients;
- `layer i start | mlp | experts | mixer`: layer i's backward, at three moments: starting (all
  its saved tensors), its MLP's weight gradients made (the MLP's saved tensors down to what those
  GEMMs read: its input and the gradients of its hidden activations; gated experts: the gate-up
  gradient made whole, the concatenated weight still saved, `experts`: then split into the gate
  and up weights' gradients, the weight freed), its mixer's (every gradient of the layer made,
  the MLP's saved tensors gone). Below it the saved tensors of layers < i; the gradients of the
  layers after i (all of them from the second row on: FSDP2 sums each row's into them); with
  activation checkpointing layer i recomputed whole, the other layers keeping their input only;
- `reduce i` (FSDP2): layer i's gradients reduce-scattered: the fp32 reduce-scatter input (the
  bf16 gradients alive while it is filled) and output; the input is kept until the next layer's
  reduce;
- `root`: the embedding's backward and the root's reduce-scatter (embedding, output head);
- `optimizer`: weights, gradients and optimizer states, nothing else.

`TrainerMemory.parts` is the peak moment's breakdown; `phase` names it.

## The parts (bytes per rank; N parameters, N_t of them trained, W ranks)

- `weights`   4 N / W: FSDP2 keeps every parameter sharded over all ranks in fp32 (experts: over
              the ep ranks of their group, then FSDP2 over the W / ep groups: also N_e / W);
              bench/model_step.py's `:bf16` rows: 2 N. (`cpu_offload`: in host memory.)
- `grads`     4 N_t / W once made (fp32, sharded; bf16 + SGD: 2 N_t), the gradients present at the
              peak moment: none before the first row's backward reached them.
- `optimizer` 8 N_t / W (AdamW's two fp32 moments; SGD none; `cpu_offload`: in host memory).
- `gathered`  FSDP2's bf16 copies: the root's parameters (embedding, output head, final norm; the
              root is not resharded after its forward) 2 R, the running layer's 2 U_i (U_i: its
              dense parameters and its ep-th of the experts), with W > 1 the prefetched layer's
              all-gather 2 U_(i-1) and the last forward all-gather kept 2 U_(L-1) (in the
              forward: the running layer's all-gather kept and the next one's, 4 U); the
              layer's unsharded bf16 gradients 2 U_i as its backward makes them, the previous
              layer's fp32 reduce-scatter input 4 U_(i+1) (kept until the next reduce), at a
              reduce 4 U_i + max(2 U_i, 4 P_i / W); the output weight's bf16 gradient 2 V D from
              the loss's backward on (the root reduces last). 0 in bench/model_step.py (no FSDP2),
              where each gradient goes into `grads` as it is made, fp32 from a bf16 one (the
              largest weight's bf16 gradient counted with it).
- `activations` what the layers save for their backward, per layer by block kind (below), for
              this rank's tokens T = row_tokens / cp (context parallelism splits each row's
              tokens; Ulysses' head split keeps a rank's share of every saved tensor at T / cp),
              and the weight-like tensors saved with them: gated experts' concatenated bf16
              gate-up weight 4 E_local De Fe per MoE layer; in bench/model_step.py's fp32 step
              every matmul's bf16 weight cast (compiled layers under autocast keep the casts they
              multiplied by), 2 P_i per layer (and 2 per adapter parameter with LoRA). With
              activation checkpointing each layer keeps its input (T x D in the residual
              stream's dtype) and the layer being back-propagated is recomputed whole.
- `logits`    the loss: the final norm's saved tensors (fp32 input copy 4 D, its output 2 D, fp32
              normed 4 D where the norm is zero-centred or the stream is fp32), the hidden
              states' bf16 copy 2 D (bench), the log-sum-exp, targets and temperatures (16 B a
              token); while its backward runs: one chunk of logits 2 C V (C = 4096 tokens,
              LOGPROB_CHUNK; recomputed, the gradient written in place), the hidden states'
              gradient 2 T D, the output weight's gradient accumulated in fp32 by the GEMM, 4 V D,
              8 V D while a chunk's addmm writes the new sum (more than one chunk), the bf16
              weight copy 2 V D where the weight is fp32 (bench); with `keep_logits` every
              token's logits 2 T V instead of the chunk (saved from the forward to the backward).
- `overhead`  0: see "Not covered".

## Saved tensors per block (bytes per token; compiled layers, as the trainer runs with
trainer.compile and every measured row but one)

Derived from the code: every tensor autograd (AOTAutograd's partition of each compiled layer, the
custom ops' setup_context, `_SparseMLA.forward`'s save_for_backward) keeps from a layer's forward
to its backward, listed per layer kind with `torch.autograd.graph.saved_tensors_hooks` on the
layers as primerl_models builds them (CPU, the CUDA paths put in: grouped GEMMs, fla's custom
ops), and written out here by what each tensor is. `r` is the residual stream's bytes per
element (2: bf16 under FSDP2's bf16 parameters; 4 in bench/model_step.py's fp32 step under
autocast, where the residual stream stays fp32); `w` the bytes of what the trainer computes in
fp32 and autocast in bf16 (router logits, routing weights, the experts' combined output: 4 in the
trainer, 2 in the bench). D hidden, H/G/K attention heads, kv heads, head dim; F MLP width.

- every layer: its input r D, per sub-block (mixer, MLP) its normed input 2 D and the norm's 1 /
  rms 4;
- attention: q after RoPE and the output 4 H K, k after RoPE and v 4 G K (packed rows through
  varlen attention, which in torch 2.11 takes no GQA: k and v repeated to H heads, 4 H K; see
  VARLEN_GQA), log-sum-exp 4 H; with
  q/k norms the normed-from q and k 2 H K + 2 G K and their 1 / rms 4 H + 4 G (per token 8 for
  "full"); an output gate its output and the gated product 2 (gate width) + 2 H K; attention
  sinks (flex) the scaled output 2 H K and the sigmoid 4 H;
- MLA (DSA's sparse path, `_SparseMLA`): q in the latent space 2 H X (X = kv_lora_rank +
  qk_rope_head_dim), the output latent 2 H L, the value heads 2 H Vd, q_b_proj's output 2 H (nope + rope), the query
  latent 4 Q, the kv row 2 X, log-sum-exp 4 H, the selected keys' indices and validity 9 S (S =
  min(topk, T)), 8 of norms; compiled, the query latent's norm 4 Q more: the attention itself runs
  outside the graph as the Triton kernels on GPUs (kernels/sparse_mla.py), which save their
  inputs, output and lse only (the chunked torch `_SparseMLA` compiled on a CPU would keep each
  chunk's gathered rows too, 2 S X a token: not a GPU case); eager, the latents' norms keep fp32
  copies (4 Q + 4 L) and their normed values (2 Q + 2 L) instead;
- Gated DeltaNet (fla's kernels, primerl's conv): the conv's input and output 2 C + 2 C (C =
  conv_dim), q and k L2-normed 4 Hk K, v, the rule's corrected v and output 6 Hv V, its WY factor
  w 2 Hv K and A 2 Hv 64, its chunk states 2 Hv K V / 64, z and the gated norm's output 4 Hv V,
  small per-head terms 26 Hv + 8 Hk + 8;
- Mamba2 (H heads, P head_dim, N state_size, C = 64 tokens a chunk, K conv_kernel; mamba2.py's
  chunked scan and recurrent.causal_conv, torch on every device: kernels/conv.py is the Gated
  DeltaNet's). Compiled on a GPU, the chunk-to-chunk recurrence is kernels/state_scan.py's Triton
  kernel, whose builder dynamo cannot trace (`_triton_scan`: triton.jit under the graph), so
  `_ChunkStates` runs eagerly between the layer's graphs and keeps what its save_for_backward
  names: m, the per-chunk decays as [N, N] matrices, 4 H N^2 / C, and the states 4 H N P / C
  (fp32). The graphs around it save: in_proj's bf16 output 2 (inner + conv + H) (z and dt are
  views of it), the conv's bf16 input (xbc) 2 conv, its K - 1 shifted fp32 copies 4 (K - 1) conv
  and their document masks K - 1, silu(conv) in fp32 4 conv (x is a view of it), c and b in the
  chunk layout (fp32, repeated to every head) 8 H N, G and the decays to each chunk's end 8 H,
  c b^T and the segment sums 8 H C (fp32), exp of each chunk's last G 4 H / C, the scan's output y
  4 H P, out_proj's bf16 input 2 inner, the gated norm's 1 / rms 4 groups, the chunk slots 8
  (int64); and what the backward's matmuls read. Under bf16 autocast (bench/model_step.py) those
  are bf16 casts even inside ssd_scan's fp32 region (the compiled backward is traced under the
  forward's autocast: torch._functorch.config.backward_pass_autocast = "same_as_forward"): the
  decay-weighted c b^T (attn) 2 H C, b weighted to its chunk's end and one of c, b 4 H N, v twice
  (two graphs) 4 H P, the states 2 H N P / C; without autocast (the trainer: FSDP2's bf16
  parameters, no autocast) fp32 contiguous copies: attn 4 H C, the weighted b, c, b^T and c
  exp(G) 16 H N, v twice 8 H P. Listed with saved_tensors_hooks and the AOTAutograd partitions
  (TORCH_LOGS=aot_graphs) of a compiled Mamba2 layer on a CPU, torch 2.13, with the CUDA branch's
  `_triton_scan` traced (so the graph break falls where it does on a GPU): within 4 B a token
  (per-head parameters' casts) at five shapes, one a row of two documents, Nemotron-3-Super's
  mixer among them, both ways. Eager layers: the count first written for the chunked torch form,
  not re-derived: in_proj's output 2 (inner + conv + H), conv input and its fp32 forms 2 conv +
  16 conv, the heads' x, B, C forms 8 H P + 8 H N, y 2 inner; the chunk tensors 12 H C + 16 H N +
  4 H N^2 / C + 4 H P + 4 H N P / C, 4 groups + 16;
- dense MLP: SwiGLU gate, up and their product 6 F plus 2 D; relu^2 4 F; LoRA adapters their A's
  output 2 r each;
- MoE: the tokens' rows gathered for their experts and their transpose 4 k De (De: D or the
  latent), gate-up output and the activation's transpose 6 k Fe (relu^2: 4 k Fe), the combined
  output w D, router logits w E, chosen experts and orders 24 k, weights w k, w; the shared
  expert as a dense MLP (a gated one 2 D + 8 more); latent experts 2 L more; biased experts the
  one-hot [A, E] 2 k E; and, not per token, the concatenated gate-up weight 4 E_local De Fe (bf16)
  per MoE layer.

Eager layers (`compiled=False`: glm-5-3l's row) keep more: each norm its fp32 input 4 D, normed
value 2 D and output 2 D (not the layer input); attention's RoPE fp32 copies (10 H K + 10 G K
+ 8 H + 4 G with q/k norms); SwiGLU 8 F; MoE rows 2 k De, their fp32 outputs 4 k De, 8 k Fe, 2 D.

## Measured (bench/results) and how it was checked

Nothing is fitted: bench/plan_check.py compares every peak measured by bench/model_step.py
("ours" rows) and bench/trainer_step.py with these predictions (all within 10%, listed there and
in packages/primerl-trainer/tests/test_plan.py).

Checked besides on an H100 (torch 2.11, this tree, not kept in bench/results): a compiled Qwen3-1.7B
layer's saved tensors on CUDA under varlen (75,944 B a token, the formula's figure to the byte),
and bench/model_step.py's qwen3-1.7b and qwen3-0.6b steps at 16,384 tokens (58.82 and 31.14 GiB
against 58.73 and 30.47 predicted; the 2026-11-30/12-02 H200 rows are 1-2 GiB higher, from the
logprob code of then).

## Not covered

The CUDA context (~0.5-1 GiB a process, outside max_memory_allocated) and the allocator's
fragmentation; NCCL's buffers; expert-load imbalance under EP (a rank's expert rows are counted
at the mean, T k); the vision tower's activations (its parameters are counted); the uneven
last chunk of a row; LoRA on the routed experts; backward temporaries inside a kernel (flash
attention's fp32 dq accumulator and the like); the Gated DeltaNet's fp32 torch form (used
without fla: several times more); the sparse-MLA kernels' backward temporaries (its fp32 key
gradient buffer, 4 X a key, and the stored form's p and ds of a chunk of queries, at most
kernels.sparse_mla.STORED_BYTES = 1 GiB, live during the backward only); Mamba2 compiled on a CPU (dynamo
traces the scan's loop whole, and the partition recomputes m: less than on a GPU) and eager
Mamba2 layers (the count above is not re-derived: an eager CPU layer of 16 heads of 64, state 128,
under bf16 autocast kept 169 KB a token, the count 128 KB); a packed row's chunk padding (each
document's last chunk filled to C tokens in the scan's chunk tensors).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from primerl_models.args import (
    MLA,
    Attention,
    DenseMLP,
    GatedDeltaNet,
    Layer,
    Mamba2,
    ModelArgs,
    MoEMLP,
)

GIB = 2**30
LOGPROB_CHUNK = 4096
"""Tokens per chunk of the chunked logprobs (Transformer.forward's and chunked_logprobs' chunk_size)."""
SCAN_CHUNK = 64
"""Tokens per chunk of the recurrent scans (primerl_models.blocks.recurrent.CHUNK, fla's CHUNK)."""
VARLEN_GQA = False
"""Whether varlen attention takes grouped-query k and v as they are: not in torch 2.11, the
torch every bench/results peak was measured with (torch.nn.attention.varlen has no enable_gqa
there), so primerl_models repeats them to every query head; set True for a torch whose varlen
takes enable_gqa."""
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""trainer.lora.targets' default (LoRAConfig): the layers adapted."""


@dataclass(frozen=True)
class TrainerLayout:
    """How the trainer runs: its ranks, what splits over them, the rows it trains on."""

    world: int = 1
    """Trainer ranks (GPUs)."""
    ep: int = 1
    """Expert parallelism (trainer.parallel.ep): each MoE layer's experts split over this many ranks."""
    cp: int = 1
    """Context parallelism (trainer.parallel.cp): each row's tokens split over this many ranks."""
    row_tokens: int = 4096
    """Tokens per micro-batch row (trainer.micro_batch_tokens, else seq_len)."""
    rows: int = 1
    """Micro-batch rows per rank per optimizer step. The trainer runs them one after the other
    (forward, backward, the next): one row's activations at a time; from the second on the
    sharded gradients of the earlier rows are all present."""
    activation_checkpointing: bool = False
    cpu_offload: bool = False
    """trainer.optimizer.cpu_offload: FSDP2's CPUOffloadPolicy, parameters, gradients and AdamW's
    states in host memory."""
    keep_logits: bool = False
    lora_rank: int | None = None
    """trainer.lora.rank (its default targets, not the experts); None: the whole model trains."""
    states: Literal["fp32+adamw", "bf16+sgd"] = "fp32+adamw"
    """The trainer always keeps fp32 weights and AdamW; "bf16+sgd" is bench/model_step.py's
    `:bf16` flag (bf16 weights, plain SGD: no optimizer state)."""
    fsdp: bool = True
    """False: bench/model_step.py's step (one GPU, no FSDP2: the weights themselves in the
    forward, fp32 under bf16 autocast, so the residual stream stays fp32)."""
    packed: bool = True
    """Rows of several documents (the trainer's packed rows: attention through varlen); False: one
    document a row (bench/model_step.py's rows: SDPA's flash attention)."""
    compiled: bool = True
    """Each decoder layer under torch.compile (trainer.compile; bench/trainer_step.py and
    model_step.py's runs without `:eager`)."""

    def __post_init__(self) -> None:
        for name in ("world", "ep", "cp", "row_tokens", "rows"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.world % self.ep or self.world % self.cp:
            raise ValueError(f"ep ({self.ep}) and cp ({self.cp}) must divide the world ({self.world})")
        if not self.fsdp and self.world != 1:
            raise ValueError("fsdp=False is bench/model_step.py's one-GPU step: world must be 1")


@dataclass
class TrainerMemory:
    """Bytes per rank at the step's peak, by part."""

    parts: dict[str, float]
    """weights, grads, optimizer, gathered, activations, logits, overhead."""
    host: float
    """Host memory per rank (cpu_offload: the sharded weights, gradients and optimizer states)."""
    sources: dict[str, str]
    """Per part: the formula it comes from."""
    phase: str = ""
    """The moment of the step the peak is at (module docstring: loss, layer i, reduce i, root, optimizer)."""
    phases: dict[str, float] = field(default_factory=dict)
    """Every moment's total, for the curious."""

    @property
    def peak(self) -> float:
        return sum(self.parts.values())


# ---------------------------------------------------------------------------------------------
# parameters


def _mlp_params(mlp, d: int) -> tuple[int, int]:
    """(dense, routed-expert) parameters of an MLP spec (None: none)."""
    if isinstance(mlp, MoEMLP):
        experts = mlp.num_experts * mlp.experts.num_params(mlp.expert_dim(d))
        return mlp.num_params(d) - experts, experts
    return (0, 0) if mlp is None else (mlp.num_params(d), 0)


def layer_params(layer: Layer, d: int) -> tuple[int, int]:
    """(dense, routed-expert) parameters of a decoder layer."""
    _, experts = _mlp_params(layer.mlp, d)
    return layer.num_params(d) - experts, experts


def _swiglus(mlp) -> list[tuple[int, bool]]:
    """(width, gated) of the dense feed-forwards of an MLP spec: a dense MLP, a shared expert."""
    if isinstance(mlp, DenseMLP):
        return [(mlp.intermediate_size, mlp.activation != "relu2")]
    if isinstance(mlp, MoEMLP) and mlp.shared is not None:
        return [(mlp.shared.size, mlp.shared.activation != "relu2")]
    return []


def _lora_shapes(layer: Layer, d: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(in, out) of the mixer's and the MLP's linear layers trainer.lora's default targets match
    (attention q/k/v/o and an output gate, MLA's o_proj, dense MLPs' and shared experts'
    gate/up/down; not the routed experts, Gated DeltaNet's or Mamba2's projections)."""
    mixer: list[tuple[int, int]] = []
    m = layer.mixer
    if isinstance(m, Attention):
        hk, gk = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
        mixer += [(d, hk), (d, gk), (d, gk), (hk, d)]
        if m.gate != "none":
            mixer.append((d, m.num_heads if m.gate_per_head else hk))
    elif isinstance(m, MLA):
        mixer.append((m.num_heads * m.v_head_dim, d))
    mlp: list[tuple[int, int]] = []
    for f, gated in _swiglus(layer.mlp):
        mlp += [(d, f), (f, d)] + ([(d, f)] if gated else [])
    return mixer, mlp


def lora_params(layer: Layer, d: int, rank: int) -> tuple[int, int]:
    """(mixer's, MLP's) adapter parameters, rank (in + out) per adapted linear layer."""
    mixer, mlp = _lora_shapes(layer, d)
    return sum(rank * (i + o) for i, o in mixer), sum(rank * (i + o) for i, o in mlp)


def _largest_weights(layer: Layer, d: int) -> tuple[float, float]:
    """(mixer's, dense MLP's) largest single weight, in parameters."""
    m = layer.mixer
    mixer = 0.0
    if isinstance(m, Attention):
        mixer = d * m.num_heads * m.head_dim
    elif isinstance(m, MLA):
        q = m.q_lora_rank or d
        mixer = max(q * m.num_heads * m.qk_head_dim, m.kv_lora_rank * m.num_heads * (m.qk_nope_head_dim + m.v_head_dim))
        mixer = max(mixer, m.num_heads * m.v_head_dim * d, d * q)
    elif isinstance(m, GatedDeltaNet):
        mixer = d * m.conv_dim
    elif isinstance(m, Mamba2):
        mixer = d * (m.inner + m.conv_dim + m.num_heads)
    mlp = max([float(d * f) for f, _ in _swiglus(layer.mlp)] + [0.0])
    return mixer, mlp


# ---------------------------------------------------------------------------------------------
# saved tensors per block (module docstring)


@dataclass(frozen=True)
class _Regime:
    resid: int
    """Bytes per element of the residual stream."""
    wide: int
    """Bytes of the trainer's fp32 (autocast's bf16) router, routing and combine tensors."""
    compiled: bool
    repeat_kv: bool = False
    """Packed rows through varlen attention, which takes no GQA in torch 2.11: k and v repeated
    to every query head (primerl_models.blocks.attention._varlen) and saved so."""
    autocast: bool = False
    """The step runs under bf16 autocast (bench/model_step.py; the trainer does not): compiled
    layers' backward is traced under it too, so their fp32 matmuls' backward reads bf16 casts."""


def _attention(m: Attention, t: float, rg: _Regime) -> float:
    h, g, k = m.num_heads, m.num_kv_heads, m.head_dim
    varlen = rg.repeat_kv and not m.sinks and m.window is None  # sinks and windows go through flex (GQA inside)
    if varlen:  # k after RoPE and v repeated to every query head: 4 (H - G) K more
        extra = 4 * (h - g) * k
    else:
        extra = 0
    if not rg.compiled:  # eager: RoPE's fp32 copies of q and k, each step's output
        per = 10 * h * k + 10 * g * k + 8 * h + 4 * g if m.qk_norm != "none" else 8 * h * k + 8 * g * k + 4 * h
    else:
        per = 4 * h * k + 4 * g * k + 4 * h
        if m.qk_norm == "head":
            per += 2 * h * k + 2 * g * k + 4 * h + 4 * g
        elif m.qk_norm == "full":
            per += 2 * h * k + 2 * g * k + 8
    if m.gate != "none":
        per += 2 * (h if m.gate_per_head else h * k) + 2 * h * k
    if m.sinks:
        per += 2 * h * k + 4 * h
    return (per + extra) * t


def _mla(m: MLA, t: float, row: float, rg: _Regime) -> float:
    """MLA's saved bytes for t tokens of this rank; `row`: the whole row's tokens (the kv rows
    a rank gathers under CP; each query's keys)."""
    h, lat, x = m.num_heads, m.kv_lora_rank, m.kv_lora_rank + m.qk_rope_head_dim
    q = m.q_lora_rank or 0
    s = min(m.topk, row) if m.sparse else row
    per = 2 * h * x + 2 * h * lat + 2 * h * m.v_head_dim + 2 * h * m.qk_head_dim + 2 * x + 4 * h + 9 * s + 8
    if rg.compiled:  # on GPUs the Triton kernels (kernels/sparse_mla.py), which save only their inputs, out and lse
        per += 4 * q
    else:
        per += 8 * q + 6 * lat
    if not m.sparse:  # the oracle: SDPA over every head's keys and values of the row
        per = 2 * h * m.qk_head_dim * 2 + 2 * h * m.v_head_dim * 2 + 4 * h + 4 * q + 2 * x
    return per * t


def _gated_deltanet(m: GatedDeltaNet, t: float) -> float:
    hk, hv, k, v, c = m.num_k_heads, m.num_v_heads, m.head_k_dim, m.head_v_dim, m.conv_dim
    per = 4 * c + 4 * hk * k + 6 * hv * v + 2 * hv * k + 2 * hv * SCAN_CHUNK + 4 * hv * v
    per += 26 * hv + 8 * hk + 8
    per += 2 * hv * k * v / SCAN_CHUNK  # the chunk states
    return per * t


def _mamba2(m: Mamba2, t: float, rg: _Regime) -> float:
    """Mamba2's saved bytes for t tokens (module docstring: compiled = the GPU's path, the state
    scan's Triton kernel in an eager `_ChunkStates` between the layer's graphs)."""
    h, p, n, c, k, conv = m.num_heads, m.head_dim, m.state_size, SCAN_CHUNK, m.conv_kernel, m.conv_dim
    if not rg.compiled:  # eager: the count first written for the chunked torch form (not re-derived)
        per = 2 * (m.inner + conv + h) + 18 * conv + 8 * h * p + 8 * h * n + 2 * m.inner
        per += 12 * h * c + 16 * h * n + 4 * h * n * n / c + 4 * h * p + 4 * h * n * p / c + 4 * m.n_groups + 16
        return per * t
    per = 2 * (m.inner + conv + h)  # in_proj's bf16 output (z, dt: views of it)
    per += 2 * conv + 4 * (k - 1) * conv + (k - 1)  # the conv's bf16 input, its shifted fp32 copies, their masks
    per += 4 * conv  # silu(conv), fp32 (x: a view of it)
    per += 8 * h * n + 8 * h + 8 * h * c  # c, b in the chunk layout; G, to_end; c b^T, the segment sums
    per += 4 * h * n * n / c + 4 * h * n * p / c + 4 * h / c  # _ChunkStates' m and states; exp(G_last)
    per += 4 * h * p + 2 * m.inner + 4 * m.n_groups + 8  # y; out_proj's bf16 input; 1 / rms; slots (int64)
    if rg.autocast:  # the backward matmuls' operands as bf16 casts: attn, b weighted and c, v twice, the states
        per += 2 * h * c + 4 * h * n + 4 * h * p + 2 * h * n * p / c
    else:  # as fp32 copies: attn, b weighted, c, b^T, c exp(G), v twice
        per += 4 * h * c + 16 * h * n + 8 * h * p
    return per * t


def _dense(f: int, gated: bool, d: int, rg: _Regime) -> float:
    if not rg.compiled:
        return 8 * f if gated else 6 * f
    return 6 * f + 2 * d if gated else 4 * f


def _moe(m: MoEMLP, d: int, t: float, rg: _Regime) -> float:
    k, de, fe = m.top_k, m.expert_dim(d), m.experts.size
    gated = m.experts.activation != "relu2"
    if rg.compiled:
        per = 4 * k * de + (6 if gated else 4) * k * fe + rg.wide * d
    else:
        per = 6 * k * de + (8 if gated else 6) * k * fe + 2 * d
    per += rg.wide * m.num_experts + 24 * k + rg.wide * k + rg.wide
    if m.latent_size is not None:
        per += 2 * m.latent_size
    if m.experts.bias:
        per += 2 * k * m.num_experts
    if m.shared is not None:
        per += _dense(m.shared.size, m.shared.activation != "relu2", d, rg)
        if m.shared.gate:
            per += 2 * d + 8
    return per * t


def _dense_keep(f: int, gated: bool, d: int) -> float:
    """What a dense MLP's weight-gradient GEMMs still read when they run: its input 2 D and the
    gradients of gate and up 4 F (relu^2: of up 2 F)."""
    return 2 * d + (4 if gated else 2) * f


def _moe_keep(m: MoEMLP, d: int, t: float, rg: _Regime) -> float:
    """What the MoE's expert weight-gradient GEMMs still read: the rows (and their transpose,
    compiled), the gate-up gradient 4 k Fe (relu^2: 2 k Fe), the shared expert's."""
    k, de, fe = m.top_k, m.expert_dim(d), m.experts.size
    per = (4 if rg.compiled else 2) * k * de + (4 if m.experts.activation != "relu2" else 2) * k * fe
    if m.shared is not None:
        per += _dense_keep(m.shared.size, m.shared.activation != "relu2", d)
    return per * t


@dataclass(frozen=True)
class LayerSaved:
    """Bytes one layer saves for its backward (weight copies apart)."""

    common: float
    """Its input (compiled) or its norms' copies (eager), per sub-block a normed input, adapters' outputs."""
    mixer: float
    mlp: float
    mlp_keep: float
    """What of `mlp` (and the gradients it makes) is still alive when the MLP's weight gradients are made."""

    @property
    def total(self) -> float:
        return self.common + self.mixer + self.mlp


def layer_saved_parts(
    layer: Layer, d: int, tokens: float, row: float, rg: _Regime, lora_rank: int | None = None
) -> LayerSaved:
    """What `layer` saves for its backward over `tokens` tokens of this rank (`row`: the whole
    row's, for MLA's gathered rows and key selection), by part (module docstring)."""
    subs = [p for p in (layer.mixer, layer.mlp) if p is not None]
    if rg.compiled:
        common = rg.resid * d * tokens + len(subs) * (2 * d + 4) * tokens
    else:  # each norm its fp32 input, normed value and output (the layer's input itself is not kept)
        common = len(subs) * (4 * d + (4 if rg.resid == 4 else 2) * d + 2 * d + 4) * tokens
    if lora_rank:  # each adapter's A output, B's input
        mixer_lin, mlp_lin = _lora_shapes(layer, d)
        common += 2 * lora_rank * (len(mixer_lin) + len(mlp_lin)) * tokens
    mixer = 0.0
    m = layer.mixer
    if isinstance(m, Attention):
        mixer = _attention(m, tokens, rg)
    elif isinstance(m, MLA):
        mixer = _mla(m, tokens, row, rg)
    elif isinstance(m, GatedDeltaNet):
        mixer = _gated_deltanet(m, tokens)
    elif isinstance(m, Mamba2):
        mixer = _mamba2(m, tokens, rg)
    mlp = keep = 0.0
    if isinstance(layer.mlp, DenseMLP):
        f, gated = layer.mlp.intermediate_size, layer.mlp.activation != "relu2"
        mlp, keep = _dense(f, gated, d, rg) * tokens, _dense_keep(f, gated, d) * tokens
    elif isinstance(layer.mlp, MoEMLP):
        mlp, keep = _moe(layer.mlp, d, tokens, rg), _moe_keep(layer.mlp, d, tokens, rg)
    return LayerSaved(common, mixer, mlp, min(keep, mlp))


def layer_saved(layer: Layer, d: int, tokens: float, row: float, rg: _Regime) -> float:
    """Bytes `layer` saves for its backward over `tokens` tokens of this rank; weight copies not included."""
    return layer_saved_parts(layer, d, tokens, row, rg).total


def _expert_cat(mlp, d: int, ep: int) -> float:
    """The bf16 [E_local, De, 2 Fe] gate-up weight the grouped GEMM path concatenates and keeps
    for its backward (and, as large, its gradient there)."""
    if not isinstance(mlp, MoEMLP) or mlp.experts.activation == "relu2":
        return 0.0
    return 4 * mlp.num_experts / ep * mlp.expert_dim(d) * mlp.experts.size


# ---------------------------------------------------------------------------------------------
# the step


def _vision_params(args: ModelArgs) -> int:
    return 0 if args.vision is None else args.vision.num_params()


PARTS = ("weights", "grads", "optimizer", "gathered", "activations", "logits", "overhead")


def trainer_memory(args: ModelArgs, layout: TrainerLayout) -> TrainerMemory:
    """Peak bytes per trainer rank of `args` trained at `layout`, by part (module docstring)."""
    lay = layout
    d, v, layers = args.hidden_size, args.vocab_size, args.layers
    world, ep, cp, lora = lay.world, lay.ep, lay.cp, lay.lora_rank
    bf16_states = lay.states == "bf16+sgd"
    fsdp = lay.fsdp
    casts = not fsdp and not bf16_states  # bench fp32 under autocast: every matmul's bf16 weight cast kept
    offload = lay.cpu_offload and fsdp
    rg = _Regime(
        resid=2 if fsdp or bf16_states else 4,
        wide=4 if fsdp else 2,
        compiled=lay.compiled,
        repeat_kv=lay.packed and not VARLEN_GQA,
        autocast=not fsdp,
    )
    tokens, row = lay.row_tokens / cp, float(lay.row_tokens)
    n = len(layers)

    # parameters, per layer: all (p), this rank's unsharded share (u), trained (t, tu), their MLP's
    p, u, p_mlp, u_mlp = [], [], [], []
    for layer in layers:
        dense, experts = layer_params(layer, d)
        mlp_dense, mlp_experts = _mlp_params(layer.mlp, d)
        p.append(dense + experts)
        u.append(dense + experts / ep)
        p_mlp.append(mlp_dense + mlp_experts)
        u_mlp.append(mlp_dense + mlp_experts / ep)
    if lora:
        adapters = [lora_params(layer, d, lora) for layer in layers]
        t = [float(a + b) for a, b in adapters]
        tu, tu_mlp, t_mlp = t, [float(b) for _, b in adapters], [float(b) for _, b in adapters]
    else:
        t, tu, tu_mlp, t_mlp = [float(x) for x in p], u, u_mlp, [float(x) for x in p_mlp]
    out_w = float(v * d)  # the output weight (the embedding when tied)
    vision = _vision_params(args)
    root = d + v * d * (1 if args.tie_embeddings else 2) + vision
    root_t = 0.0 if lora else float(root - (vision if args.freeze_vision else 0))
    n_all, n_t = sum(p) + root, sum(t) + root_t

    wb, gb, ob = (2, 2, 0) if bf16_states else (4, 4, 8)  # bytes per parameter: weights, gradients, optimizer
    weights, optimizer = wb * n_all / world, ob * n_t / world
    host = 0.0
    grad_of, grad_root = [gb * x / world for x in t], gb * root_t / world  # sharded gradients
    if offload:
        host = weights + optimizer + sum(grad_of) + grad_root
        weights = optimizer = grad_root = 0.0
        grad_of = [0.0] * n
    all_grads = sum(grad_of) + grad_root

    # what the layers keep from forward to backward
    saved = [layer_saved_parts(layer, d, tokens, row, rg, lora) for layer in layers]
    ckpt = rg.resid * d * tokens
    cat = [_expert_cat(layer.mlp, d, ep) for layer in layers]
    copies_mlp = [2.0 * (p_mlp[i] + (t_mlp[i] if lora else 0.0)) if casts else cat[i] for i in range(n)]
    copies_mix = [2.0 * ((p[i] - p_mlp[i]) + ((t[i] - t_mlp[i]) if lora else 0.0)) if casts else 0.0 for i in range(n)]
    copies = [a + b for a, b in zip(copies_mix, copies_mlp)]
    ac = lay.activation_checkpointing
    held = [ckpt if ac else saved[i].total + copies[i] for i in range(n)]
    largest = [_largest_weights(layer, d) for layer in layers]
    # the gradients a layer's backward makes, and what comes with them: FSDP2's unsharded bf16
    # gradients; the bench's fp32 .grad, each made from a bf16 one (the largest weight's counted)
    if fsdp:
        g_mlp, g_all = [2.0 * x for x in tu_mlp], [2.0 * x for x in tu]
        x_mlp = [cat[i] for i in range(n)]
        x_mix = [0.0] * n
    else:
        g_mlp, g_all = [gb * x for x in t_mlp], [gb * x for x in t]
        x_mlp = [max(cat[i], 2.0 * largest[i][1] if casts else 0.0) for i in range(n)]
        x_mix = [2.0 * largest[i][0] if casts else 0.0 for i in range(n)]
    # gated experts: the gate-up gradient is made whole (as large as the concatenated weight, which
    # stays saved until it is made), then split into the gate and up weights' gradients
    gu = [0.0 if lora else cat[i] / 2 for i in range(n)]  # the gate and up weights' parameters
    g_gu = [(2.0 if fsdp else gb) * x for x in gu]
    if lora:  # the frozen weights make no gradient
        x_mlp = [0.0] * n
        x_mix = [0.0] * n

    # the loss (module docstring, `logits`)
    norm_saved = (4 * d + (4 if args.zero_centered_norms or rg.resid == 4 else 2) * d + 16) * tokens
    if not fsdp:
        norm_saved += 2 * d * tokens  # the hidden states' bf16 copy (bench/model_step.py's step)
    keep = 2.0 * tokens * v if lay.keep_logits else 0.0
    chunk = 0.0 if lay.keep_logits else 2.0 * min(tokens, LOGPROB_CHUNK) * v
    out_trained = not lora
    acc = (8.0 if tokens > LOGPROB_CHUNK else 4.0) * out_w if out_trained else 0.0
    loss_bwd = (2.0 * out_w if casts else 0.0) + 2 * d * tokens + chunk + acc
    # the output weight's gradient, from the loss's backward until the root's reduce (FSDP2: bf16
    # unsharded) or for good (the bench's .grad)
    out_grad = (2.0 if fsdp else gb) * out_w if out_trained else 0.0

    # FSDP2's gathered copies
    root_gathered = 2.0 * root if fsdp else 0.0
    last_ag = 2.0 * u[-1] if fsdp and world > 1 else 0.0

    phases: dict[str, dict[str, float]] = {}

    def moment(name: str, **parts: float) -> None:
        phases[name] = {k: parts.get(k, 0.0) for k in PARTS} | {"weights": weights, "optimizer": optimizer}

    for kind in ["first"] + (["later"] if lay.rows > 1 else []):
        later = kind == "later"
        present = all_grads if later else 0.0
        # the forward of each layer (FSDP2: its all-gather, with W > 1 the kept and the next one)
        for i in range(n):
            ag = 2.0 * u[i] + (2.0 * u[i] + (2.0 * u[i + 1] if i + 1 < n else 0.0) if world > 1 else 0.0)
            moment(
                f"forward {i} ({kind} row)",
                grads=present,
                gathered=(root_gathered + ag) if fsdp else 0.0,
                activations=sum(held[: i + 1]) + (saved[i].total + copies[i] if ac else 0.0),
            )
        moment(
            f"loss ({kind} row)",
            grads=present,
            gathered=root_gathered + last_ag,
            activations=sum(held),
            logits=norm_saved + keep + loss_bwd,
        )
        for i in reversed(range(n)):
            grads = present if later else sum(grad_of[i + 1 :]) + (0.0 if fsdp else out_grad)
            below = sum(held[:i]) + (ckpt if ac else 0.0)
            s = saved[i]
            fsdp_held = 0.0
            if fsdp:
                fsdp_held = root_gathered + out_grad + last_ag + 2.0 * u[i]
                fsdp_held += 2.0 * u[i - 1] if world > 1 and i > 0 else 0.0  # the prefetched all-gather
                fsdp_held += 4.0 * tu[i + 1] if i + 1 < n and not offload else 0.0  # the last reduce's input, kept
            # the layer's backward: starting; its MLP's weight gradients made; its mixer's
            acts = {
                "start": below + s.total + copies[i],
                "mlp": below + s.common + s.mixer + s.mlp_keep + copies[i],
                "mixer": below + s.common + s.mixer + copies_mix[i],
            }
            made = {
                "start": 0.0,
                "mlp": g_mlp[i] - g_gu[i] + x_mlp[i],
                "experts": g_mlp[i] + x_mlp[i],
                "mixer": g_all[i] + x_mix[i],
            }
            acts["experts"] = acts["mlp"] - cat[i]  # the saved gate-up weight freed once its gradient is made
            for step in ("start", "mlp", "experts", "mixer"):
                if fsdp:
                    moment(
                        f"layer {i} {step} ({kind} row)",
                        grads=grads,
                        gathered=fsdp_held + made[step],
                        activations=acts[step],
                    )
                else:
                    moment(f"layer {i} {step} ({kind} row)", grads=grads + made[step], activations=acts[step])
            if fsdp and not offload:  # the reduce-scatter: input 4 U (the bf16 grads alive while it is filled), output
                rs = 4.0 * tu[i] + max(2.0 * tu[i], 4.0 * t[i] / world)
                moment(
                    f"reduce {i} ({kind} row)",
                    grads=grads,
                    gathered=root_gathered + out_grad + last_ag + rs + (2.0 * u[i - 1] if world > 1 and i > 0 else 0.0),
                    activations=sum(held[:i]),
                )
        # the root: the embedding's backward (its dense gradient), then (FSDP2) the root's reduce
        layer_grads = sum(grad_of)
        if fsdp:
            emb = 2.0 * v * d if root_t else 0.0
            rs = 0.0 if offload else 4.0 * root_t + max(2.0 * root_t, 4.0 * root_t / world)
            moment(
                f"root ({kind} row)",
                grads=layer_grads + (grad_root if later else 0.0),
                gathered=max(root_gathered + out_grad + emb, rs),
            )
        else:
            emb = gb * v * d if root_t else 0.0
            moment(f"root ({kind} row)", grads=layer_grads + out_grad + emb)
    moment("optimizer", grads=all_grads)
    totals = {name: sum(parts.values()) for name, parts in phases.items()}
    worst = max(totals, key=lambda name: totals[name])
    return TrainerMemory(parts=dict(phases[worst]), host=host, sources=dict(SOURCES), phase=worst, phases=totals)


SOURCES = {
    "weights": "4 B x parameters / world (fp32 shards; bench :bf16 2 B); cpu_offload: host",
    "grads": "4 B x trained parameters / world, those made by the peak (bf16 + SGD: 2 B)",
    "optimizer": "8 B x trained parameters / world (AdamW's fp32 moments; SGD 0); cpu_offload: host",
    "gathered": "FSDP2's bf16 copies: root 2 R, running layer 2 U, prefetch 2 U (W > 1), unsharded grads 2 U, "
    "reduce-scatter input 4 U kept, output weight's bf16 grad 2 V D",
    "activations": "per layer by block kind (plan.py's docstring: saved tensors per block) x row_tokens / cp; "
    "checkpointing: each layer's input, one layer recomputed; bench: + 2 B x layer parameters of weight casts",
    "logits": "final norm + hidden states saved, one 4096-token chunk of logits 2 C V (keep_logits: 2 T V), "
    "fp32 output-weight gradient 4-8 V D, bench's bf16 weight copy 2 V D",
    "overhead": "0: the CUDA context and the allocator's cache are outside max_memory_allocated (not covered)",
}


__all__ = [
    "LayerSaved",
    "TrainerLayout",
    "TrainerMemory",
    "layer_params",
    "layer_saved",
    "layer_saved_parts",
    "lora_params",
    "trainer_memory",
]
