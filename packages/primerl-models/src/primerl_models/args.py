"""ModelArgs: a decoder-only model described layer by layer, which every family fills in.

A model is an embedding, `layers`, a final RMSNorm and the output projection (tied or not).
Each layer is a mixer (today: softmax attention, with its own heads, RoPE and norms) and an
MLP (dense SwiGLU, or a mixture of experts with its own router), each with its settings. The
common blocks (transformer.py, moe.py, rope.py) read their settings from here and nowhere
else; a family file (families/) maps a config.json onto it. Layers whose settings are equal
share one (frozen) spec object, so a uniform model costs one spec.

    attn = Attention(num_heads=16, num_kv_heads=8, head_dim=128, rope=Rope(theta=1e6, rotary_dim=128))
    args = ModelArgs("qwen3", vocab_size=151936, hidden_size=1024,
                     layers=[Layer(attn, DenseMLP(3072))] * 28)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

QKNorm = Literal["none", "head", "full"]
Gate = Literal["none", "sigmoid", "softplus"]
Scoring = Literal["softmax", "sigmoid", "softmax_topk"]
Activation = Literal["silu", "clamped", "relu2"]


@dataclass(frozen=True)
class Rope:
    """Rotary position embedding of one attention block."""

    rotary_dim: int
    """Dimensions of each head that rotate (the first ones); the rest pass unchanged
    (partial RoPE: GLM-4, GLM-4.5, MiniMax-M2). Equal to head_dim for full RoPE."""
    theta: float = 10000.0
    scaling: dict | None = field(default=None, hash=False)
    """Llama-3 style frequency scaling ({"rope_type": "llama3", "factor": ..., ...}) or None."""
    interleaved: bool = False
    """Rotate pairs (0, 1), (2, 3), ... (GLM-4) instead of the two halves (Llama, Qwen)."""
    mrope_section: tuple[int, int, int] | None = None
    """Multi-axis RoPE (Qwen3-VL, Qwen3.5) for (t, h, w) positions, interleaved: frequency j
    turns with the h position when j % 3 == 1 and j < 3 * section[1], with the w position when
    j % 3 == 2 and j < 3 * section[2], else with the t position. Used only when the forward is
    given 3-axis positions (images); text alone has t = h = w, the plain 1-D RoPE."""

    def __post_init__(self) -> None:
        if self.rotary_dim <= 0 or self.rotary_dim % 2:
            raise ValueError(f"rotary_dim must be a positive even number, got {self.rotary_dim}")
        if self.mrope_section is not None and (len(self.mrope_section) != 3 or min(self.mrope_section) < 0):
            raise ValueError(f"mrope_section must be 3 non-negative counts (t, h, w), got {self.mrope_section}")


@dataclass(frozen=True)
class Attention:
    """Softmax attention (grouped-query): q, k, v projections, optional norms, RoPE, an optional
    output gate, o."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope: Rope | None
    """None: no positions at all (Trinity's global layers)."""
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: QKNorm = "none"
    """RMSNorm of q and k before RoPE: over each head ("head": Qwen3, GLM-4.5 with
    use_qk_norm) or over the whole projection ("full": MiniMax-M2)."""
    window: int | None = None
    """Sliding window: each query sees itself and the window - 1 tokens before it, within its
    document (HF's `sliding_window` on a "sliding_attention" layer); None: the whole document."""
    sinks: bool = False
    """A learned logit per head that joins every query's softmax and carries no value
    (GPT-OSS's attention sinks): the weights of the real keys sum to less than 1."""
    gate: Gate = "none"
    """An output gate computed from the layer's input (`gate_proj`, no bias): the attention's
    output times sigmoid (Trinity) or softplus (Laguna) of it, before o_proj."""
    gate_per_head: bool = False
    """One gate value per head (Laguna's "per-head") instead of one per output element."""

    def __post_init__(self) -> None:
        if self.num_kv_heads <= 0 or self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.rope is not None and self.rope.rotary_dim > self.head_dim:
            raise ValueError(f"rotary_dim ({self.rope.rotary_dim}) is larger than head_dim ({self.head_dim})")
        if self.qk_norm not in ("none", "head", "full"):
            raise ValueError(f"qk_norm must be 'none', 'head' or 'full', got {self.qk_norm!r}")
        if self.gate not in ("none", "sigmoid", "softplus"):
            raise ValueError(f"attention gate must be 'none', 'sigmoid' or 'softplus', got {self.gate!r}")
        if self.window is not None and self.window < 1:
            raise ValueError(f"sliding_window must be a positive number of tokens, got {self.window}")

    def cp_splits(self) -> list[tuple[int, str]]:
        """What context parallelism splits over its ranks (each count must divide)."""
        return [(self.num_heads, "attention heads (num_attention_heads)")]

    def mixing_flops(self, lengths: list[float]) -> float:
        """Forward + backward FLOPs of causal attention beyond the projections, over documents of
        these lengths: 6 H K n^2 per document of n tokens (QK^T and AV, half the square each,
        times 3 for the backward); with a sliding window of w, 12 H K times the keys the queries
        see (w (n - w) + w^2 / 2 once n > w)."""
        w = self.window
        pairs = sum(n * n / 2 if w is None or n <= w else w * (n - w) + w * w / 2 for n in lengths)
        return 12 * self.num_heads * self.head_dim * pairs

    def num_params(self, dim: int) -> int:
        h, g, k = self.num_heads, self.num_kv_heads, self.head_dim
        params = dim * h * k * 2 + dim * g * k * 2
        params += (h + 2 * g) * k if self.qkv_bias else 0
        params += dim if self.o_bias else 0
        params += {"none": 0, "head": 2 * k, "full": (h + g) * k}[self.qk_norm]
        params += h if self.sinks else 0
        params += 0 if self.gate == "none" else dim * (h if self.gate_per_head else h * k)
        return params


