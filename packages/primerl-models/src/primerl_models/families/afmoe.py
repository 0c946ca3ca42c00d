"""Trinity (`afmoe`: Arcee's AFMoE, Trinity-Nano / Mini / Large).

Attention: per-head qk-norm, an element-wise sigmoid output gate (`self_attn.gate_proj`, no
bias) before o_proj, and two kinds of layers by `layer_types` (by default every
`global_attn_every_n_layers`-th layer global): "sliding_attention" layers use RoPE within a
`sliding_window`, "full_attention" (global) layers see the whole document and use no positions
at all. Sandwich norms: the attention's and the MLP's outputs are normalised again before each
residual add. MLP: the first `num_dense_layers` dense, then mixtures of experts with a sigmoid
router whose `expert_bias` only chooses the experts, the chosen scores renormalised and scaled
by `route_scale`, and `num_shared_experts` shared experts (one dense SwiGLU of that many
experts' width). With `mup_enabled` the embeddings are scaled by sqrt(hidden_size).

Checkpoint: per-expert matrices under `mlp.experts.<e>` as most families; the router is
`mlp.router.gate`, its bias `mlp.expert_bias`; the norms are named `post_attention_layernorm`
(after the attention), `pre_mlp_layernorm` and `post_mlp_layernorm`.
"""

from dataclasses import replace
from typing import Any

from primerl_models.args import DenseMLP, Layer, ModelArgs
from primerl_models.families.base import (
    ATTENTION_KINDS,
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


def layer_types(cfg: dict) -> list[str]:
    every = cfg.get("global_attn_every_n_layers") or 4
    default = ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(cfg["num_hidden_layers"])]
    return layer_kinds(cfg, "layer_types", ATTENTION_KINDS, default)


ROUTING = {"score_func": "sigmoid", "route_norm": True, "n_group": 1, "topk_group": 1}
"""Routing keys of the released configs that transformers' AFMoE does not read (it always routes
as these values say) and vLLM does: other values are refused rather than trained one way and
served another."""


def args_from_hf(cfg: dict) -> ModelArgs:
    for key, value in ROUTING.items():
        if cfg.get(key, value) != value:
            unsupported(cfg, key, f"{value!r} only, the routing transformers implements")
    bias = bool(cfg.get("attention_bias", False))
    options: dict[str, Any] = dict(qkv_bias=bias, o_bias=bias, qk_norm="head", gate="sigmoid")  # Attention's fields
    sliding = attention_from_hf(cfg, window=cfg.get("sliding_window") or None, **options)
    full = replace(attention_from_hf(cfg, **options), rope=None)  # global layers: no positions
    moe = moe_from_hf(
        cfg,
        scoring="sigmoid",
        norm_topk_prob=True,
        correction_bias=True,
        scaling=float(cfg.get("route_scale") or 1.0),
        shared=shared_expert_from_hf(cfg, count_key="num_shared_experts"),
    )
    dense_mlp = DenseMLP(cfg["intermediate_size"])
    first_dense = cfg.get("num_dense_layers")
    first_dense = 1 if first_dense is None else first_dense
    attn = {"sliding_attention": sliding, "full_attention": full}
    layers = [
        Layer(attn[t], dense_mlp if i < first_dense else moe, sandwich_norm=True)
        for i, t in enumerate(layer_types(cfg))
    ]
    args = model_args(cfg, layers)
    if cfg.get("mup_enabled"):
        args.embed_scale = cfg["hidden_size"] ** 0.5
    return args


def tiny_config(shape: TinyShape) -> dict:
    layers = shape.num_layers
    cfg = tiny_common(
        shape,
        "afmoe",
        "AfmoeForCausalLM",
        num_experts=shape.num_experts,
        num_experts_per_tok=shape.num_experts_per_tok,
        moe_intermediate_size=shape.moe_intermediate_size,
        num_shared_experts=1,
        num_dense_layers=1,
        route_scale=1.0,
        sliding_window=8,
        global_attn_every_n_layers=2,
        mup_enabled=False,
        attention_bias=False,
        layer_types=["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)],
        **ROUTING,
    )
    return cfg


AFMOE = Family(
    "afmoe",
    "AfmoeForCausalLM",
    args_from_hf,
    tiny_config,
    Checkpoint(
        renames=(
            (".mlp.expert_bias", ".mlp.router.e_score_correction_bias"),
            (".mlp.router.gate.", ".mlp.router."),
            (".post_attention_layernorm.", ".post_self_attn_layernorm."),
            (".pre_mlp_layernorm.", ".post_attention_layernorm."),
        )
    ),
)
