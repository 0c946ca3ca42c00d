"""The model a trainer trains: resolved, loaded, and parallelised from the config."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from primerl_models import Transformer, load_model, read_config, resolve_model_folder

from primerl_trainer.distributed import Dist
from primerl_trainer.parallel import parallelize


@dataclass
class LoadedModel:
    folder: Path
    """The local HF folder the weights came from (its tokenizer files travel with published weights)."""
    hf_config: dict


def load_for_training(cfg, d: Dist) -> tuple[Transformer, LoadedModel]:
    """Every rank loads the HF checkpoint (CPU), then FSDP2 shards it onto its device."""
    folder = resolve_model_folder(cfg.model.name, cfg.model.revision)
    tcfg = cfg.trainer
    model = load_model(folder, device="cpu", attn_backend=tcfg.attention)
    model.train()
    parallelize(
        model,
        d.device,
        activation_checkpointing=tcfg.activation_checkpointing,
        compile_layers=tcfg.compile,
        bf16=tcfg.dtype == "bfloat16",
        cpu_offload=tcfg.optimizer.cpu_offload,
    )
    return model, LoadedModel(folder, read_config(folder))
