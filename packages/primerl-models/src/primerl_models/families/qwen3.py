"""Qwen3 dense: Llama's layout plus RMSNorm on each head of q and k."""

from primerl_models.args import Attention, DenseMLP, Layer, ModelArgs
from primerl_models.families.base import Family, TinyShape, attention_from_hf, model_args, tiny_common, unsupported


def attention(cfg: dict) -> Attention:
    """Qwen3's attention (Qwen3-MoE's too): per-head qk-norm; `attention_bias` on q, k, v and o."""
    if cfg.get("use_sliding_window"):
        unsupported(cfg, "use_sliding_window", "full attention only")
    bias = bool(cfg.get("attention_bias", False))
    return attention_from_hf(cfg, qkv_bias=bias, o_bias=bias, qk_norm="head")


def args_from_hf(cfg: dict) -> ModelArgs:
    layer = Layer(attention(cfg), DenseMLP(cfg["intermediate_size"]))
    return model_args(cfg, [layer] * cfg["num_hidden_layers"])


def tiny_config(shape: TinyShape) -> dict:
    return tiny_common(shape, "qwen3", "Qwen3ForCausalLM", use_sliding_window=False, attention_bias=False)


QWEN3 = Family("qwen3", "Qwen3ForCausalLM", args_from_hf, tiny_config)
