"""primerl-models: our own Llama, Qwen3, Qwen3-MoE, GLM-4, GLM-4.5 and MiniMax-M2, described
layer by layer (ModelArgs), HF conversion, tiny models.

    from primerl_models import load_model, chunked_logprobs
    model = load_model("path/to/hf_folder", device="cuda", dtype=torch.bfloat16)
    hidden = model(input_ids, position_ids)                       # [B, T, D]
    logprobs, entropy = chunked_logprobs(hidden[0], model.output_weight, targets, temperature)
"""

from primerl_models.args import (
    Attention,
    DenseMLP,
    Experts,
    Layer,
    ModelArgs,
    MoEMLP,
    Rope,
    Routing,
    SharedExpert,
    Vision,
)
from primerl_models.blocks.attention import BACKENDS, attention
from primerl_models.families import FAMILIES, family_for
from primerl_models.hf import (
    build_model,
    carried_tensors,
    is_hub_id,
    load_model,
    published_config,
    read_config,
    resolve_model_folder,
    save_hf,
    to_hf,
    to_ours,
)
from primerl_models.logprobs import chunked_logprobs, chunked_token_loss
from primerl_models.model import Transformer
from primerl_models.packing import PackedSeqs

__all__ = [
    "BACKENDS",
    "FAMILIES",
    "Attention",
    "DenseMLP",
    "Experts",
    "Layer",
    "ModelArgs",
    "MoEMLP",
    "PackedSeqs",
    "Rope",
    "Routing",
    "SharedExpert",
    "Transformer",
    "Vision",
    "attention",
    "build_model",
    "carried_tensors",
    "chunked_logprobs",
    "chunked_token_loss",
    "family_for",
    "is_hub_id",
    "load_model",
    "published_config",
    "read_config",
    "resolve_model_folder",
    "save_hf",
    "to_hf",
    "to_ours",
]
