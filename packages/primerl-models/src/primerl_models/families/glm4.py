"""GLM-4 dense (`glm4`, GLM-4-0414): partial RoPE on interleaved pairs (half of each head by
default), q/k/v bias without o bias, sandwich norms (the attention's and the MLP's outputs are
normalised again before each residual add) and one fused `gate_up_proj` per MLP, which the
checkpoint conversion splits into our gate_proj and up_proj and fuses back."""

from primerl_models.args import DenseMLP, Layer, ModelArgs
from primerl_models.families.base import Family, TinyShape, attention_from_hf, model_args, tiny_common
from primerl_models.families.checkpoint import Checkpoint


def args_from_hf(cfg: dict) -> ModelArgs:
    attn = attention_from_hf(
        cfg, partial_default=0.5, interleaved=True, qkv_bias=bool(cfg.get("attention_bias", True)), o_bias=False
    )
    layer = Layer(attn, DenseMLP(cfg["intermediate_size"]), sandwich_norm=True)
    return model_args(cfg, [layer] * cfg["num_hidden_layers"])


def tiny_config(shape: TinyShape) -> dict:
    return tiny_common(shape, "glm4", "Glm4ForCausalLM", attention_bias=True, partial_rotary_factor=0.5)


GLM4 = Family("glm4", "Glm4ForCausalLM", args_from_hf, tiny_config, Checkpoint(fused_gate_up=True))
