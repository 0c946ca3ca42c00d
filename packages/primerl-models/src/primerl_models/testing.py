"""Test helpers: Hugging Face checkpoints written by transformers itself (the reference of every
parity test). Needs transformers, which primerl-models does not depend on."""

from __future__ import annotations

from pathlib import Path

import torch


def save_transformers(
    config,
    folder: str | Path,
    shard: str | None = None,
    router_bias_std: float = 0.0,
    seed: int = 0,
    bias_std: float = 0.0,
    norm_std: float = 0.0,
    adjust=None,
):
    """transformers' model of `config` (seeded random weights) saved by its own save_pretrained,
    in shards of `shard` (e.g. "30KB") when given; routers' correction biases
    (`e_score_correction_bias`, Trinity's `expert_bias`) drawn normal(0, router_bias_std) first
    when > 0 (transformers initialises them to zero), every parameter named `*bias`
    normal(0, bias_std) when > 0 (likewise), and every norm's weight 1 + normal(0, norm_std) when
    > 0 (so that a norm loaded into the wrong place shows); then `adjust(model)` when given.
    Returns the model (eval mode, eager attention)."""
    try:
        import transformers
    except ImportError as err:  # not a dependency of primerl-models: the workspace's dev group has it
        raise ImportError("primerl_models.testing.save_transformers needs transformers (uv sync --group dev)") from err

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    if router_bias_std:
        with torch.no_grad():
            for name, t in [*model.named_buffers(), *model.named_parameters()]:
                if name.endswith(("e_score_correction_bias", ".expert_bias")):
                    t.normal_(0.0, router_bias_std)
    if bias_std:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("bias"):
                    param.normal_(0.0, bias_std)
    if norm_std:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.normal_(1.0, norm_std)
    if adjust is not None:
        with torch.no_grad():
            adjust(model)
    model.save_pretrained(folder, **({"max_shard_size": shard} if shard else {}))
    return model


def save_with_mtp(hf, folder: str | Path) -> dict[str, torch.Tensor]:
    """Save a transformers Qwen3.5 VLM in shards with MTP tensors beside it (in the shard index
    too), as the released checkpoints have them; returns the MTP tensors."""
    import json

    from safetensors.torch import save_file

    folder = Path(folder)
    hf.save_pretrained(folder, max_shard_size="40KB")
    mtp = {"mtp.fc.weight": torch.randn(64, 128), "mtp.norm.weight": torch.randn(64)}
    save_file(mtp, folder / "model-mtp.safetensors")
    index = folder / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
        data["weight_map"].update({name: "model-mtp.safetensors" for name in mtp})
        index.write_text(json.dumps(data))
    return mtp


def qwen35_draw(name: str, p: torch.Tensor) -> None:
    """Draw one parameter of a Qwen3.5 text model (HF names) away from its init, as trained
    weights are: norms away from it, so that a norm in the wrong place (or a zero-centred one
    read as plain) shows: the zero-centred ones around 0, the DeltaNet's gated norm around 1.
    Decays of the size trained models use: A = exp(A_log) in [0.5, 4] and a = in_proj_a(x) of
    std ~0.4, so that exp(g) per token is mostly in (0.1, 1). (With the init's decays, g reaches
    -100 a token and transformers' fp32 chunked scan, which takes the decay between two tokens as
    a difference of cumulative sums, is off by ~1e-3 on the logits; ours sums it directly.)
    Other parameters are left as they are."""
    if name.endswith("linear_attn.norm.weight"):
        p.normal_(1.0, 0.2)
    elif name.endswith("norm.weight"):
        p.normal_(0.0, 0.2)
    elif name.endswith("A_log"):
        p.uniform_(0.5, 4.0).log_()
    elif name.endswith("in_proj_a.weight"):
        p.normal_(0.0, 0.05)


def vlm_draw(model: torch.nn.Module) -> None:
    """Draw a transformers Qwen3.5(-MoE) VLM's weights at trained sizes, so that every piece shows
    in the logits: the text model's by qwen35_draw; the tower's matrices ~ 1 / sqrt(fan-in), its
    biases and LayerNorms away from 0 and 1, and its position grid as large as the patches'
    embedding."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.startswith("model.visual."):
                qwen35_draw(name, p)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.2)
            elif "norm" in name:
                p.normal_(1.0, 0.2)
            elif "pos_embed" in name:
                p.normal_(0.0, 1.0)
            else:
                p.normal_(0.0, p[0].numel() ** -0.5)
