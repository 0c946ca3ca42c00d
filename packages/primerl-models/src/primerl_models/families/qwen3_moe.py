"""Qwen3-MoE: Qwen3 attention; MLPs are mixtures of experts (softmax router, top-k)."""

from dataclasses import replace

from primerl_models.common.args import ModelArgs
from primerl_models.families import qwen3
from primerl_models.families.base import Family, dense_hf_config


def args_from_hf(cfg: dict) -> ModelArgs:
    num_experts = cfg.get("num_experts", cfg.get("num_local_experts", 0))
    step = cfg.get("decoder_sparse_step", 1) or 1
    dense_only = set(cfg.get("mlp_only_layers") or [])
    moe_layers = [
        num_experts > 0 and i not in dense_only and (i + 1) % step == 0
        for i in range(cfg["num_hidden_layers"])
    ]
    return replace(
        qwen3.args_from_hf(cfg),  # Qwen3's attention (and its checks)
        num_experts=num_experts,
        num_experts_per_tok=cfg["num_experts_per_tok"],
        moe_intermediate_size=cfg["moe_intermediate_size"],
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        moe_layers=moe_layers,
    )


def hf_config(args: ModelArgs) -> dict:
    return dense_hf_config(
        args,
        "Qwen3MoeForCausalLM",
        use_sliding_window=False,
        num_experts=args.num_experts,
        num_experts_per_tok=args.num_experts_per_tok,
        moe_intermediate_size=args.moe_intermediate_size,
        norm_topk_prob=args.norm_topk_prob,
        decoder_sparse_step=1,
        mlp_only_layers=[i for i, moe in enumerate(args.moe_layers) if not moe],
    )


QWEN3_MOE = Family("qwen3_moe", "Qwen3MoeForCausalLM", args_from_hf, hf_config)