@dataclass(frozen=True)
class DSAIndexer:
    """DeepSeek Sparse Attention's indexer (GLM-5, DeepSeek-V3.2): per query t and key s <= t of
    its document, score(t, s) = sum_j w_tj * relu(q_tj . k_s / sqrt(head_dim)), w_t =
    weights_proj(x_t) / sqrt(num_heads), q from the query latent (wq_b), one k per token
    (LayerNorm(wk(x))), both with RoPE on their first rotary dims; each query attends to its
    `topk` best keys only."""

    num_heads: int
    head_dim: int
    topk: int

    def __post_init__(self) -> None:
        if self.topk < 1:
            raise ValueError(f"index_topk must be >= 1, got {self.topk}")

    def num_params(self, dim: int, q_lora_rank: int) -> int:
        h, k = self.num_heads, self.head_dim
        return q_lora_rank * h * k + dim * k + 2 * k + dim * h


@dataclass(frozen=True)
class MLA:
    """Multi-head Latent Attention (DeepSeek-V3, GLM-5): q through a low-rank latent (q_a_proj,
    RMSNorm, q_b_proj; or one q_proj when q_lora_rank is None); keys and values from one shared
    latent of kv_lora_rank (kv_a_proj_with_mqa, RMSNorm, kv_b_proj) plus a RoPE part of
    qk_rope_head_dim shared by the heads; each head's q and k are [nope, rope], its value
    v_head_dim wide. With `indexer` (DSA), each query attends only to the keys its indexer
    selects; a layer with `reuse_topk` (GLM-5's "shared" indexer layers) takes the selection of
    the layer that wrote `topk_slot`."""

    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope: Rope
    softmax_scale: float | None = None
    """None: 1 / sqrt(qk_nope_head_dim + qk_rope_head_dim) (the family adds YaRN's mscale^2)."""
    bias: bool = False
    """q_a_proj, kv_a_proj_with_mqa and o_proj have biases (attention_bias)."""
    latent_eps: float = 1e-6
    """The latents' RMSNorms' epsilon (fixed at 1e-6 in DeepSeek's and GLM-5's code)."""
    indexer: DSAIndexer | None = None
    reuse_topk: bool = False
    topk_slot: int = 0
    """The layer whose selection a sparse layer uses (its own, when it has an indexer)."""
    reused_topk: int = 0
    """With `reuse_topk`: the keys per query of the selection it reuses (its indexer's topk)."""

    def __post_init__(self) -> None:
        if self.rope.rotary_dim != self.qk_rope_head_dim:
            raise ValueError(
                f"MLA rotary_dim ({self.rope.rotary_dim}) must be qk_rope_head_dim ({self.qk_rope_head_dim})"
            )
        if self.reuse_topk and self.reused_topk < 1:
            raise ValueError("an MLA layer reusing another layer's selection needs that selection's topk (reused_topk)")
        if self.indexer is not None and self.reuse_topk:
            raise ValueError("an MLA layer has its own indexer or reuses another layer's selection, not both")
        if self.indexer is not None and self.q_lora_rank is None:
            raise ValueError("the DSA indexer reads the query latent: it needs q_lora_rank")
        if self.indexer is not None and self.indexer.head_dim < self.qk_rope_head_dim:
            raise ValueError(
                f"index_head_dim ({self.indexer.head_dim}) is smaller than qk_rope_head_dim ({self.qk_rope_head_dim})"
            )

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def sparse(self) -> bool:
        return self.indexer is not None or self.reuse_topk

    @property
    def topk(self) -> int:
        """The keys a sparse layer's query attends to at most."""
        return self.indexer.topk if self.indexer is not None else self.reused_topk

    @property
    def scale(self) -> float:
        return self.qk_head_dim**-0.5 if self.softmax_scale is None else self.softmax_scale

    def cp_splits(self) -> list[tuple[int, str]]:
        return []  # context parallelism gathers the shared latent rows; nothing is split by heads

    def mixing_flops(self, lengths: list[float]) -> float:
        """Attention's 6 x (QK^T + AV) per head over the keys each query attends to (with DSA,
        min(topk, its position + 1): the selected ones), plus the indexer's q.k products over
        every causal pair (forward only: it is not differentiated)."""
        pairs = sum(n * (n + 1) / 2 for n in lengths)
        attended = pairs
        if self.sparse:
            topk = self.topk
            attended = sum(n * (n + 1) / 2 if n <= topk else topk * (topk + 1) / 2 + (n - topk) * topk for n in lengths)
        flops = 6 * self.num_heads * (self.qk_head_dim + self.v_head_dim) * attended
        if self.indexer is not None:
            flops += 2 * self.indexer.num_heads * self.indexer.head_dim * pairs
        return flops

    def num_params(self, dim: int) -> int:
        h, qk, r = self.num_heads, self.qk_head_dim, self.kv_lora_rank
        if self.q_lora_rank is None:
            q = dim * h * qk
        else:
            q = dim * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * h * qk
            q += self.q_lora_rank if self.bias else 0
        kv = dim * (r + self.qk_rope_head_dim) + r + r * h * (self.qk_nope_head_dim + self.v_head_dim)
        kv += (r + self.qk_rope_head_dim) if self.bias else 0
        o = h * self.v_head_dim * dim + (dim if self.bias else 0)
        index = 0 if self.indexer is None else self.indexer.num_params(dim, self.q_lora_rank or 0)
        return q + kv + o + index


