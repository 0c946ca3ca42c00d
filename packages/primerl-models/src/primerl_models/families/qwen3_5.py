"""Qwen3.5 (`qwen3_5`, dense) and Qwen3.5-MoE (`qwen3_5_moe`): Gated DeltaNet layers mixed with
gated full-attention layers (by `layer_types`, by default every `full_attention_interval`-th
layer full, 3:1).

Full attention: per-head qk-norm, partial RoPE (`partial_rotary_factor`, 0.25), and an
element-wise sigmoid output gate that the checkpoint keeps inside q_proj: its rows are, per
head, the head's query then its gate ([H, 2, K, D]); ours are q_proj and gate_proj. Text
positions are 1-D; with images, 3-axis (t, h, w) ones turn the frequencies interleaved by
`mrope_section` (default [11, 11, 10]; interleaved whatever `mrope_interleaved` says, as in
transformers' Qwen3.5). Linear attention: see common/linear_attention.py. Every RMSNorm outside the DeltaNet is zero-centred (1 + weight).
MoE: a softmax router whose top-k weights are renormalised, stacked experts, and a shared
expert scaled by sigmoid(`shared_expert_gate`).

The released checkpoints are vision-language models (`model_type` "qwen3_5" / "qwen3_5_moe",
`Qwen3_5*ForConditionalGeneration`): the text model's keys are in `text_config` and its tensors
under `model.language_model.`; the vision tower's keys are in `vision_config` and its tensors
under `model.visual.` (ours: `visual.`, common/vision.py; frozen unless ModelArgs.freeze_vision
is False). The multi-token prediction layers (`mtp.`) are carried through unchanged (hf.py). Text-only checkpoints
("qwen3_5_text" / "qwen3_5_moe_text", `Qwen3_5*ForCausalLM`, transformers' and vLLM's text
classes) keep the usual `model.` names.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Literal

import torch

from primerl_models.args import DenseMLP, GatedDeltaNet, Layer, ModelArgs, Vision
from primerl_models.families.base import (
    Family,
    TinyShape,
    attention_from_hf,
    layer_kinds,
    model_args,
    moe_from_hf,
    shared_expert_from_hf,
    tiny_common,
    unsupported,
)
from primerl_models.families.checkpoint import Checkpoint

KINDS = ("linear_attention", "full_attention")
_HF_Q = re.compile(r"^(layers\.\d+\.self_attn\.)q_proj\.weight$")
_OUR_GATE = re.compile(r"^(layers\.\d+\.self_attn\.)gate_proj\.weight$")
_LM = "model.language_model."
_HF_VISUAL, _OUR_VISUAL = "model.visual.", "visual."
_ACTIVATIONS: dict[str, Literal["gelu_tanh", "gelu"]] = {"gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}


def text_config(cfg: dict) -> dict:
    """The text model's keys: the nested `text_config` of the released (VLM) configs, under the
    outer model_type, or the config itself."""
    if "text_config" not in cfg:
        return cfg
    text = dict(cfg["text_config"])
    text["model_type"] = cfg["model_type"]
    if "tie_word_embeddings" in cfg:
        text["tie_word_embeddings"] = cfg["tie_word_embeddings"]
    return text


def args_from_hf(cfg: dict) -> ModelArgs:
    text = text_config(cfg)
    if text.get("attention_bias"):
        unsupported(text, "attention_bias", "no released Qwen3.5 has attention biases")
    every = text.get("full_attention_interval") or 4
    default = ["linear_attention" if (i + 1) % every else "full_attention" for i in range(text["num_hidden_layers"])]
    kinds = layer_kinds(text, "layer_types", KINDS, default)
    full = attention_from_hf(text, partial_default=0.25, qk_norm="head", gate="sigmoid")
    section = (text.get("rope_parameters") or {}).get("mrope_section") or (11, 11, 10)
    assert full.rope is not None, "attention_from_hf gives every attention a RoPE"
    full = replace(full, rope=replace(full.rope, mrope_section=tuple(section)))
    linear = GatedDeltaNet(
        num_k_heads=text["linear_num_key_heads"],
        num_v_heads=text["linear_num_value_heads"],
        head_k_dim=text["linear_key_head_dim"],
        head_v_dim=text["linear_value_head_dim"],
        conv_kernel=text.get("linear_conv_kernel_dim", 4),
    )
    if text.get("num_experts"):
        mlp = moe_from_hf(
            text,
            scoring="softmax",
            norm_topk_prob=True,
            shared=shared_expert_from_hf(text, count_key=None, size_key="shared_expert_intermediate_size", gate=True),
        )
    else:
        mlp = DenseMLP(text["intermediate_size"])
    mixer = {"linear_attention": linear, "full_attention": full}
    args = model_args(text, [Layer(mixer[k], mlp) for k in kinds])
    args.zero_centered_norms = True
    if cfg.get("vision_config"):
        args.vision = vision_from_hf(cfg, text["hidden_size"])
    return args


def vision_from_hf(cfg: dict, text_hidden: int) -> Vision:
    """The vision tower of a released (VLM) config: `vision_config`, and the image token id."""
    v = {**cfg["vision_config"], "model_type": cfg["model_type"] + ".vision_config"}
    if v.get("deepstack_visual_indexes"):
        unsupported(v, "deepstack_visual_indexes", "Qwen3.5's tower has no deepstack layers")
    if v.get("hidden_act", "gelu_pytorch_tanh") not in _ACTIVATIONS:
        unsupported(v, "hidden_act", f"one of {', '.join(_ACTIVATIONS)}")
    for key in ("patch_size", "temporal_patch_size"):
        if not isinstance(v.get(key, 2), int):
            unsupported(v, key, "one integer")
    rope = v.get("rope_parameters") or {}
    if rope.get("rope_type", "axial") != "axial":
        unsupported(v, "rope_parameters", "the axial 2-D RoPE")
    if v.get("out_hidden_size", text_hidden) != text_hidden:
        raise ValueError(
            f"{cfg['model_type']}: vision_config.out_hidden_size ({v['out_hidden_size']}) is not the "
            f"text model's hidden_size ({text_hidden})"
        )
    return Vision(
        depth=v.get("depth", 27),
        hidden_size=v.get("hidden_size", 1152),
        intermediate_size=v.get("intermediate_size", 4304),
        num_heads=v.get("num_heads", 16),
        out_hidden_size=text_hidden,
        image_token_id=cfg.get("image_token_id", 248056),
        patch_size=v.get("patch_size", 16),
        temporal_patch_size=v.get("temporal_patch_size", 2),
        in_channels=v.get("in_channels", 3),
        spatial_merge_size=v.get("spatial_merge_size", 2),
        num_position_embeddings=v.get("num_position_embeddings", 2304),
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        activation=_ACTIVATIONS[v.get("hidden_act", "gelu_pytorch_tanh")],
    )


@dataclass(frozen=True)
class Qwen35Checkpoint(Checkpoint):
    """q_proj split into q and gate (and fused back), and the VLM's `model.language_model.`
    prefix when `nested`."""

    nested: bool = False

    def to_ours(self, hf: dict[str, torch.Tensor], args) -> dict[str, torch.Tensor]:
        visual = {}
        if self.nested:
            visual = {_OUR_VISUAL + k.removeprefix(_HF_VISUAL): t for k, t in hf.items() if k.startswith(_HF_VISUAL)}
            hf = {
                ("model." + k.removeprefix(_LM)) if k.startswith(_LM) else k: t
                for k, t in hf.items()
                if not k.startswith(_HF_VISUAL)
            }
        out = super().to_ours(hf, args)
        out.update(visual)
        for name, match in [(n, m) for n in out if (m := _HF_Q.match(n))]:
            layer = args.layers[int(name.split(".")[1])].mixer
            q_gate = out.pop(name).view(layer.num_heads, 2, layer.head_dim, -1)
            prefix = match[1]
            out[prefix + "q_proj.weight"] = q_gate[:, 0].reshape(layer.num_heads * layer.head_dim, -1).contiguous()
            out[prefix + "gate_proj.weight"] = q_gate[:, 1].reshape(layer.num_heads * layer.head_dim, -1).contiguous()
        return out

    def to_hf(self, ours: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        visual = {
            _HF_VISUAL + k.removeprefix(_OUR_VISUAL): t.contiguous()
            for k, t in ours.items()
            if k.startswith(_OUR_VISUAL)
        }
        ours = {k: t for k, t in ours.items() if not k.startswith(_OUR_VISUAL)}
        for name, match in [(n, m) for n in ours if (m := _OUR_GATE.match(n))]:
            prefix = match[1]
            gate = ours.pop(name)
            q = ours[prefix + "q_proj.weight"]
            head_dim = ours[prefix + "q_norm.weight"].shape[0]
            per_head = [t.view(-1, head_dim, t.shape[-1]) for t in (q, gate)]
            ours[prefix + "q_proj.weight"] = torch.stack(per_head, dim=1).reshape(-1, q.shape[-1])
        out = super().to_hf(ours)
        if self.nested:
            out = {(_LM + k.removeprefix("model.")) if k.startswith("model.") else k: t for k, t in out.items()}
        return {**out, **visual}


def carried(cfg: dict):
    """The MTP layers (inference may use them, the trainer does not), and vision tensors that
    a config without `vision_config` does not describe."""
    prefixes = ("mtp.",) if cfg.get("vision_config") else ("mtp.", _HF_VISUAL)
    return lambda name: name.startswith(prefixes)


def tiny_text(shape: TinyShape, moe: bool) -> dict:
    model_type, arch = ("qwen3_5_moe_text", "Qwen3_5MoeForCausalLM") if moe else ("qwen3_5_text", "Qwen3_5ForCausalLM")
    layers = shape.num_layers
    extra = (
        dict(
            num_experts=shape.num_experts,
            num_experts_per_tok=shape.num_experts_per_tok,
            moe_intermediate_size=shape.moe_intermediate_size,
            shared_expert_intermediate_size=shape.moe_intermediate_size,
        )
        if moe
        else {}
    )
    cfg = tiny_common(
        shape,
        model_type,
        arch,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=shape.head_dim,
        linear_value_head_dim=shape.head_dim,
        linear_conv_kernel_dim=4,
        attention_bias=False,
        layer_types=["linear_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        **extra,
    )
    del cfg["rope_theta"]  # it is in rope_parameters
    return cfg


def tiny_nested(shape: TinyShape, moe: bool) -> dict:
    """The released layout: the text keys under `text_config` (no vision tower in a tiny one)."""
    text = tiny_text(shape, moe)
    model_type, arch = (
        ("qwen3_5_moe", "Qwen3_5MoeForConditionalGeneration") if moe else ("qwen3_5", "Qwen3_5ForConditionalGeneration")
    )
    return {
        "architectures": [arch],
        "model_type": model_type,
        "tie_word_embeddings": text["tie_word_embeddings"],
        "torch_dtype": text["torch_dtype"],
        "text_config": {**text, "model_type": model_type + "_text"},
    }


_MOE_RENAMES = ((".mlp.shared_expert.", ".mlp.shared_experts."), (".mlp.gate.", ".mlp.router."))
QWEN3_5_TEXT = Family(
    "qwen3_5_text",
    "Qwen3_5ForCausalLM",
    args_from_hf,
    lambda s: tiny_text(s, moe=False),
    Qwen35Checkpoint(nested=False),
)
QWEN3_5 = Family(
    "qwen3_5",
    "Qwen3_5ForConditionalGeneration",
    args_from_hf,
    lambda s: tiny_nested(s, moe=False),
    Qwen35Checkpoint(nested=True, carried=carried),
)
QWEN3_5_MOE_TEXT = Family(
    "qwen3_5_moe_text",
    "Qwen3_5MoeForCausalLM",
    args_from_hf,
    lambda s: tiny_text(s, moe=True),
    Qwen35Checkpoint(nested=False, renames=_MOE_RENAMES),
)
QWEN3_5_MOE = Family(
    "qwen3_5_moe",
    "Qwen3_5MoeForConditionalGeneration",
    args_from_hf,
    lambda s: tiny_nested(s, moe=True),
    Qwen35Checkpoint(nested=True, renames=_MOE_RENAMES, carried=carried),
)
