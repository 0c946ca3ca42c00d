"""Qwen3-MoE: Qwen3 attention; MLPs are mixtures of experts (softmax router, top-k), some
layers dense (`mlp_only_layers`, `decoder_sparse_step`)."""

from primerl_models.args import DenseMLP, Layer, ModelArgs
from primerl_models.families import qwen3
from primerl_models.families.base import Family, TinyShape, model_args, moe_from_hf, tiny_common


def args_from_hf(cfg: dict) -> ModelArgs:
    num_experts = cfg.get("num_experts", cfg.get("num_local_experts", 0))
    step = cfg.get("decoder_sparse_step", 1) or 1
    dense_only = set(cfg.get("mlp_only_layers") or [])
    attn = qwen3.attention(cfg)
    dense = Layer(attn, DenseMLP(cfg["intermediate_size"]))
    if num_experts:
        moe = Layer(attn, moe_from_hf(cfg, scoring="softmax"))
    layers = [
        moe if num_experts and i not in dense_only and (i + 1) % step == 0 else dense
        for i in range(cfg["num_hidden_layers"])
    ]
    return model_args(cfg, layers)


def tiny_config(shape: TinyShape) -> dict:
    return tiny_common(
        shape,
        "qwen3_moe",
        "Qwen3MoeForCausalLM",
        use_sliding_window=False,
        attention_bias=False,
        num_experts=shape.num_experts,
        num_experts_per_tok=shape.num_experts_per_tok,
        moe_intermediate_size=shape.moe_intermediate_size,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    )


QWEN3_MOE = Family("qwen3_moe", "Qwen3MoeForCausalLM", args_from_hf, tiny_config)
