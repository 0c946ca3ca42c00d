"""ModelArgs: the one description of a decoder-only transformer that every family fills in."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ModelArgs:
    """Shapes and options of a model. Families build it from a Hugging Face config.json."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    """Llama-3 style scaling ({"rope_type": "llama3", "factor": ..., ...}) or None."""
    tie_embeddings: bool = False
    qk_norm: bool = False
    """RMSNorm over each head of q and k before RoPE (Qwen3)."""
    attention_bias: bool = False
    max_position_embeddings: int = 32768
    # Mixture of experts (num_experts == 0: dense).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    moe_layers: list[bool] = field(default_factory=list)
    """Per layer: True where the MLP is a mixture of experts."""

    def __post_init__(self) -> None:
        if not self.moe_layers:
            self.moe_layers = [self.num_experts > 0] * self.num_layers
        if len(self.moe_layers) != self.num_layers:
            raise ValueError(f"moe_layers has {len(self.moe_layers)} entries for {self.num_layers} layers")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if any(self.moe_layers) and not (0 < self.num_experts_per_tok <= self.num_experts):
            raise ValueError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) must be in 1..num_experts ({self.num_experts})"
            )

    def num_params(self, embeddings: bool = True) -> int:
        """Parameter count (without embeddings: the N of 6N FLOPs per token, lm_head kept)."""
        d, h, g, k = self.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim
        attn = d * (h * k) * 2 + d * (g * k) * 2 + (2 * k if self.qk_norm else 0)
        total = 0
        for moe in self.moe_layers:
            mlp = (
                self.num_experts * 3 * d * self.moe_intermediate_size + self.num_experts * d
                if moe
                else 3 * d * self.intermediate_size
            )
            total += attn + mlp + 2 * d
        total += d + self.vocab_size * d  # final norm, lm_head (or the tied embedding)
        if embeddings and not self.tie_embeddings:
            total += self.vocab_size * d
        return total

    def num_active_params(self) -> int:
        """Parameters each token goes through (MoE: only its top-k experts), embeddings excluded."""
        if not any(self.moe_layers):
            return self.num_params(embeddings=False)
        inactive = (self.num_experts - self.num_experts_per_tok) * 3 * self.hidden_size * self.moe_intermediate_size
        return self.num_params(embeddings=False) - inactive * sum(self.moe_layers)
