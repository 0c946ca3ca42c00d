"""The decoder-only transformer every family is made of, built layer by layer from ModelArgs
(args.py): each layer's attention, RoPE, norms and MLP (dense or MoE) as its spec says. No
family names here: families/ turn a config.json into the specs.

Single-device code: parallelism (FSDP2, expert and context parallel), activation
checkpointing and compilation are applied from outside, layer by layer. Parameter names follow
Hugging Face's (without the `model.` prefix) except the stacked experts, so conversion stays
small (families/).

`forward(input_ids, position_ids)` takes packed rows and returns the final hidden states;
logits are left to the caller (see logprobs.py for the chunked path that never holds
[tokens x vocab] in fp32). A vision-language model (`args.vision`) takes images too: their
patches and grids, whose features replace the image tokens' embeddings, and the (t, h, w)
positions of the multi-axis RoPE (vision.py); without images, calls are the text model's.

Legend: B batch, T tokens, D hidden, H heads, G kv heads, K head_dim, R rotary dims, V vocab.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from primerl_models.common.args import Attention as AttentionSpec
from primerl_models.common.args import GatedDeltaNet, Layer, Mamba2, ModelArgs, MoEMLP, Rope
from primerl_models.common.attention import Backend, PackedSeqs, attention
from primerl_models.common.linear_attention import GatedDeltaNetMixer, Mamba2Mixer
from primerl_models.common.logprobs import chunked_logprobs
from primerl_models.common.moe import MoE, dense_mlp
from primerl_models.common.rope import apply_rope, attention_factor, inv_freq, mrope_cos_sin, rope_cos_sin
from primerl_models.common.vision import VisionTower, mrope_positions, scatter_images


class RMSNorm(nn.Module):
    """x / rms(x) * weight; zero-centred (Qwen3.5): * (1 + weight), the weight starting at 0."""

    def __init__(self, dim: int, eps: float, zero_centered: bool = False):
        super().__init__()
        self.eps, self.zero_centered = eps, zero_centered
        self.weight = nn.Parameter(torch.zeros(dim) if zero_centered else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.zero_centered:  # scaled in fp32, then cast (as Qwen3.5's reference does)
            return (F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps) * (1.0 + self.weight.float())).to(x.dtype)
        # Normalise in fp32, scale in the input dtype (as the reference implementations do).
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)
        return self.weight.to(x.dtype) * normed


class Attention(nn.Module):
    def __init__(self, spec: AttentionSpec, dim: int, eps: float, zero_centered: bool = False):
        super().__init__()
        h, g, k = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.spec = spec
        self.num_heads, self.num_kv_heads, self.head_dim = h, g, k
        self.q_proj = nn.Linear(dim, h * k, bias=spec.qkv_bias)
        self.k_proj = nn.Linear(dim, g * k, bias=spec.qkv_bias)
        self.v_proj = nn.Linear(dim, g * k, bias=spec.qkv_bias)
        self.o_proj = nn.Linear(h * k, dim, bias=spec.o_bias)
        norm_q, norm_k = {"none": (0, 0), "head": (k, k), "full": (h * k, g * k)}[spec.qk_norm]
        self.q_norm = RMSNorm(norm_q, eps, zero_centered) if norm_q else None
        self.k_norm = RMSNorm(norm_k, eps, zero_centered) if norm_k else None
        self.sinks = nn.Parameter(torch.zeros(h)) if spec.sinks else None
        if spec.gate != "none":
            self.gate_proj = nn.Linear(dim, h if spec.gate_per_head else h * k, bias=False)

    def forward(self, x_BTD, cos_BTR, sin_BTR, seqs: PackedSeqs, backend: Backend) -> torch.Tensor:
        b, t, _ = x_BTD.shape
        q, k, v = self.q_proj(x_BTD), self.k_proj(x_BTD), self.v_proj(x_BTD)
        if self.spec.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        q_BTHK = q.view(b, t, self.num_heads, self.head_dim)
        k_BTGK = k.view(b, t, self.num_kv_heads, self.head_dim)
        v_BTGK = v.view(b, t, self.num_kv_heads, self.head_dim)
        if self.spec.qk_norm == "head":
            q_BTHK, k_BTGK = self.q_norm(q_BTHK), self.k_norm(k_BTGK)
        if self.spec.rope is not None:  # else no positions (cos, sin are None)
            interleaved = self.spec.rope.interleaved
            q_BTHK = apply_rope(q_BTHK, cos_BTR, sin_BTR, interleaved)
            k_BTGK = apply_rope(k_BTGK, cos_BTR, sin_BTR, interleaved)
        out_BTHK = attention(q_BTHK, k_BTGK, v_BTGK, seqs, backend, window=self.spec.window, sinks_H=self.sinks)
        if self.spec.gate != "none":
            out_BTHK = out_BTHK * self._gate(x_BTD, out_BTHK.dtype).view(b, t, self.num_heads, -1)
        return self.o_proj(out_BTHK.reshape(b, t, -1))

    def _gate(self, x_BTD: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[B, T, H or H*K]: sigmoid or softplus (in fp32 at least) of gate_proj(x)."""
        g = self.gate_proj(x_BTD)
        if self.spec.gate == "sigmoid":
            return torch.sigmoid(g).to(dtype)
        return F.softplus(g.float()).to(dtype)


