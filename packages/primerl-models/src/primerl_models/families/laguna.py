"""Poolside Laguna (`laguna`).

Attention: per-head qk-norm, a softplus output gate before o_proj (`self_attn.g_proj`, no bias:
one value per head when `gating` is True or "per-head", else one per element), a head count of
its own for each layer (`num_attention_heads_per_layer`), and RoPE by layer type:
`rope_parameters` holds one setting per type ("full_attention", "sliding_attention"), each
with its theta and partial rotary factor (the first part of each head rotates, halves layout);
"sliding_attention" layers see a `sliding_window`. MLP by `mlp_layer_types` ("dense" or
"sparse", by default the first dense): experts with a sigmoid router, optionally soft-capped
(`moe_router_logit_softcapping`: cap * tanh(logits / cap)), an fp32 correction bias that only
chooses, the chosen scores renormalised and scaled by `moe_routed_scaling_factor`, and a
shared expert of `shared_expert_intermediate_size`.

Checkpoint: per-expert names; the router `mlp.gate` with `mlp.experts.e_score_correction_bias`,
the shared expert `mlp.shared_expert`, the gate `self_attn.g_proj` (the released layout, which
transformers converts on load and writes back on save).
"""

from primerl_models.args import Attention, DenseMLP, Layer, ModelArgs, Rope
from primerl_models.families.base import (
    ATTENTION_KINDS,
    Family,
    TinyShape,
    head_dim,
    layer_kinds,
    model_args,
    moe_from_hf,
    shared_expert_from_hf,
    tiny_common,
    unsupported,
)
from primerl_models.families.checkpoint import Checkpoint


def _rope(cfg: dict, layer_type: str, k: int) -> Rope | None:
    params = (cfg.get("rope_parameters") or {}).get(layer_type)
    if params is None:
        return None  # transformers gives such layers no rotary embedding either
    if params.get("rope_type", "default") != "default":
        unsupported(
            cfg, "rope_parameters", f"rope_type 'default' only, got {params.get('rope_type')!r} for {layer_type}"
        )
    return Rope(
        rotary_dim=int(k * float(params.get("partial_rotary_factor", 1.0))),
        theta=float(params.get("rope_theta", 10000.0)),
    )


def args_from_hf(cfg: dict) -> ModelArgs:
    n = cfg["num_hidden_layers"]
    if cfg.get("moe_apply_router_weight_on_input"):
        unsupported(cfg, "moe_apply_router_weight_on_input", "False only, as transformers")
    layer_types = layer_kinds(cfg, "layer_types", ATTENTION_KINDS, ["full_attention"] * n)
    mlp_types = layer_kinds(cfg, "mlp_layer_types", ("dense", "sparse"), ["dense"] + ["sparse"] * (n - 1))
    heads = cfg.get("num_attention_heads_per_layer") or [cfg["num_attention_heads"]] * n
    if len(heads) != n:
        unsupported(cfg, "num_attention_heads_per_layer", f"{n} head counts")
    k, bias = head_dim(cfg), bool(cfg.get("attention_bias", False))
    gating = cfg.get("gating", True)
    ropes = {t: _rope(cfg, t, k) for t in set(layer_types)}
    moe = moe_from_hf(
        cfg,
        scoring="sigmoid",
        norm_topk_prob=True,
        correction_bias=True,
        scaling=float(cfg.get("moe_routed_scaling_factor", 1.0)),
        logit_softcap=float(cfg.get("moe_router_logit_softcapping") or 0.0),
        shared=shared_expert_from_hf(cfg, count_key=None, size_key="shared_expert_intermediate_size"),
    )
    dense = DenseMLP(cfg["intermediate_size"])
    layers = []
    for t, mlp_type, h in zip(layer_types, mlp_types, heads):
        attn = Attention(
            num_heads=h,
            num_kv_heads=cfg["num_key_value_heads"],
            head_dim=k,
            rope=ropes[t],
            qkv_bias=bias,
            o_bias=bias,
            qk_norm="head",
            gate="softplus",
            gate_per_head=gating is True or gating == "per-head",
            window=(cfg.get("sliding_window") or None) if t == "sliding_attention" else None,
        )
        layers.append(Layer(attn, moe if mlp_type == "sparse" else dense))
    return model_args(cfg, layers)


def tiny_config(shape: TinyShape) -> dict:
    n = shape.num_layers
    cfg = tiny_common(
        shape,
        "laguna",
        "LagunaForCausalLM",
        num_experts=shape.num_experts,
        num_experts_per_tok=shape.num_experts_per_tok,
        moe_intermediate_size=shape.moe_intermediate_size,
        shared_expert_intermediate_size=shape.moe_intermediate_size,
        sliding_window=8,
        gating=True,
        moe_routed_scaling_factor=1.0,
        moe_router_logit_softcapping=0.0,
        layer_types=["full_attention" if i % 2 == 0 else "sliding_attention" for i in range(n)],
        mlp_layer_types=["dense"] + ["sparse"] * (n - 1),
        num_attention_heads_per_layer=[shape.num_heads] * n,
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 500000.0, "partial_rotary_factor": 0.5},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0},
        },
    )
    del cfg["rope_theta"]  # per layer type, in rope_parameters
    return cfg


LAGUNA = Family(
    "laguna",
    "LagunaForCausalLM",
    args_from_hf,
    tiny_config,
    Checkpoint(
        renames=(
            (".mlp.experts.e_score_correction_bias", ".mlp.router.e_score_correction_bias"),
            (".mlp.shared_expert.", ".mlp.shared_experts."),
            (".self_attn.g_proj.", ".self_attn.gate_proj."),
            (".mlp.gate.", ".mlp.router."),
        )
    ),
)
