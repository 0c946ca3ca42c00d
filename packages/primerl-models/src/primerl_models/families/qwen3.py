"""Qwen3 dense: Llama's layout plus RMSNorm on each head of q and k."""

from primerl_models.common.args import ModelArgs
from primerl_models.families.base import (
    Family,
    dense_args,
    dense_hf_config,
    unsupported,
)


def args_from_hf(cfg: dict) -> ModelArgs:
    if cfg.get("use_sliding_window"):
        unsupported(cfg, "use_sliding_window", "full attention only")
    return dense_args(cfg, qk_norm=True)


def hf_config(args: ModelArgs) -> dict:
    return dense_hf_config(args, "Qwen3ForCausalLM", use_sliding_window=False)


QWEN3 = Family("qwen3", "Qwen3ForCausalLM", args_from_hf, hf_config)
