"""The model families primerl implements, by Hugging Face `model_type`."""

from primerl_models.families.afmoe import AFMOE
from primerl_models.families.base import Family, TinyShape
from primerl_models.families.glm4 import GLM4
from primerl_models.families.glm4_moe import GLM4_MOE
from primerl_models.families.glm_moe_dsa import GLM_MOE_DSA
from primerl_models.families.gpt_oss import GPT_OSS
from primerl_models.families.laguna import LAGUNA
from primerl_models.families.llama import LLAMA
from primerl_models.families.minimax_m2 import MINIMAX_M2
from primerl_models.families.nemotron_h import NEMOTRON_H
from primerl_models.families.qwen3 import QWEN3
from primerl_models.families.qwen3_5 import QWEN3_5, QWEN3_5_MOE, QWEN3_5_MOE_TEXT, QWEN3_5_TEXT
from primerl_models.families.qwen3_moe import QWEN3_MOE

FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (
        LLAMA,
        QWEN3,
        QWEN3_MOE,
        GLM4,
        GLM4_MOE,
        GLM_MOE_DSA,
        MINIMAX_M2,
        GPT_OSS,
        AFMOE,
        LAGUNA,
        QWEN3_5,
        QWEN3_5_TEXT,
        QWEN3_5_MOE,
        QWEN3_5_MOE_TEXT,
        NEMOTRON_H,
    )
}


def family_for(cfg: dict, where: str = "config.json") -> Family:
    """The family of a HF config dict, or a ValueError listing the supported ones."""
    model_type = cfg.get("model_type")
    if model_type not in FAMILIES:
        raise ValueError(
            f"{where}: model_type {model_type!r} is not implemented by primerl-models; "
            f"supported: {', '.join(sorted(FAMILIES))}"
        )
    return FAMILIES[model_type]


__all__ = ["FAMILIES", "Family", "TinyShape", "family_for"]
