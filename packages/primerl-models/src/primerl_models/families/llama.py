"""Llama (3.x): GQA, SwiGLU, RoPE with optional Llama-3 frequency scaling."""

from primerl_models.common.args import ModelArgs
from primerl_models.families.base import (
    Family,
    dense_args,
    dense_hf_config,
    unsupported,
)


def args_from_hf(cfg: dict) -> ModelArgs:
    if cfg.get("mlp_bias"):
        unsupported(cfg, "mlp_bias", "Llama MLPs without bias only")
    return dense_args(cfg)


def hf_config(args: ModelArgs) -> dict:
    return dense_hf_config(args, "LlamaForCausalLM", mlp_bias=False)


LLAMA = Family("llama", "LlamaForCausalLM", args_from_hf, hf_config)
