"""The decoder-only transformer every family is made of (Llama, Qwen3, Qwen3-MoE, ...).

Single-device code: parallelism (FSDP2, expert and context parallel), activation
checkpointing and compilation are applied from outside, layer by layer. Parameter names follow
Hugging Face's (without the `model.` prefix) except the stacked experts, so conversion stays
small (families/).

`forward(input_ids, position_ids)` takes packed rows and returns the final hidden states;
logits are left to the caller (see logprobs.py for the chunked path that never holds
[tokens x vocab] in fp32).

Legend: B batch, T tokens, D hidden, H heads, G kv heads, K head_dim, V vocab.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from primerl_models.common.args import ModelArgs
from primerl_models.common.attention import Backend, PackedSeqs, attention
from primerl_models.common.logprobs import chunked_logprobs
from primerl_models.common.moe import MoE
from primerl_models.common.rope import apply_rope, inv_freq, rope_cos_sin


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32, scale in the input dtype (as the reference implementations do).
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)
        return self.weight.to(x.dtype) * normed


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        d, h, g, k = args.hidden_size, args.num_heads, args.num_kv_heads, args.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = h, g, k
        self.q_proj = nn.Linear(d, h * k, bias=args.attention_bias)
        self.k_proj = nn.Linear(d, g * k, bias=args.attention_bias)
        self.v_proj = nn.Linear(d, g * k, bias=args.attention_bias)
        self.o_proj = nn.Linear(h * k, d, bias=args.attention_bias)
        self.q_norm = RMSNorm(k, args.rms_norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(k, args.rms_norm_eps) if args.qk_norm else None

    def forward(self, x_BTD, cos_BTK, sin_BTK, seqs: PackedSeqs, backend: Backend) -> torch.Tensor:
        b, t, _ = x_BTD.shape
        q_BTHK = self.q_proj(x_BTD).view(b, t, self.num_heads, self.head_dim)
        k_BTGK = self.k_proj(x_BTD).view(b, t, self.num_kv_heads, self.head_dim)
        v_BTGK = self.v_proj(x_BTD).view(b, t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q_BTHK, k_BTGK = self.q_norm(q_BTHK), self.k_norm(k_BTGK)
        q_BTHK, k_BTGK = apply_rope(q_BTHK, cos_BTK, sin_BTK), apply_rope(k_BTGK, cos_BTK, sin_BTK)
        out_BTHK = attention(q_BTHK, k_BTGK, v_BTGK, seqs, backend)
        return self.o_proj(out_BTHK.reshape(b, t, -1))


class MLP(nn.Module):
    """SwiGLU feed-forward."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, moe: bool):
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = Attention(args)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp: nn.Module = (
            MoE(args.hidden_size, args.moe_intermediate_size, args.num_experts, args.num_experts_per_tok, args.norm_topk_prob)
            if moe
            else MLP(args.hidden_size, args.intermediate_size)
        )

    def forward(self, x_BTD, cos_BTK, sin_BTK, seqs: PackedSeqs, backend: Backend) -> torch.Tensor:
        x_BTD = x_BTD + self.self_attn(self.input_layernorm(x_BTD), cos_BTK, sin_BTK, seqs, backend)
        return x_BTD + self.mlp(self.post_attention_layernorm(x_BTD))


class Transformer(nn.Module):
    """Embedding, decoder layers, final norm and the output projection (tied or not)."""

    def __init__(self, args: ModelArgs, attn_backend: Backend = "auto"):
        super().__init__()
        self.args = args
        self.attn_backend: Backend = attn_backend
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args, moe) for moe in args.moe_layers)
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.lm_head = None if args.tie_embeddings else nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self._inv_freq: dict[torch.device, torch.Tensor] = {}

    @property
    def output_weight(self) -> torch.Tensor:
        """[V, D]: the lm_head weight, or the embedding when they are tied."""
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def _rope(self, position_ids_BT: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        device = position_ids_BT.device
        if device not in self._inv_freq:
            self._inv_freq[device] = inv_freq(self.args).to(device)
        return rope_cos_sin(position_ids_BT, self._inv_freq[device])

    def forward(
        self,
        input_ids_BT: torch.Tensor,
        position_ids_BT: torch.Tensor,
        targets_BT: torch.Tensor | None = None,
        temperatures_BT: torch.Tensor | None = None,
        chunk_size: int = 4096,
    ):
        """Final hidden states [B, T, D] of packed rows (positions restart at each document).

        With `targets`, returns (logprobs, entropy) [B, T] of the targets instead, computed
        inside the forward by the chunked path (no full logits; and under FSDP the output
        weight is only gathered inside the forward): logprobs[b, t] = log p(targets[b, t] |
        tokens <= t) at temperatures[b, t] (default 1).
        """
        seqs = PackedSeqs.from_position_ids(position_ids_BT)
        cos_BTK, sin_BTK = self._rope(position_ids_BT)
        x_BTD = self.embed_tokens(input_ids_BT)
        for layer in self.layers:
            x_BTD = layer(x_BTD, cos_BTK, sin_BTK, seqs, self.attn_backend)
        hidden_BTD = self.norm(x_BTD)
        if targets_BT is None:
            return hidden_BTD
        b, t, d = hidden_BTD.shape
        temps_N = 1.0 if temperatures_BT is None else temperatures_BT.reshape(-1)
        logprobs_N, entropy_N = chunked_logprobs(
            hidden_BTD.reshape(b * t, d), self.output_weight, targets_BT.reshape(-1), temps_N, chunk_size
        )
        # Fresh tensors, not views: FSDP2 hooks a module's outputs for its backward.
        return logprobs_N.reshape(b, t).clone(), entropy_N.reshape(b, t).clone()

    def logits(self, input_ids_BT: torch.Tensor, position_ids_BT: torch.Tensor) -> torch.Tensor:
        """Full logits [B, T, V]: for tests and small models; training uses logprobs.py."""
        hidden_BTD = self(input_ids_BT, position_ids_BT)
        return hidden_BTD @ self.output_weight.to(hidden_BTD.dtype).T

    @torch.no_grad()
    def init_weights(self, std: float = 0.02, generator: torch.Generator | None = None) -> None:
        """Random weights (tiny models, benchmarks): normal(0, std) matrices, unit norms."""
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.normal_(0.0, std, generator=generator)
        self.reset_moe_stats()

    @torch.no_grad()
    def moe_stats(self) -> torch.Tensor | None:
        """[MoE layers, E] tokens routed to each expert in the last forward (None if dense)."""
        stats = [m.tokens_per_expert.clone() for m in self.modules() if isinstance(m, MoE)]
        return torch.stack(stats) if stats else None

    @torch.no_grad()
    def reset_moe_stats(self) -> None:
        for m in self.modules():
            if isinstance(m, MoE):
                m.tokens_per_expert.zero_()