class DecoderLayer(nn.Module):
    """Pre-norm mixer and MLP as its `Layer` spec says (args.py); with sandwich norms, their
    outputs are normalised again before the residual adds (GLM-4's post_*_layernorm). The mixer
    is `self_attn` (softmax attention) or `linear_attn` (Gated DeltaNet), as HF names them."""

    def __init__(self, spec: Layer, dim: int, eps: float, zero_centered: bool = False):
        super().__init__()
        self.spec = spec
        if spec.mixer is not None:
            self.input_layernorm = RMSNorm(dim, eps, zero_centered)
            if isinstance(spec.mixer, GatedDeltaNet):
                self.linear_attn = GatedDeltaNetMixer(spec.mixer, dim, eps)
            elif isinstance(spec.mixer, Mamba2):
                self.mamba = Mamba2Mixer(spec.mixer, dim, eps)
            else:
                self.self_attn = Attention(spec.mixer, dim, eps, zero_centered)
            if spec.sandwich_norm:
                self.post_self_attn_layernorm = RMSNorm(dim, eps, zero_centered)
        if spec.mlp is not None:
            self.post_attention_layernorm = RMSNorm(dim, eps, zero_centered)
            self.mlp: nn.Module = (
                MoE(dim, spec.mlp) if isinstance(spec.mlp, MoEMLP)
                else dense_mlp(dim, spec.mlp.intermediate_size, spec.mlp.activation)
            )
            if spec.sandwich_norm:
                self.post_mlp_layernorm = RMSNorm(dim, eps, zero_centered)

    @property
    def mixer(self) -> nn.Module | None:
        kind = self.spec.mixer
        if kind is None:
            return None
        return self.linear_attn if isinstance(kind, GatedDeltaNet) else self.mamba if isinstance(kind, Mamba2) else self.self_attn

    def forward(self, x_BTD, cos_BTR, sin_BTR, seqs: PackedSeqs, backend: Backend) -> torch.Tensor:
        if self.spec.mixer is not None:
            mixed = self.mixer(self.input_layernorm(x_BTD), cos_BTR, sin_BTR, seqs, backend)
            if self.spec.sandwich_norm:
                mixed = self.post_self_attn_layernorm(mixed)
            x_BTD = x_BTD + mixed
        if self.spec.mlp is None:
            return x_BTD
        out = self.mlp(self.post_attention_layernorm(x_BTD))
        if self.spec.sandwich_norm:
            out = self.post_mlp_layernorm(out)
        return x_BTD + out


