"""GLM-4.5 / GLM-4.5-Air / GLM-4.6 / GLM-4.7 and INTELLECT-3 (`glm4_moe`).

Attention: partial RoPE (half of each head by default, the halves layout), q/k/v bias without
o bias (`attention_bias`), optional per-head qk-norm (`use_qk_norm`). MLP: the first
`first_k_dense_replace` layers dense, then mixtures of experts with a sigmoid router whose fp32
`e_score_correction_bias` only chooses the experts, group-limited top-k (`n_group`,
`topk_group`), renormalisation (`norm_topk_prob`), `routed_scaling_factor`, and
`n_shared_experts` shared experts (one dense SwiGLU of that many experts' width).
The MTP layers (`num_nextn_predict_layers`, stored as layers num_hidden_layers and up) are not
trained: they are carried from the source checkpoint to the published weights unchanged.
"""

import re

from primerl_models.args import DenseMLP, Layer, ModelArgs
from primerl_models.families.base import (
    Family,
    TinyShape,
    attention_from_hf,
    model_args,
    moe_from_hf,
    shared_expert_from_hf,
    tiny_common,
)
from primerl_models.families.checkpoint import Checkpoint

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def args_from_hf(cfg: dict) -> ModelArgs:
    attn = attention_from_hf(
        cfg,
        partial_default=0.5,
        qkv_bias=bool(cfg.get("attention_bias", False)),
        o_bias=False,
        qk_norm="head" if cfg.get("use_qk_norm") else "none",
    )
    moe = moe_from_hf(
        cfg,
        norm_topk_default=True,
        scoring="sigmoid",
        correction_bias=True,
        shared=shared_expert_from_hf(cfg, count_key="n_shared_experts"),
    )
    first_dense = cfg.get("first_k_dense_replace", 1)
    dense = Layer(attn, DenseMLP(cfg["intermediate_size"]))
    sparse = Layer(attn, moe)
    return model_args(cfg, [dense if i < first_dense else sparse for i in range(cfg["num_hidden_layers"])])


def mtp_layers(cfg: dict):
    """HF names of the MTP layers: layer indices from num_hidden_layers on."""
    n = cfg["num_hidden_layers"]

    def carried(name: str) -> bool:
        m = _LAYER.match(name)
        return m is not None and int(m[1]) >= n

    return carried


def tiny_config(shape: TinyShape) -> dict:
    return tiny_common(
        shape,
        "glm4_moe",
        "Glm4MoeForCausalLM",
        attention_bias=True,
        use_qk_norm=True,
        partial_rotary_factor=0.5,
        n_routed_experts=shape.num_experts,
        num_experts_per_tok=shape.num_experts_per_tok,
        moe_intermediate_size=shape.moe_intermediate_size,
        n_shared_experts=1,
        first_k_dense_replace=1,
        n_group=2 if shape.num_experts % 2 == 0 and shape.num_experts >= 4 else 1,
        topk_group=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        num_nextn_predict_layers=0,
    )


GLM4_MOE = Family("glm4_moe", "Glm4MoeForCausalLM", args_from_hf, tiny_config, Checkpoint(carried=mtp_layers))
