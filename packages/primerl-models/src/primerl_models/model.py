"""The decoder-only transformer every family is made of, built layer by layer from ModelArgs
(args.py): each layer's mixer and MLP as its spec says, from the blocks in blocks/ (MIXERS, MLPS). No
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

from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn

from primerl_models.args import MLA, Attention, DenseMLP, GatedDeltaNet, Layer, Mamba2, ModelArgs, MoEMLP, Rope
from primerl_models.blocks.attention import Backend, SelfAttention
from primerl_models.blocks.gated_deltanet import GatedDeltaNetMixer
from primerl_models.blocks.mamba2 import Mamba2Mixer
from primerl_models.blocks.mixer import Mixer
from primerl_models.blocks.mla import MLAttention
from primerl_models.blocks.mlp import dense_mlp
from primerl_models.blocks.moe import MoE
from primerl_models.blocks.norms import RMSNorm
from primerl_models.blocks.rope import attention_factor, inv_freq, mrope_cos_sin, rope_cos_sin
from primerl_models.blocks.vision import VisionTower, mrope_positions, scatter_images
from primerl_models.logprobs import TokenTerms, chunked_logprobs, chunked_token_loss
from primerl_models.packing import PackedSeqs

MIXERS: dict[type, tuple[str, Callable[..., Mixer]]] = {
    Attention: ("self_attn", SelfAttention),
    MLA: ("self_attn", MLAttention),
    GatedDeltaNet: ("linear_attn", lambda spec, dim, eps, zero_centered: GatedDeltaNetMixer(spec, dim, eps)),
    Mamba2: ("mamba", lambda spec, dim, eps, zero_centered: Mamba2Mixer(spec, dim, eps)),
}
"""Each mixer spec (args.py) -> the name of its module in a layer (Hugging Face's, so that
checkpoints convert by renames) and its builder (spec, dim, eps, zero_centered). A new kind of
mixer is a spec, a `Mixer` (blocks/mixer.py) and a row here."""

MLPS: dict[type, Callable[[int, Any], nn.Module]] = {
    DenseMLP: lambda dim, spec: dense_mlp(dim, spec.intermediate_size, spec.activation),
    MoEMLP: lambda dim, spec: MoE(dim, spec),
}
"""Each MLP spec -> its builder (dim, spec), which takes a spec of its key's type; the module is a
layer's `mlp`."""


def mixer_name(spec) -> str:
    """The module name of a mixer spec's block in a layer (`self_attn`, `linear_attn`, `mamba`)."""
    if type(spec) not in MIXERS:
        raise TypeError(f"{type(spec).__name__} is not a mixer spec (one of {', '.join(t.__name__ for t in MIXERS)})")
    return MIXERS[type(spec)][0]


