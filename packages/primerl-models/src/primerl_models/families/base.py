"""What a model family is: how to read its Hugging Face config.json and write one back.

Weight names and layouts are shared by every family so far (hf.py converts them); a family
whose checkpoint differs overrides `Family.to_ours` / `Family.to_hf`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from primerl_models.common.args import ModelArgs


def rope_settings(cfg: dict) -> tuple[float, dict | None]:
    """(rope_theta, scaling) from either layout: transformers 5's `rope_parameters` or the
    older top-level `rope_theta` + `rope_scaling`."""
    params = cfg.get("rope_parameters") or {}
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    scaling = cfg.get("rope_scaling") or params or None
    if scaling is not None:
        scaling = {k: v for k, v in scaling.items() if k != "rope_theta"}
        if scaling.get("rope_type", scaling.get("type", "default")) == "default":
            scaling = None
    return float(theta), scaling


def dense_args(cfg: dict, **overrides) -> ModelArgs:
    """The fields every decoder-only family shares, read from a HF config dict."""
    theta, scaling = rope_settings(cfg)
    heads = cfg["num_attention_heads"]
    kwargs = dict(
        model_type=cfg["model_type"],
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        intermediate_size=cfg["intermediate_size"],
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", False)),
        max_position_embeddings=cfg.get("max_position_embeddings", 32768),
    )
    kwargs.update(overrides)
    return ModelArgs(**kwargs)


def dense_hf_config(args: ModelArgs, architecture: str, **extra) -> dict:
    """A HF config.json dict for `args` (what the tiny-model builder writes)."""
    cfg = {
        "architectures": [architecture],
        "model_type": args.model_type,
        "vocab_size": args.vocab_size,
        "hidden_size": args.hidden_size,
        "num_hidden_layers": args.num_layers,
        "num_attention_heads": args.num_heads,
        "num_key_value_heads": args.num_kv_heads,
        "head_dim": args.head_dim,
        "intermediate_size": args.intermediate_size,
        "rms_norm_eps": args.rms_norm_eps,
        "rope_theta": args.rope_theta,
        "rope_scaling": args.rope_scaling,
        "tie_word_embeddings": args.tie_embeddings,
        "attention_bias": args.attention_bias,
        "max_position_embeddings": args.max_position_embeddings,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    cfg.update(extra)
    return cfg


def unsupported(cfg: dict, key: str, why: str) -> None:
    raise ValueError(f"{cfg.get('model_type')}: `{key}` = {cfg.get(key)!r} is not supported ({why})")


@dataclass(frozen=True)
class Family:
    """A model family: its HF model_type, architecture name and config readers/writers."""

    model_type: str
    architecture: str
    args_from_hf: Callable[[dict], ModelArgs]
    hf_config: Callable[[ModelArgs], dict]