@dataclass(frozen=True)
class GatedDeltaNet:
    """Gated DeltaNet linear attention (Qwen3.5's "linear_attention" layers): q, k, v from one
    projection through a depthwise causal conv (SiLU), L2-normalised q and k, a per-head decay
    g = -exp(A_log) * softplus(a + dt_bias) and write strength beta = sigmoid(b), the gated
    delta rule S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T, o_t = S_t^T q_t,
    then an RMSNorm per value head gated by silu(z), and out_proj. The state and the conv
    restart at every document of a packed row."""

    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int = 4

    def __post_init__(self) -> None:
        if self.num_k_heads <= 0 or self.num_v_heads % self.num_k_heads:
            raise ValueError(
                f"linear_num_value_heads ({self.num_v_heads}) must be a multiple of "
                f"linear_num_key_heads ({self.num_k_heads})"
            )
        if self.conv_kernel < 1:
            raise ValueError(f"linear_conv_kernel_dim must be >= 1, got {self.conv_kernel}")

    @property
    def conv_dim(self) -> int:
        return 2 * self.num_k_heads * self.head_k_dim + self.num_v_heads * self.head_v_dim

    def cp_splits(self) -> list[tuple[int, str]]:
        return [
            (self.num_k_heads, "key heads (linear_num_key_heads)"),
            (self.num_v_heads, "value heads (linear_num_value_heads)"),
        ]

    def num_params(self, dim: int) -> int:
        value = self.num_v_heads * self.head_v_dim
        projections = dim * (self.conv_dim + value + 2 * self.num_v_heads) + value * dim
        return projections + self.conv_dim * self.conv_kernel + 2 * self.num_v_heads + self.head_v_dim

    def mixing_flops(self, lengths: list[float], chunk: int = 64) -> float:
        """Forward + backward FLOPs of the chunked scan beyond the projections: per token and
        value head, the chunk's q.k and k.k products and its attention over values (2 C (2 K +
        V)), and three K x V state products (read, correct, write), times 3."""
        k, v, tokens = self.head_k_dim, self.head_v_dim, sum(lengths)
        return 3 * tokens * self.num_v_heads * (2 * chunk * (2 * k + v) + 6 * k * v)