class DecoderLayer(nn.Module):
    """Pre-norm mixer and MLP as its `Layer` spec says (args.py); with sandwich norms, their
    outputs are normalised again before the residual adds (GLM-4's post_*_layernorm). The mixer
    is built and named as MIXERS says (`self_attn`, `linear_attn`, `mamba`: HF's names)."""

    def __init__(self, spec: Layer, dim: int, eps: float, zero_centered: bool = False):
        super().__init__()
        self.spec = spec
        self.mixer_name: str | None = None
        if spec.mixer is not None:
            self.input_layernorm = RMSNorm(dim, eps, zero_centered)
            self.mixer_name = mixer_name(spec.mixer)
            self.add_module(self.mixer_name, MIXERS[type(spec.mixer)][1](spec.mixer, dim, eps, zero_centered))
            if spec.sandwich_norm:
                self.post_self_attn_layernorm = RMSNorm(dim, eps, zero_centered)
        if spec.mlp is not None:
            self.post_attention_layernorm = RMSNorm(dim, eps, zero_centered)
            self.mlp: nn.Module = MLPS[type(spec.mlp)](dim, spec.mlp)
            if spec.sandwich_norm:
                self.post_mlp_layernorm = RMSNorm(dim, eps, zero_centered)

    @property
    def mixer(self) -> Mixer | None:
        return None if self.mixer_name is None else getattr(self, self.mixer_name)

    def forward(self, x_BTD, cos_BTR, sin_BTR, seqs: PackedSeqs, backend: Backend) -> torch.Tensor:
        mixer = self.mixer
        if mixer is not None:
            mixed = mixer(self.input_layernorm(x_BTD), cos_BTR, sin_BTR, seqs, backend)
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
        layers = [DecoderLayer(spec, args.hidden_size, args.rms_norm_eps, zero_centered) for spec in args.layers]
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, zero_centered)
        self.lm_head = None if args.tie_embeddings else nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.visual = None if args.vision is None else VisionTower(args.vision)
        if self.visual is not None:  # frozen unless asked (args.freeze_vision)
            self.visual.requires_grad_(not args.freeze_vision)
        self._rope_specs = list(
            dict.fromkeys(
                layer.mixer.rope for layer in layers if layer.mixer is not None and layer.mixer.rope is not None
            )
        )
        self._inv_freq: dict[tuple[Rope, torch.device], torch.Tensor] = {}

    @property
    def decoder_layers(self) -> list[DecoderLayer]:
        """`layers`, typed: the DecoderLayers built here (parallelism and checkpointing change
        them in place)."""
        # cast: nn.ModuleList yields plain Modules to the type checker
        return cast("list[DecoderLayer]", list(self.layers))

    @property
    def output_weight(self) -> torch.Tensor:
        """[V, D]: the lm_head weight, or the embedding when they are tied."""
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def _ropes(
        self, position_ids_BT: torch.Tensor, mrope_3BT: torch.Tensor | None = None
    ) -> dict[Rope | None, tuple[torch.Tensor | None, torch.Tensor | None]]:
        """cos, sin of each distinct RoPE of the layers (most models have one), from the 1-D
        positions or, when given, the (t, h, w) ones; (None, None) for the layers without
        positions (key None)."""
        out: dict[Rope | None, tuple[torch.Tensor | None, torch.Tensor | None]] = {}
        for spec in self._rope_specs:
            key = (spec, position_ids_BT.device)
            if key not in self._inv_freq:
                self._inv_freq[key] = inv_freq(spec).to(position_ids_BT.device)
            if mrope_3BT is None:
                out[spec] = rope_cos_sin(position_ids_BT, self._inv_freq[key], spec.interleaved, attention_factor(spec))
            elif spec.mrope_section is None:
                raise ValueError(
                    f"{self.args.model_type}: 3-axis (t, h, w) positions were given, but its RoPE has no mrope_section"
                )
            else:
                out[spec] = mrope_cos_sin(mrope_3BT, self._inv_freq[key], spec.mrope_section, attention_factor(spec))
        out[None] = (None, None)  # layers without positions
        return out

    def _embed(self, input_ids_BT, seqs: PackedSeqs, pixel_values_NP, image_grid_thw_I3, mrope_3BT):
        """Token embeddings with the images' features at their image tokens, and the 3-axis
        positions (computed when images come without them)."""
        x_BTD = self.embed_tokens(input_ids_BT)
        if self.args.embed_scale != 1.0:
            x_BTD = x_BTD * self.args.embed_scale
        b, t = input_ids_BT.shape
        if mrope_3BT is not None and tuple(mrope_3BT.shape) != (3, b, t):
            raise ValueError(
                f"mrope_positions has shape {tuple(mrope_3BT.shape)}, expected [3, {b}, {t}] (t, h, w "
                "positions of every token)"
            )
        if (pixel_values_NP is None) != (image_grid_thw_I3 is None):
            raise ValueError("pixel_values and image_grid_thw come together (the patches and each image's grid)")
        if pixel_values_NP is None:
            return x_BTD, mrope_3BT
        spec = self.args.vision
        if self.visual is None or spec is None:  # both or neither (built from args.vision)
            raise ValueError(
                f"{self.args.model_type}: pixel_values given, but the model has no vision tower "
                "(its config.json has no vision_config)"
            )
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
        sources_BT: torch.Tensor | None = None,
        loss_terms: TokenTerms | None = None,
    ):
        """Final hidden states [B, T, D] of packed rows (positions restart at each document).

        With `targets`, returns (logprobs, entropy) [B, T] of the targets instead, computed
        inside the forward by the chunked path (no full logits; and under FSDP the output
        weight is only gathered inside the forward): logprobs[b, t] = log p(targets[b, t] |
        tokens <= t) at temperatures[b, t] (default 1). With `loss_terms` as well, returns
        (loss, logprobs, entropy): the loss is the sum of `loss_terms(logprobs_C, s, e)` over
        the flattened [B * T] tokens, its gradients computed inside the forward
        (logprobs.chunked_token_loss: token-local losses only), logprobs and entropy detached.

        `seqs`: the document boundaries, when the rows given are chunks of longer rows (context
        parallelism: the boundaries of the whole rows, and an attention back-end that sees them
        whole) or when documents share a prompt (PackedSeqs.from_segments: then `position_ids`
        continue from the prompt, and this model's mixers must all be attention); by default
        they come from `position_ids`.

        `sources_BT` (int64 [B, T'], with `targets` [B, T']): the position in its row whose hidden
        state predicts each target (default: the target's own position t). With shared prompts
        the prompt's last token predicts the first token of every completion that shares it.

        Images (vision-language models, vision.py): `pixel_values` [patches, C * Tp * P * P]
        and `image_grid_thw` [images, 3] of every image in the rows, in order; their features
        replace the image tokens' embeddings. `mrope_positions` [3, B, T]: the (t, h, w)
        positions of the multi-axis RoPE; computed from the image tokens and grids when images
        come without them. `position_ids` stay each token's index in its document (they mark
        the documents).
        """
        if seqs is None:
            seqs = PackedSeqs.from_position_ids(position_ids_BT)
        elif seqs.branched:
            images = (
                "the rows hold images (their positions restart at each document)" if pixel_values is not None else None
            )
            if problem := self.args.prompt_sharing_problem() or images:
                raise ValueError(f"rows whose documents share a prompt cannot be computed exactly: {problem}")
        x_BTD, mrope_3BT = self._embed(input_ids_BT, seqs, pixel_values, image_grid_thw, mrope_positions)
        ropes = self._ropes(position_ids_BT, mrope_3BT)
        mixers = [layer.mixer for layer in self.decoder_layers]
        for mixer in mixers:  # host-side layouts a mixer needs (host syncs), outside the compiled layers
            if mixer is not None:
                mixer.prepare(seqs, x_BTD.device)
        for layer, mixer in zip(self.layers, mixers):
            x_BTD = layer(x_BTD, *ropes[None if mixer is None else mixer.rope], seqs, self.attn_backend)
        hidden_BTD = self.norm(x_BTD)
        if targets_BT is None:
            return hidden_BTD
        if sources_BT is not None:
            if sources_BT.shape != targets_BT.shape:
                raise ValueError(f"sources {tuple(sources_BT.shape)} and targets {tuple(targets_BT.shape)} differ")
            d = hidden_BTD.shape[-1]
            hidden_BTD = hidden_BTD.gather(1, sources_BT[..., None].expand(-1, -1, d))
        b, t, d = hidden_BTD.shape
        temps_N = 1.0 if temperatures_BT is None else temperatures_BT.reshape(-1)
        if loss_terms is not None:
            loss, logprobs_N, entropy_N = chunked_token_loss(
                hidden_BTD.reshape(b * t, d),
                self.output_weight,
                targets_BT.reshape(-1),
                loss_terms,
                temps_N,
                chunk_size,
            )
            return loss.clone(), logprobs_N.reshape(b, t), entropy_N.reshape(b, t)
        logprobs_N, entropy_N = chunked_logprobs(
            hidden_BTD.reshape(b * t, d),
            self.output_weight,
            targets_BT.reshape(-1),
            temps_N,
            chunk_size,
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