class Transformer(nn.Module):
    """Embedding, decoder layers, final norm and the output projection (tied or not)."""

    def __init__(self, args: ModelArgs, attn_backend: Backend = "auto"):
        super().__init__()
        self.args = args
        self.attn_backend: Backend = attn_backend
        """A back-end name, or attention supplied from outside (a callable; see attention.py)."""
        self.keep_logits = False
        """With targets, keep the logits from the forward to the backward rather than recompute
        them (chunked_logprobs' keep_logits: faster, [tokens x vocab] more memory)."""
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        zero_centered = args.zero_centered_norms
        self.layers = nn.ModuleList(DecoderLayer(spec, args.hidden_size, args.rms_norm_eps, zero_centered)
                                    for spec in args.layers)
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, zero_centered)
        self.lm_head = None if args.tie_embeddings else nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.visual = None if args.vision is None else VisionTower(args.vision)
        if self.visual is not None:  # frozen unless asked (args.freeze_vision)
            self.visual.requires_grad_(not args.freeze_vision)
        self._rope_specs = list(dict.fromkeys(layer.mixer.rope for layer in args.layers
                                              if layer.mixer is not None and layer.mixer.rope is not None))
        self._inv_freq: dict[tuple[Rope, torch.device], torch.Tensor] = {}

    @property
    def output_weight(self) -> torch.Tensor:
        """[V, D]: the lm_head weight, or the embedding when they are tied."""
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def _ropes(self, position_ids_BT: torch.Tensor, mrope_3BT: torch.Tensor | None = None
               ) -> dict[Rope, tuple[torch.Tensor, torch.Tensor]]:
        """cos, sin of each distinct RoPE of the layers (most models have one), from the 1-D
        positions or, when given, the (t, h, w) ones."""
        out = {}
        for spec in self._rope_specs:
            key = (spec, position_ids_BT.device)
            if key not in self._inv_freq:
                self._inv_freq[key] = inv_freq(spec).to(position_ids_BT.device)
            if mrope_3BT is None:
                out[spec] = rope_cos_sin(position_ids_BT, self._inv_freq[key], spec.interleaved, attention_factor(spec))
            elif spec.mrope_section is None:
                raise ValueError(f"{self.args.model_type}: 3-axis (t, h, w) positions were given, but its RoPE has "
                                 "no mrope_section")
            else:
                out[spec] = mrope_cos_sin(mrope_3BT, self._inv_freq[key], spec.mrope_section, attention_factor(spec))
        return out

    def _embed(self, input_ids_BT, seqs: PackedSeqs, pixel_values_NP, image_grid_thw_I3, mrope_3BT):
        """Token embeddings with the images' features at their image tokens, and the 3-axis
        positions (computed when images come without them)."""
        x_BTD = self.embed_tokens(input_ids_BT)
        if self.args.embed_scale != 1.0:
            x_BTD = x_BTD * self.args.embed_scale
        b, t = input_ids_BT.shape
        if mrope_3BT is not None and tuple(mrope_3BT.shape) != (3, b, t):
            raise ValueError(f"mrope_positions has shape {tuple(mrope_3BT.shape)}, expected [3, {b}, {t}] (t, h, w "
                             "positions of every token)")
        if (pixel_values_NP is None) != (image_grid_thw_I3 is None):
            raise ValueError("pixel_values and image_grid_thw come together (the patches and each image's grid)")
        if pixel_values_NP is None:
            return x_BTD, mrope_3BT
        if self.visual is None:
            raise ValueError(f"{self.args.model_type}: pixel_values given, but the model has no vision tower "
                             "(its config.json has no vision_config)")
        spec = self.args.vision
        x_BTD = scatter_images(x_BTD, input_ids_BT, self.visual(pixel_values_NP, image_grid_thw_I3), spec)
        if mrope_3BT is None:
            mrope_3BT = mrope_positions(input_ids_BT, seqs, image_grid_thw_I3, spec)
        return x_BTD, mrope_3BT

    def forward(
        self,
        input_ids_BT: torch.Tensor,
        position_ids_BT: torch.Tensor,
        targets_BT: torch.Tensor | None = None,
        temperatures_BT: torch.Tensor | None = None,
        chunk_size: int = 4096,
        seqs: PackedSeqs | None = None,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        mrope_positions: torch.Tensor | None = None,
    ):
        """Final hidden states [B, T, D] of packed rows (positions restart at each document).

        With `targets`, returns (logprobs, entropy) [B, T] of the targets instead, computed
        inside the forward by the chunked path (no full logits; and under FSDP the output
        weight is only gathered inside the forward): logprobs[b, t] = log p(targets[b, t] |
        tokens <= t) at temperatures[b, t] (default 1).

        `seqs`: the document boundaries, when the rows given are chunks of longer rows (context
        parallelism: the boundaries of the whole rows, and an attention back-end that sees them
        whole); by default they come from `position_ids`.

        Images (vision-language models, vision.py): `pixel_values` [patches, C * Tp * P * P]
        and `image_grid_thw` [images, 3] of every image in the rows, in order; their features
        replace the image tokens' embeddings. `mrope_positions` [3, B, T]: the (t, h, w)
        positions of the multi-axis RoPE; computed from the image tokens and grids when images
        come without them. `position_ids` stay each token's index in its document (they mark
        the documents).
        """
        if seqs is None:
            seqs = PackedSeqs.from_position_ids(position_ids_BT)
        x_BTD, mrope_3BT = self._embed(input_ids_BT, seqs, pixel_values, image_grid_thw, mrope_positions)
        ropes = self._ropes(position_ids_BT, mrope_3BT)
        ropes[None] = (None, None)  # layers without positions
        for layer in self.layers:  # host-side layouts a mixer needs (host syncs), outside the compiled layers
            if hasattr(layer.mixer, "prepare"):
                layer.mixer.prepare(seqs, x_BTD.device)
        for layer in self.layers:
            x_BTD = layer(x_BTD, *ropes[getattr(layer.spec.mixer, "rope", None)], seqs, self.attn_backend)
        hidden_BTD = self.norm(x_BTD)
        if targets_BT is None:
            return hidden_BTD
        b, t, d = hidden_BTD.shape
        temps_N = 1.0 if temperatures_BT is None else temperatures_BT.reshape(-1)
        logprobs_N, entropy_N = chunked_logprobs(
            hidden_BTD.reshape(b * t, d), self.output_weight, targets_BT.reshape(-1), temps_N, chunk_size,
            keep_logits=self.keep_logits,
        )
        # Fresh tensors, not views: FSDP2 hooks a module's outputs for its backward.
        return logprobs_N.reshape(b, t).clone(), entropy_N.reshape(b, t).clone()

    def logits(self, input_ids_BT: torch.Tensor, position_ids_BT: torch.Tensor, **images) -> torch.Tensor:
        """Full logits [B, T, V]: for tests and small models; training uses logprobs.py.
        `images`: pixel_values, image_grid_thw, mrope_positions, as `forward` takes them."""
        hidden_BTD = self(input_ids_BT, position_ids_BT, **images)
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
        for m in self.modules():
            if isinstance(m, RMSNorm) and m.zero_centered:
                m.weight.zero_()
            elif isinstance(m, nn.LayerNorm):  # the vision tower's
                m.weight.fill_(1.0)
        for name, buf in self.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.zero_()
        self.reset_moe_stats()

    def cast_parameters(self, dtype: torch.dtype) -> Transformer:
        """Parameters to `dtype`; buffers keep theirs (router correction biases stay fp32)."""
        for p in self.parameters():
            p.data = p.data.to(dtype)
        return self

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
