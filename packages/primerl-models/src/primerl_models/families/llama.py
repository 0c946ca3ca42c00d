"""Llama (3.x): GQA, SwiGLU, RoPE with optional Llama-3 frequency scaling."""

from primerl_models.args import DenseMLP, Layer, ModelArgs
from primerl_models.families.base import Family, TinyShape, attention_from_hf, model_args, tiny_common, unsupported


def args_from_hf(cfg: dict) -> ModelArgs:
    if cfg.get("mlp_bias"):
        unsupported(cfg, "mlp_bias", "Llama MLPs without bias only")
    bias = bool(cfg.get("attention_bias", False))
    layer = Layer(attention_from_hf(cfg, qkv_bias=bias, o_bias=bias), DenseMLP(cfg["intermediate_size"]))
    return model_args(cfg, [layer] * cfg["num_hidden_layers"])


def tiny_config(shape: TinyShape) -> dict:
    return tiny_common(shape, "llama", "LlamaForCausalLM", mlp_bias=False, attention_bias=False, rope_scaling=None)


LLAMA = Family("llama", "LlamaForCausalLM", args_from_hf, tiny_config)
