"""What a model family is: how to read its Hugging Face config.json into per-layer specs
(args.py), its checkpoint's tensor names (checkpoint.py), and the config of a tiny model.

A family file is the only place that knows its config keys: it refuses the options it does not
implement, naming them, and builds one `Layer` spec per layer. The helpers here read what most
configs spell the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NoReturn

from primerl_models.args import Attention, Experts, ModelArgs, MoEMLP, Rope, Routing, SharedExpert
from primerl_models.families.checkpoint import Checkpoint


def rope_settings(cfg: dict) -> tuple[float, dict | None]:
    """(rope_theta, scaling) from either layout: transformers 5's `rope_parameters` or the
    older top-level `rope_theta` + `rope_scaling`."""
    params = cfg.get("rope_parameters") or {}
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    scaling = cfg.get("rope_scaling") or params or None
    if scaling is not None:
        scaling = {k: v for k, v in scaling.items() if k not in ("rope_theta", "partial_rotary_factor")}
        if scaling.get("rope_type", scaling.get("type", "default")) == "default":
            scaling = None
    return float(theta), scaling


def head_dim(cfg: dict) -> int:
    return cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]


def partial_rotary_factor(cfg: dict, default: float = 1.0) -> float:
    """The share of each head that rotates, wherever the config keeps it (`rope_parameters`,
    top level, or MiniMax's `rotary_dim`)."""
    params = cfg.get("rope_parameters") or {}
    if "partial_rotary_factor" in params:
        return float(params["partial_rotary_factor"])
    if cfg.get("partial_rotary_factor") is not None:
        return float(cfg["partial_rotary_factor"])
    if cfg.get("rotary_dim"):
        return cfg["rotary_dim"] / head_dim(cfg)
    return default


def attention_from_hf(cfg: dict, *, partial_default: float = 1.0, interleaved: bool = False, **options) -> Attention:
    """The attention spec most configs describe: heads, kv heads, head_dim, RoPE (partial when
    the config says so), plus the family's `options` (qkv_bias, o_bias, qk_norm)."""
    heads, k = cfg["num_attention_heads"], head_dim(cfg)
    theta, scaling = rope_settings(cfg)
    rotary = int(k * partial_rotary_factor(cfg, partial_default))
    rope = Rope(rotary_dim=rotary, theta=theta, scaling=scaling, interleaved=interleaved)
    return Attention(
        num_heads=heads, num_kv_heads=cfg.get("num_key_value_heads") or heads, head_dim=k, rope=rope, **options
    )


def moe_from_hf(
    cfg: dict,
    *,
    size_key: str = "moe_intermediate_size",
    norm_topk_default: bool = False,
    shared: SharedExpert | None = None,
    experts: dict | None = None,
    **routing,
) -> MoEMLP:
    """The mixture of experts most configs describe: the expert count (`n_routed_experts`,
    `num_experts` or `num_local_experts`), `num_experts_per_tok`, each expert's size (`size_key`),
    `norm_topk_prob` (else `norm_topk_default`), `n_group`, `topk_group` and
    `routed_scaling_factor`; `routing` (scoring, correction_bias, ...) and `experts`
    (activation, bias, ...) are the family's settings and win over what was read; `shared`
    its shared expert (shared_expert_from_hf)."""
    read = dict(
        num_experts=first_key(cfg, "n_routed_experts", "num_experts", "num_local_experts"),
        top_k=cfg["num_experts_per_tok"],
        norm_topk_prob=bool(cfg.get("norm_topk_prob", norm_topk_default)),
        n_group=cfg.get("n_group") or 1,
        topk_group=cfg.get("topk_group") or 1,
        scaling=float(cfg.get("routed_scaling_factor") or 1.0),
    )
    return MoEMLP(Routing(**{**read, **routing}), Experts(size=cfg[size_key], **(experts or {})), shared)


def shared_expert_from_hf(
    cfg: dict, *, count_key: str | None, size_key: str = "moe_intermediate_size", **options
) -> SharedExpert | None:
    """The shared expert: `count_key` experts of `size_key`'s width as one dense MLP (GLM-4.5:
    n_shared_experts x moe_intermediate_size), or one of `size_key` when `count_key` is None
    (Qwen3.5, Laguna: shared_expert_intermediate_size); None when the width comes to 0.
    `options`: SharedExpert's activation and gate."""
    size = (cfg.get(size_key) or 0) * (1 if count_key is None else cfg.get(count_key) or 0)
    return SharedExpert(size, **options) if size else None


def first_key(cfg: dict, *keys: str):
    """The value of the first of `keys` the config has (configs spell some counts several ways)."""
    for key in keys:
        if cfg.get(key) is not None:
            return cfg[key]
    raise ValueError(f"{cfg.get('model_type')}: config.json has none of {', '.join(map(repr, keys))}")


def model_args(cfg: dict, layers: list, act_key: str | None = "hidden_act") -> ModelArgs:
    """The model-wide fields, read from a HF config dict, around the family's layers. `act_key`:
    the key naming the MLPs' activation, which must be silu (SwiGLU); None where the family
    checks its own."""
    if act_key is not None and cfg.get(act_key, "silu") != "silu":
        unsupported(cfg, act_key, "SwiGLU MLPs (silu) only")
    if len(layers) != cfg["num_hidden_layers"]:
        raise ValueError(f"{cfg.get('model_type')}: {len(layers)} layer specs for {cfg['num_hidden_layers']} layers")
    return ModelArgs(
        model_type=cfg["model_type"],
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        layers=layers,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        max_position_embeddings=cfg.get("max_position_embeddings", 32768),
    )


def layer_kinds(cfg: dict, key: str, allowed: tuple[str, ...], default: list[str]) -> list[str]:
    """A per-layer list of kinds (`layer_types`, Laguna's `mlp_layer_types`): the config's, else
    `default`; one entry per layer, each one of `allowed`, or the key is refused by name."""
    n = cfg["num_hidden_layers"]
    kinds = cfg.get(key) or default
    if len(kinds) != n or set(kinds) - set(allowed):
        unsupported(cfg, key, f"{n} entries of {' or '.join(map(repr, allowed))}")
    return kinds


ATTENTION_KINDS = ("sliding_attention", "full_attention")


def unsupported(cfg: dict, key: str, why: str) -> NoReturn:
    raise ValueError(f"{cfg.get('model_type')}: `{key}` = {cfg.get(key)!r} is not supported ({why})")


@dataclass(frozen=True)
class TinyShape:
    """The sizes of a tiny random model (tiny.py); each family writes them in its own keys."""

    vocab_size: int
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    intermediate_size: int = 128
    num_experts: int = 4
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 64
    tie_embeddings: bool = False
    max_position_embeddings: int = 4096


def tiny_common(shape: TinyShape, model_type: str, architecture: str, **extra) -> dict:
    """The config.json keys every family spells alike, for a tiny model."""
    cfg = {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": shape.vocab_size,
        "hidden_size": shape.hidden_size,
        "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_heads,
        "num_key_value_heads": shape.num_kv_heads,
        "head_dim": shape.head_dim,
        "intermediate_size": shape.intermediate_size,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": shape.tie_embeddings,
        "max_position_embeddings": shape.max_position_embeddings,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    cfg.update(extra)
    return cfg


@dataclass(frozen=True)
class Family:
    """A model family: its HF model_type and architecture, its config reader, its checkpoint
    names and what to write for a tiny model of it."""

    model_type: str
    architecture: str
    args_from_hf: Callable[[dict], ModelArgs]
    tiny_config: Callable[[TinyShape], dict]
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
