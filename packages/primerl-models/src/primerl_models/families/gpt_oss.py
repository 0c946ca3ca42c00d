"""GPT-OSS (`gpt_oss`: gpt-oss-20b, gpt-oss-120b): every layer a mixture of experts.

Attention: q/k/v/o with biases (`attention_bias`), a learned sink logit per head, a sliding
window (`sliding_window`) on the layers `layer_types` calls "sliding_attention" (by default
every other one, the first included), YaRN RoPE over whole heads (the halves layout). MLP:
a router with a bias whose top-k logits are softmaxed (`num_experts_per_tok` of
`num_local_experts`), experts of `intermediate_size` with biases and the clamped SwiGLU
(`swiglu_limit`, alpha 1.702: down((up + 1) * gate * sigmoid(alpha * gate))).

Checkpoint: the experts are stored stacked, `mlp.experts.gate_up_proj` [E, D, 2F] with the gate
and up columns interleaved (gate at the even ones) and `gate_up_proj_bias` [E, 2F] alike,
`down_proj` [E, F, D], `down_proj_bias` [E, D]; the router is `mlp.router` (weight, bias), the
sinks `self_attn.sinks`. The released checkpoints quantise the experts' matrices to MXFP4
(`gate_up_proj_blocks`, `gate_up_proj_scales`, ...): hf.py dequantises them at load, and the
weights are published in BF16 without the quantization_config.
"""

from __future__ import annotations

import re

import torch

from primerl_models.args import Layer, ModelArgs
from primerl_models.families.base import (
    ATTENTION_KINDS,
    Family,
    TinyShape,
    attention_from_hf,
    layer_kinds,
    model_args,
    moe_from_hf,
    tiny_common,
    unsupported,
)
from primerl_models.families.checkpoint import Checkpoint

_HF_EXPERTS = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(_bias)?$")
_OUR_EXPERTS = re.compile(r"^layers\.(\d+)\.mlp\.experts\.([wb])_(gate|up|down)$")
SWIGLU_ALPHA = 1.702  # fixed in the released code (transformers' and the reference's)


def layer_types(cfg: dict) -> list[str]:
    default = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(cfg["num_hidden_layers"])]
    return layer_kinds(cfg, "layer_types", ATTENTION_KINDS, default)


def args_from_hf(cfg: dict) -> ModelArgs:
    if (quant := cfg.get("quantization_config")) and quant.get("quant_method") != "mxfp4":
        unsupported(cfg, "quantization_config", "BF16 or MXFP4 checkpoints only")
    bias = bool(cfg.get("attention_bias", True))
    full = attention_from_hf(cfg, qkv_bias=bias, o_bias=bias, sinks=True)
    sliding = attention_from_hf(cfg, qkv_bias=bias, o_bias=bias, sinks=True, window=cfg.get("sliding_window") or None)
    moe = moe_from_hf(
        cfg,
        size_key="intermediate_size",
        scoring="softmax_topk",
        bias=True,
        experts=dict(bias=True, activation="clamped", limit=float(cfg.get("swiglu_limit", 7.0)), alpha=SWIGLU_ALPHA),
    )
    by_type = {"full_attention": Layer(full, moe), "sliding_attention": Layer(sliding, moe)}
    return model_args(cfg, [by_type[t] for t in layer_types(cfg)])


class GptOssCheckpoint(Checkpoint):
    """The stacked, interleaved experts both ways; everything else as the common names."""

    def to_ours(self, hf: dict[str, torch.Tensor], args) -> dict[str, torch.Tensor]:
        out, rest = {}, {}
        for name, tensor in hf.items():
            if m := _HF_EXPERTS.match(name):
                kind = "b" if m[3] else "w"
                prefix = f"layers.{m[1]}.mlp.experts.{kind}_"
                if m[2] == "gate_up_proj":  # gate at the even columns, up at the odd ones
                    out[prefix + "gate"] = tensor[..., 0::2].contiguous()
                    out[prefix + "up"] = tensor[..., 1::2].contiguous()
                else:
                    out[prefix + "down"] = tensor
            else:
                rest[name] = tensor
        return {**super().to_ours(rest, args), **out}

    def to_hf(self, ours: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out, rest = {}, {}
        for name, tensor in ours.items():
            if m := _OUR_EXPERTS.match(name):
                suffix = "_bias" if m[2] == "b" else ""
                prefix = f"model.layers.{m[1]}.mlp.experts."
                if m[3] == "gate":
                    up = ours[f"layers.{m[1]}.mlp.experts.{m[2]}_up"]
                    out[prefix + "gate_up_proj" + suffix] = torch.stack([tensor, up], dim=-1).flatten(-2).contiguous()
                elif m[3] == "down":
                    out[prefix + "down_proj" + suffix] = tensor.contiguous()
            else:
                rest[name] = tensor
        return {**super().to_hf(rest), **out}


def tiny_config(shape: TinyShape) -> dict:
    layers = shape.num_layers
    cfg = tiny_common(
        shape,
        "gpt_oss",
        "GptOssForCausalLM",
        intermediate_size=shape.moe_intermediate_size,
        num_local_experts=shape.num_experts,
        num_experts_per_tok=shape.num_experts_per_tok,
        sliding_window=8,
        layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
        attention_bias=True,
        swiglu_limit=7.0,
        rms_norm_eps=1e-5,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
        },
    )
    del cfg["rope_theta"]  # it is in rope_parameters
    return cfg


GPT_OSS = Family("gpt_oss", "GptOssForCausalLM", args_from_hf, tiny_config, GptOssCheckpoint(renames=()))
