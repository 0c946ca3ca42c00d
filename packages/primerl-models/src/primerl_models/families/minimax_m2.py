"""MiniMax-M2 (`minimax_m2`): every layer a mixture of experts.

Attention: RMSNorm of q and k over the whole projection (all heads at once, `qk_norm_type`
"per_layer"), partial RoPE (`rotary_dim` of each head, the halves layout), no biases. MLP: a
sigmoid router with an fp32 `e_score_correction_bias` that only chooses the experts, the
chosen weights renormalised; experts of `intermediate_size` each. Checkpoint names:
`block_sparse_moe.gate` (router), `block_sparse_moe.e_score_correction_bias`,
`block_sparse_moe.experts.<e>.w1|w3|w2` (gate, up, down). The published checkpoints are
block-quantised FP8 (`quantization_config`): hf.py dequantises them at load.
"""

from primerl_models.args import Layer, ModelArgs
from primerl_models.families.base import (
    Family,
    TinyShape,
    attention_from_hf,
    model_args,
    moe_from_hf,
    tiny_common,
    unsupported,
)
from primerl_models.families.checkpoint import Checkpoint


def args_from_hf(cfg: dict) -> ModelArgs:
    if cfg.get("use_qk_norm") is False:
        unsupported(cfg, "use_qk_norm", "MiniMax-M2 with qk-norm only")
    if cfg.get("qk_norm_type", "per_layer") != "per_layer":
        unsupported(cfg, "qk_norm_type", "'per_layer' only: one RMSNorm over all heads of q and of k")
    if cfg.get("scoring_func", "sigmoid") != "sigmoid":
        unsupported(cfg, "scoring_func", "the sigmoid router only")
    if cfg.get("use_routing_bias") is False:
        unsupported(cfg, "use_routing_bias", "routers with e_score_correction_bias only")
    if cfg.get("shared_intermediate_size"):
        unsupported(cfg, "shared_intermediate_size", "MiniMax-M2 without shared experts")
    if any(kind != 1 for kind in cfg.get("attn_type_list") or []):
        unsupported(cfg, "attn_type_list", "softmax attention in every layer (1), no lightning attention")
    attn = attention_from_hf(cfg, qk_norm="full")
    moe = moe_from_hf(cfg, size_key="intermediate_size", scoring="sigmoid", norm_topk_prob=True, correction_bias=True)
    return model_args(cfg, [Layer(attn, moe)] * cfg["num_hidden_layers"])


def tiny_config(shape: TinyShape) -> dict:
    return tiny_common(
        shape,
        "minimax_m2",
        "MiniMaxM2ForCausalLM",
        intermediate_size=shape.moe_intermediate_size,
        num_local_experts=shape.num_experts,
        num_experts_per_tok=shape.num_experts_per_tok,
        # rotary_dim as released configs say it (vLLM reads it); the factor for transformers < 5.19
        rotary_dim=shape.head_dim // 2,
        partial_rotary_factor=0.5,
        use_qk_norm=True,
        qk_norm_type="per_layer",
        scoring_func="sigmoid",
        use_routing_bias=True,
        attention_bias=False,
    )


MINIMAX_M2 = Family(
    "minimax_m2",
    "MiniMaxM2ForCausalLM",
    args_from_hf,
    tiny_config,
    Checkpoint(
        renames=(
            (".block_sparse_moe.e_score_correction_bias", ".mlp.router.e_score_correction_bias"),
            (".block_sparse_moe.gate.", ".mlp.router."),
        ),
        experts="block_sparse_moe.experts",
        expert_projs=("w1", "w3", "w2"),
    ),
)
