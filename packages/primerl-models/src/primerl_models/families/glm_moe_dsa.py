"""GLM-5 (`glm_moe_dsa`): GLM-4.5's mixture of experts under Multi-head Latent Attention with
DeepSeek Sparse Attention (blocks/mla.py).

Attention: MLA (q through the `q_lora_rank` latent, keys and values from the `kv_lora_rank`
latent plus a shared RoPE part of `qk_rope_head_dim`, interleaved pairs), scale
1 / sqrt(qk_nope_head_dim + qk_rope_head_dim) times YaRN's mscale(factor, mscale_all_dim)^2
when the RoPE is scaled; each query attends to the `index_topk` keys its DSA indexer
(`index_n_heads` heads of `index_head_dim`) scores highest. `indexer_types` (or, as transformers
derives it, `index_topk_pattern`, `index_topk_freq` / `index_skip_topk_offset`): "full" layers run
their indexer, "shared" ones reuse the selection of the last full layer before them.
MLP: dense by `mlp_layer_types` (default: the first `first_k_dense_replace`), the others GLM-4.5's
experts (sigmoid router, fp32 `e_score_correction_bias` choosing only, groups, renormalised top-k,
`routed_scaling_factor`, `n_shared_experts` shared expert). The MTP layers
(`num_nextn_predict_layers`, layers num_hidden_layers and up) are carried through untrained.
"""

import math
from dataclasses import replace

from primerl_models.args import MLA, DenseMLP, DSAIndexer, Layer, ModelArgs, Rope
from primerl_models.families.base import (
    Family,
    TinyShape,
    layer_kinds,
    model_args,
    moe_from_hf,
    rope_settings,
    shared_expert_from_hf,
    tiny_common,
    unsupported,
)
from primerl_models.families.checkpoint import Checkpoint
from primerl_models.families.glm4_moe import mtp_layers

INDEXER_KINDS = ("full", "shared")


def _mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def softmax_scale(cfg: dict, qk_head_dim: int) -> float:
    """1 / sqrt(qk_head_dim), times mscale(factor, mscale_all_dim)^2 when the RoPE is scaled and
    the config gives mscale_all_dim (DeepSeek's YaRN)."""
    scale = qk_head_dim**-0.5
    _, scaling = rope_settings(cfg)
    if scaling is not None and scaling.get("mscale_all_dim"):
        scale *= _mscale(scaling["factor"], scaling["mscale_all_dim"]) ** 2
    return scale


def indexer_kinds(cfg: dict) -> list[str]:
    """Per layer "full" or "shared": `indexer_types`, else what transformers derives from
    `index_topk_pattern` ("F"/"S" per layer) or `index_topk_freq` and `index_skip_topk_offset`."""
    n = cfg["num_hidden_layers"]
    if cfg.get("indexer_types") is None:
        pattern = cfg.get("index_topk_pattern")
        if pattern is not None:
            kinds = [{"F": "full", "S": "shared"}.get(c, c) for c in pattern] if isinstance(pattern, str) else pattern
        else:
            freq, offset = max(cfg.get("index_topk_freq", 1), 1), cfg.get("index_skip_topk_offset", 2)
            kinds = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n)]
        cfg = {**cfg, "indexer_types": list(kinds)}
    kinds = layer_kinds(cfg, "indexer_types", INDEXER_KINDS, [])
    if kinds[0] != "full":
        unsupported(cfg, "indexer_types", "the first layer must run its indexer ('full')")
    return kinds


def args_from_hf(cfg: dict) -> ModelArgs:
    n, heads = cfg["num_hidden_layers"], cfg["num_attention_heads"]
    if cfg.get("num_key_value_heads") not in (None, heads):
        unsupported(cfg, "num_key_value_heads", f"MLA expands its latent to all {heads} heads")
    layer_kinds(cfg, "layer_types", ("indexed_attention",), ["indexed_attention"] * n)
    if cfg.get("q_lora_rank") is None:
        unsupported(cfg, "q_lora_rank", "the DSA indexer reads the query latent")
    theta, scaling = rope_settings(cfg)
    rope_dim = cfg["qk_rope_head_dim"]
    rope = Rope(rotary_dim=rope_dim, theta=theta, scaling=scaling, interleaved=True)
    indexer = DSAIndexer(num_heads=cfg["index_n_heads"], head_dim=cfg["index_head_dim"], topk=cfg["index_topk"])
    base = MLA(
        num_heads=heads,
        q_lora_rank=cfg["q_lora_rank"],
        kv_lora_rank=cfg["kv_lora_rank"],
        qk_nope_head_dim=cfg["qk_nope_head_dim"],
        qk_rope_head_dim=rope_dim,
        v_head_dim=cfg["v_head_dim"],
        rope=rope,
        softmax_scale=softmax_scale(cfg, cfg["qk_nope_head_dim"] + rope_dim),
        bias=bool(cfg.get("attention_bias", False)),
    )
    moe = moe_from_hf(
        cfg,
        norm_topk_default=True,
        scoring="sigmoid",
        correction_bias=True,
        shared=shared_expert_from_hf(cfg, count_key="n_shared_experts"),
    )
    dense = DenseMLP(cfg["intermediate_size"])
    first_dense = min(cfg.get("first_k_dense_replace", 3), n)
    mlps = layer_kinds(
        cfg, "mlp_layer_types", ("dense", "sparse"), ["dense"] * first_dense + ["sparse"] * (n - first_dense)
    )
    layers, slot = [], 0
    attns: dict[int, MLA] = {}  # one spec per selection: the full layer's, and its sharers'
    for i, (kind, mlp) in enumerate(zip(indexer_kinds(cfg), mlps)):
        if kind == "full":
            slot = i
            attn = replace(base, indexer=indexer, topk_slot=slot)
        else:
            attn = attns.setdefault(slot, replace(base, reuse_topk=True, topk_slot=slot, reused_topk=indexer.topk))
        layers.append(Layer(attn, moe if mlp == "sparse" else dense))
    return model_args(cfg, layers)


def tiny_config(shape: TinyShape) -> dict:
    """MLA (nope = v = head_dim, rope half of it), an indexer choosing 4 keys (so that the
    selection decides the result of any prompt longer than 4 tokens) with 16 heads (with few,
    equal scores at the top-k boundary are common, and transformers' torch.topk breaks them
    its own way: blocks/mla.py), the first layer dense."""
    rope = shape.head_dim // 2
    return tiny_common(
        shape,
        "glm_moe_dsa",
        "GlmMoeDsaForCausalLM",
        num_key_value_heads=shape.num_heads,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        q_lora_rank=shape.hidden_size // 2,
        kv_lora_rank=shape.hidden_size // 4,
        qk_nope_head_dim=shape.head_dim,
        qk_rope_head_dim=rope,
        v_head_dim=shape.head_dim,
        index_n_heads=16,
        index_head_dim=2 * rope,
        index_topk=4,
        indexer_types=["full"] * shape.num_layers,
        attention_bias=False,
        n_routed_experts=shape.num_experts,
        num_experts_per_tok=shape.num_experts_per_tok,
        moe_intermediate_size=shape.moe_intermediate_size,
        n_shared_experts=1,
        first_k_dense_replace=1,
        mlp_layer_types=["dense"] + ["sparse"] * (shape.num_layers - 1),
        n_group=1,
        topk_group=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        num_nextn_predict_layers=0,
    )


GLM_MOE_DSA = Family("glm_moe_dsa", "GlmMoeDsaForCausalLM", args_from_hf, tiny_config, Checkpoint(carried=mtp_layers))