@dataclass(frozen=True)
class Mamba2:
    """Mamba2 (Nemotron-H's "linear_attention" / "M" layers): in_proj to the gate z, x B C and
    dt; a depthwise causal conv with bias over x B C (SiLU); per head a scalar decay
    exp(-exp(A_log) dt), dt = max(softplus(dt + dt_bias), dt_min); the state space scan
    S_t = exp(a_t) S_{t-1} + dt_t B_t x_t^T, y_t = C_t^T S_t + D x_t, with B and C shared by the
    heads of a group; then y * silu(z) normalised per group (RMS) and out_proj. The state and
    the conv restart at every document of a packed row."""

    num_heads: int
    head_dim: int
    state_size: int
    n_groups: int
    conv_kernel: int = 4
    conv_bias: bool = True
    dt_min: float = 0.0

    def __post_init__(self) -> None:
        if self.n_groups <= 0 or self.num_heads % self.n_groups:
            raise ValueError(f"mamba_num_heads ({self.num_heads}) must be a multiple of n_groups ({self.n_groups})")

    @property
    def inner(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.inner + 2 * self.n_groups * self.state_size

    def cp_splits(self) -> list[tuple[int, str]]:
        return [(self.num_heads, "heads (mamba_num_heads)"), (self.n_groups, "groups (n_groups)")]

    def num_params(self, dim: int) -> int:
        projections = dim * (self.inner + self.conv_dim + self.num_heads) + self.inner * dim
        conv = self.conv_dim * (self.conv_kernel + (1 if self.conv_bias else 0))
        return projections + conv + 3 * self.num_heads + self.inner

    def mixing_flops(self, lengths: list[float], chunk: int = 64) -> float:
        """Forward + backward FLOPs of the chunked scan: per token and head, the chunk's C.B
        products and their weighting of x (2 C (N + P)) and two N x P state products, times 3."""
        n, p, tokens = self.state_size, self.head_dim, sum(lengths)
        return 3 * tokens * self.num_heads * (2 * chunk * (n + p) + 4 * n * p)


@dataclass(frozen=True)
class DenseMLP:
    """Feed-forward: SwiGLU (down(silu(gate) * up)), or "relu2": down(relu(up)^2) (Nemotron-H)."""

    intermediate_size: int
    activation: Literal["silu", "relu2"] = "silu"

    def num_params(self, dim: int) -> int:
        return (2 if self.activation == "relu2" else 3) * dim * self.intermediate_size

    def num_active_params(self, dim: int) -> int:
        return self.num_params(dim)


@dataclass(frozen=True)
class Routing:
    """How an fp32 router picks top_k of num_experts for each token and weights them."""

    num_experts: int
    top_k: int
    scoring: Scoring = "softmax"
    """Router scores: softmax over the experts (Qwen3-MoE), a sigmoid of each (GLM-4.5,
    MiniMax-M2), or top-k of the logits, then a softmax over those k (GPT-OSS)."""
    norm_topk_prob: bool = False
    """Renormalise the chosen experts' weights to sum to 1."""
    correction_bias: bool = False
    """A per-expert fp32 bias (`e_score_correction_bias`) added to the scores to choose the
    experts only: the weights are the scores without it. Loaded, kept and published as is."""
    n_group: int = 1
    topk_group: int = 1
    """Group-limited routing: the experts are split into n_group groups, each group scored by
    the sum of its two best experts, and top_k is chosen within the topk_group best groups."""
    scaling: float = 1.0
    """Multiplies the routed experts' weights after any renormalisation (routed_scaling_factor)."""
    bias: bool = False
    """The router's linear layer has a bias (GPT-OSS); it chooses and weights, unlike correction_bias."""
    logit_softcap: float = 0.0
    """> 0: the router's logits become softcap * tanh(logits / softcap) before scoring (Laguna)."""

    def __post_init__(self) -> None:
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok ({self.top_k}) must be in 1..num_experts ({self.num_experts})")
        if self.scoring not in ("softmax", "sigmoid", "softmax_topk"):
            raise ValueError(f"router scoring must be 'softmax', 'sigmoid' or 'softmax_topk', got {self.scoring!r}")
        if self.logit_softcap < 0:
            raise ValueError(f"router logit soft-cap must be >= 0 (0: off), got {self.logit_softcap}")
        if self.n_group < 1 or self.num_experts % self.n_group:
            raise ValueError(f"n_group ({self.n_group}) must divide the number of experts ({self.num_experts})")
        if self.n_group > 1:
            per_group = self.num_experts // self.n_group
            if per_group < 2:
                raise ValueError(f"group-limited routing needs >= 2 experts per group, got {per_group}")
            if not 0 < self.topk_group <= self.n_group:
                raise ValueError(f"topk_group ({self.topk_group}) must be in 1..n_group ({self.n_group})")
            if self.top_k > self.topk_group * per_group:
                raise ValueError(
                    f"num_experts_per_tok ({self.top_k}) is more than the {self.topk_group * per_group} experts "
                    f"of topk_group ({self.topk_group}) groups"
                )

    def num_params(self, dim: int) -> int:
        return self.num_experts * dim + (self.num_experts if self.bias else 0)


@dataclass(frozen=True)
class Experts:
    """The routed experts, all alike: silu: down(silu(gate) * up). clamped (GPT-OSS): gate
    clamped above at `limit`, up to [-limit, limit], then down((up + 1) * gate * sigmoid(alpha *
    gate)). relu2 (Nemotron-H): down(relu(up)^2), no gate."""

    size: int
    """Hidden size of each expert (moe_intermediate_size)."""
    activation: Activation = "silu"
    bias: bool = False
    """Each expert's gate, up and down projections have biases (GPT-OSS)."""
    limit: float = 7.0
    alpha: float = 1.702

    def __post_init__(self) -> None:
        if self.activation not in ("silu", "clamped", "relu2"):
            raise ValueError(f"expert activation must be 'silu', 'clamped' or 'relu2', got {self.activation!r}")

    def num_params(self, dim: int) -> int:
        """Parameters of one expert."""
        mats = 2 if self.activation == "relu2" else 3
        return mats * dim * self.size + ((2 * self.size + dim) if self.bias else 0)


@dataclass(frozen=True)
class SharedExpert:
    """A dense MLP every token also goes through (DenseMLP's activations), its output scaled by
    sigmoid(x . w), w a learned [D], when `gate` (Qwen3.5-MoE)."""

    size: int
    activation: Literal["silu", "relu2"] = "silu"
    gate: bool = False

    def num_params(self, dim: int) -> int:
        return DenseMLP(self.size, self.activation).num_params(dim) + (dim if self.gate else 0)


@dataclass(frozen=True)
class MoEMLP:
    """Mixture of experts: the routing, the routed experts and an optional shared expert."""

    routing: Routing
    experts: Experts
    shared: SharedExpert | None = None
    latent_size: int | None = None
    """Latent experts (Nemotron 3 Super's `moe_latent_size`): the routed experts read and write
    this narrower width; `fc1_latent_proj` [latent, D] takes each token there before them and
    `fc2_latent_proj` [D, latent] takes their weighted sum back (one pair per layer, no bias).
    The router and the shared expert read the full hidden state. None: the experts are D wide."""

    def __post_init__(self) -> None:
        if self.latent_size is not None and self.latent_size < 1:
            raise ValueError(f"moe_latent_size must be a positive width (None: no latent), got {self.latent_size}")

    @property
    def num_experts(self) -> int:
        return self.routing.num_experts

    @property
    def top_k(self) -> int:
        return self.routing.top_k

    def expert_dim(self, dim: int) -> int:
        """The width the routed experts read and write: the latent's, else the hidden size."""
        return dim if self.latent_size is None else self.latent_size

    def num_params(self, dim: int) -> int:
        shared = 0 if self.shared is None else self.shared.num_params(dim)
        latent = 0 if self.latent_size is None else 2 * dim * self.latent_size
        experts = self.num_experts * self.experts.num_params(self.expert_dim(dim))
        return experts + self.routing.num_params(dim) + shared + latent

    def num_active_params(self, dim: int) -> int:
        return self.num_params(dim) - (self.num_experts - self.top_k) * self.experts.num_params(self.expert_dim(dim))


MLPSpec = DenseMLP | MoEMLP


@dataclass(frozen=True)
class Vision:
    """A ViT vision tower whose image features replace the image tokens' embeddings (Qwen3-VL
    without deepstack, Qwen3.5): patches of temporal_patch_size frames x patch_size^2 pixels
    embedded by one matrix, plus a learned square grid of position embeddings resampled
    (bilinear) to each image's grid; `depth` pre-LayerNorm blocks of bidirectional attention
    within each frame (2-D RoPE over the patch's row and column) and a GELU MLP; then each
    spatial_merge_size^2 block of patches merged into one text-model token (LayerNorm, two
    linears with a GELU between them)."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    """The text model's hidden size: what a merged token becomes."""
    image_token_id: int
    """The placeholder token whose embeddings the image features replace, in order."""
    patch_size: int = 16
    temporal_patch_size: int = 2
    in_channels: int = 3
    spatial_merge_size: int = 2
    num_position_embeddings: int = 2304
    """Learned positions of a square grid (48 x 48 for 2304)."""
    rope_theta: float = 10000.0
    activation: Literal["gelu_tanh", "gelu"] = "gelu_tanh"
    """The blocks' MLP activation (HF's "gelu_pytorch_tanh" or "gelu"); the merger's is exact GELU."""
    norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        if self.num_heads <= 0 or self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 4:
            raise ValueError(
                f"vision hidden_size ({self.hidden_size}) must be num_heads ({self.num_heads}) heads "
                "of a multiple of 4 dimensions (2-D RoPE: a quarter each for rows and columns, twice)"
            )
        side = round(self.num_position_embeddings**0.5)
        if side * side != self.num_position_embeddings:
            raise ValueError(f"vision num_position_embeddings ({self.num_position_embeddings}) must be a square")
        if self.activation not in ("gelu_tanh", "gelu"):
            raise ValueError(f"vision activation must be 'gelu_tanh' or 'gelu', got {self.activation!r}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Values of one patch: channels x frames x pixels (pixel_values' columns)."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    def num_params(self) -> int:
        d, f, m = self.hidden_size, self.intermediate_size, self.hidden_size * self.spatial_merge_size**2
        block = 4 * d + (3 * d * d + 3 * d) + (d * d + d) + 2 * d * f + f + d
        merger = 2 * d + m * m + m + m * self.out_hidden_size + self.out_hidden_size
        return self.patch_dim * d + d + self.num_position_embeddings * d + self.depth * block + merger


@dataclass(frozen=True)
class Layer:
    """One decoder layer: pre-norm mixer and MLP, each added to the residual stream."""

    mixer: Attention | MLA | GatedDeltaNet | Mamba2 | None
    mlp: MLPSpec | None
    """Either may be None: Nemotron-H's layers are a mixer alone or an MLP alone."""
    sandwich_norm: bool = False
    """RMSNorm on the mixer's and the MLP's outputs too, before each residual add (GLM-4)."""

    def __post_init__(self) -> None:
        if self.mixer is None and self.mlp is None:
            raise ValueError("a layer needs a mixer or an MLP")

    def num_params(self, dim: int) -> int:
        parts = [p for p in (self.mixer, self.mlp) if p is not None]
        return sum(p.num_params(dim) for p in parts) + len(parts) * (2 if self.sandwich_norm else 1) * dim

    def num_active_params(self, dim: int) -> int:
        if self.mlp is None:
            return self.num_params(dim)
        return self.num_params(dim) - self.mlp.num_params(dim) + self.mlp.num_active_params(dim)


@dataclass
class ModelArgs:
    """A model: its vocabulary, width and layers. Families build it from a HF config.json."""

    model_type: str
    vocab_size: int
    hidden_size: int
    layers: list[Layer]
    rms_norm_eps: float = 1e-6
    tie_embeddings: bool = False
    max_position_embeddings: int = 32768
    embed_scale: float = 1.0
    """Multiplies the token embeddings before the first layer (muP: sqrt(hidden_size))."""
    zero_centered_norms: bool = False
    """The RMSNorms (layers', final, q/k) scale by 1 + weight, computed in fp32 (Qwen3.5); their
    weights start at 0."""
    vision: Vision | None = None
    """The vision tower of a vision-language model (its features replace the image tokens)."""
    freeze_vision: bool = True
    """The vision tower's parameters are built with requires_grad False (trained: set False
    before building the model, or `model.visual.requires_grad_(True)`)."""

    def __post_init__(self) -> None:
        if not self.layers:
            raise ValueError("a model needs at least one layer")

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def moe_layers(self) -> list[bool]:
        """Per layer: True where the MLP is a mixture of experts."""
        return [isinstance(layer.mlp, MoEMLP) for layer in self.layers]

    def num_params(self, embeddings: bool = True) -> int:
        """Parameter count (without embeddings: the N of 6N FLOPs per token, lm_head kept) of the
        text model; a vision tower's is `vision.num_params()`."""
        d = self.hidden_size
        total = sum(layer.num_params(d) for layer in self.layers)
        total += d + self.vocab_size * d  # final norm, lm_head (or the tied embedding)
        if embeddings and not self.tie_embeddings:
            total += self.vocab_size * d
        return total

    def num_active_params(self) -> int:
        """Parameters each token goes through (MoE: only its top-k experts), embeddings excluded."""
        d = self.hidden_size
        return sum(layer.num_active_params(d) for layer in self.layers) + d + self.vocab_size * d

    def prompt_sharing_problem(self) -> str | None:
        """Why rows whose samples share a prompt (packing.PackedSeqs.from_segments) would not be
        computed exactly by this model, or None: every layer's mixer must be softmax attention,
        which a completion can continue from the prompt's keys and values. A recurrent state
        (Gated DeltaNet, Mamba2) and its convolution would have to be forked at the prompt's
        end; MLA's blocks (and DSA's top-k selection) read whole documents only."""
        for i, layer in enumerate(self.layers):
            if layer.mixer is not None and not isinstance(layer.mixer, Attention):
                kind = type(layer.mixer).__name__
                why = (
                    "is recurrent (its state cannot branch at the prompt's end)"
                    if isinstance(layer.mixer, GatedDeltaNet | Mamba2)
                    else "attends over whole documents only"
                )
                return f"{self.model_type}'s layer {i} mixes tokens with {kind}, which {why}"
        return None

    def train_flops(self, doc_lengths) -> float:
        """FLOPs of forward + backward over documents of these lengths (one packed row or many):
        6 N_active per token, plus what each layer's mixer does beyond its projections
        (`mixing_flops`: causal attention over each document, or a recurrent scan)."""
        lengths = [float(n) for n in doc_lengths]
        mixing = sum(layer.mixer.mixing_flops(lengths) for layer in self.layers if layer.mixer is not None)
        return 6 * self.num_active_params() * sum(lengths) + mixing
