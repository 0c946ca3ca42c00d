"""Training-step benchmark: primerl-models vs transformers, same shape, same run, one GPU.

One step = forward, backward and AdamW (fused, for both) on one packed row of random tokens,
random weights, fp32 master weights with bf16 autocast (both). The loss is the mean token
negative log-likelihood: transformers' own `labels=` path, our chunked logprob path.

Reported per model: tokens/s (median of the timed steps), MFU and peak memory.
MFU = (6 N_active + 6 L T H K) tokens / s / 989 TFLOP/s  (N with lm_head, embeddings
excluded; the second term is causal attention; H200 bf16 dense peak 989 TFLOP/s).

    python bench/model_step.py --models qwen3-0.6b,qwen3-30b-a3b-6l --steps 6

Vision-language shapes (IMAGES below) put images in the row: random patches through the vision
tower, their merged tokens at the image tokens, 3-axis positions computed by each model from the
image tokens (transformers: mm_token_type_ids). The tower is frozen (requires_grad False, as
trainer.freeze_vision's default) for both; the run flag `:tower` trains it, for both. MFU adds
the tower's FLOPs (forward only when frozen, x3 when trained) to the text model's.

    python bench/model_step.py --models qwen3.5-0.8b-vl --runs transformers,ours,transformers:tower,ours:tower

FP8 (trainer.precision = "fp8"): the run flag `:fp8` converts our decoder layers' projections
with the trainer's own function (primerl_trainer.precision; torchao installed, and
packages/primerl-trainer/src on PYTHONPATH), e.g. `--runs ours,ours:fp8`.

    python bench/model_step.py --models qwen3-1.7b,qwen3-30b-a3b-6l --runs ours,ours:fp8,ours:fp8gw,ours:fp8big

Needs a GPU with transformers installed; PYTHONPATH=packages/primerl-models/src if primerl is
not installed there. `--device cpu` checks the code path on a tiny shape (qwen3.5-vl-tiny,
runs with `:eager`); its timings mean nothing and it reports no memory.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import time

import torch
from primerl_models import ModelArgs, Transformer, chunked_logprobs, chunked_token_loss
from primerl_models.blocks import gated_deltanet
from primerl_models.kernels import gated_delta

PEAK_FLOPS = 989e12
VOCAB = 151936

# Qwen3.5-0.8B's text model as recalled (Qwen/Qwen3.5-0.8B's config.json was not at hand
# offline): 24 layers, 3 Gated DeltaNet to 1 gated full attention, tied embeddings
QWEN35_08B_TEXT = dict(
    vocab_size=248320,
    hidden_size=1024,
    num_hidden_layers=24,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=256,
    intermediate_size=3584,
    linear_num_key_heads=16,
    linear_num_value_heads=16,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    full_attention_interval=4,
    tie_word_embeddings=True,
    rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25),
)

SHAPES = {
    # name: (model_type, HF config fields, seq_len); a vision-language model's fields are its
    # text_config, vision_config and image_token_id
    "qwen3-0.6b": (
        "qwen3",
        dict(
            hidden_size=1024,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            intermediate_size=3072,
            tie_word_embeddings=True,
        ),
        16384,
    ),
    "qwen3-1.7b": (
        "qwen3",
        dict(
            hidden_size=2048,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            intermediate_size=6144,
            tie_word_embeddings=True,
        ),
        16384,
    ),
    "qwen3-4b": (
        "qwen3",
        dict(
            hidden_size=2560,
            num_hidden_layers=36,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            intermediate_size=9728,
            tie_word_embeddings=True,
        ),
        16384,
    ),
    "qwen3-30b-a3b-6l": (
        "qwen3_moe",
        dict(
            hidden_size=2048,
            num_hidden_layers=6,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            intermediate_size=6144,
            moe_intermediate_size=768,
            num_experts=128,
            num_experts_per_tok=8,
            norm_topk_prob=True,
            tie_word_embeddings=False,
        ),
        8192,
    ),
    # Qwen/Qwen3-30B-A3B's config.json whole (48 layers): for several GPUs (trainer_step.py
    # --ep/--cp) and the memory table of docs/trainer.md (memory_layouts.py)
    "qwen3-30b-a3b": (
        "qwen3_moe",
        dict(
            hidden_size=2048,
            num_hidden_layers=48,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            intermediate_size=6144,
            moe_intermediate_size=768,
            num_experts=128,
            num_experts_per_tok=8,
            norm_topk_prob=True,
            tie_word_embeddings=False,
        ),
        16384,
    ),
    # openai/gpt-oss-20b's config.json cut to 4 layers (sliding, full, sliding, full): sinks,
    # 128-token windows, YaRN, biases, 32 experts top-4 with the clamped SwiGLU
    "gpt-oss-20b-4l": (
        "gpt_oss",
        dict(
            vocab_size=201088,
            hidden_size=2880,
            num_hidden_layers=4,
            num_attention_heads=64,
            num_key_value_heads=8,
            head_dim=64,
            intermediate_size=2880,
            num_local_experts=32,
            num_experts_per_tok=4,
            sliding_window=128,
            attention_bias=True,
            swiglu_limit=7.0,
            rms_norm_eps=1e-5,
            layer_types=["sliding_attention", "full_attention"] * 2,
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=150000.0,
                factor=32.0,
                beta_fast=32.0,
                beta_slow=1.0,
                truncate=False,
                original_max_position_embeddings=4096,
            ),
            tie_word_embeddings=False,
        ),
        8192,
    ),
    # Qwen3.5-0.8B's text model (above)
    "qwen3.5-0.8b": ("qwen3_5_text", QWEN35_08B_TEXT, 8192),
    # Qwen3.5-0.8B as released, a vision-language model (Qwen3_5ForConditionalGeneration): the
    # text model above with its 3-axis RoPE sections, and the vision tower of Qwen/Qwen3.5-0.8B's
    # vision_config as found in several public repositories' copies of that config (recalled and
    # cross-checked, not read from the official file, which was not at hand offline): 12 blocks
    # of width 768, 12 heads of 64, MLP 3072 (gelu tanh), patches 16 x 16 x 2 frames, 2 x 2 merge
    # to the text width 1024, a 48 x 48 learned position grid. Images: IMAGES below.
    "qwen3.5-0.8b-vl": (
        "qwen3_5",
        dict(
            text_config=QWEN35_08B_TEXT
            | dict(
                rope_parameters=dict(
                    rope_type="default",
                    rope_theta=1e7,
                    partial_rotary_factor=0.25,
                    mrope_section=[11, 11, 10],
                    mrope_interleaved=True,
                )
            ),
            vision_config=dict(
                depth=12,
                hidden_size=768,
                num_heads=12,
                intermediate_size=3072,
                hidden_act="gelu_pytorch_tanh",
                in_channels=3,
                patch_size=16,
                temporal_patch_size=2,
                spatial_merge_size=2,
                num_position_embeddings=2304,
                out_hidden_size=1024,
            ),
            image_token_id=248056,
        ),
        8192,
    ),
    # A tiny vision-language shape to check the code path on a CPU (--device cpu, runs :eager)
    "qwen3.5-vl-tiny": (
        "qwen3_5",
        dict(
            text_config=dict(
                vocab_size=1024,
                hidden_size=64,
                num_hidden_layers=4,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=16,
                intermediate_size=96,
                linear_num_key_heads=2,
                linear_num_value_heads=4,
                linear_key_head_dim=8,
                linear_value_head_dim=16,
                linear_conv_kernel_dim=4,
                full_attention_interval=2,
                tie_word_embeddings=True,
                rope_parameters=dict(
                    rope_type="default",
                    rope_theta=1e4,
                    partial_rotary_factor=1.0,
                    mrope_section=[4, 2, 2],
                    mrope_interleaved=True,
                ),
            ),
            vision_config=dict(
                depth=2,
                hidden_size=32,
                num_heads=2,
                intermediate_size=48,
                patch_size=16,
                temporal_patch_size=2,
                spatial_merge_size=2,
                num_position_embeddings=16,
                out_hidden_size=64,
            ),
            image_token_id=1000,
        ),
        96,
    ),
    # Qwen3.5-35B-A3B's text shape (transformers 5.19's Qwen3_5MoeTextConfig defaults, which are
    # that model's) cut to 4 layers: 3 Gated DeltaNet (16 key, 32 value heads) to 1 gated full
    # attention, 256 experts top-8 of width 512 plus the gated shared expert
    "qwen3.5-35b-a3b-4l": (
        "qwen3_5_moe_text",
        dict(
            vocab_size=248320,
            hidden_size=2048,
            num_hidden_layers=4,
            num_attention_heads=16,
            num_key_value_heads=2,
            head_dim=256,
            moe_intermediate_size=512,
            shared_expert_intermediate_size=512,
            num_experts=256,
            num_experts_per_tok=8,
            linear_num_key_heads=16,
            linear_num_value_heads=32,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            linear_conv_kernel_dim=4,
            full_attention_interval=4,
            tie_word_embeddings=False,
            rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25),
        ),
        8192,
    ),
    # GLM-4.5-Air's shape (zai-org/GLM-4.5-Air config.json) cut to 3 layers: the dense first
    # layer and 2 MoE layers (128 experts top-8, sigmoid router with correction bias, one
    # shared expert), partial RoPE, q/k/v bias; no MTP layer (it is not trained).
    "glm-4.5-air-3l": (
        "glm4_moe",
        dict(
            vocab_size=151552,
            hidden_size=4096,
            num_hidden_layers=3,
            num_attention_heads=96,
            num_key_value_heads=8,
            head_dim=128,
            intermediate_size=10944,
            moe_intermediate_size=1408,
            n_routed_experts=128,
            num_experts_per_tok=8,
            n_shared_experts=1,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
            routed_scaling_factor=1.0,
            norm_topk_prob=True,
            use_qk_norm=False,
            attention_bias=True,
            partial_rotary_factor=0.5,
            rms_norm_eps=1e-5,
            num_nextn_predict_layers=0,
            tie_word_embeddings=False,
        ),
        8192,
    ),
    # NVIDIA Nemotron 3 Super (nvidia/NVIDIA-Nemotron-3-Super-120B-A12B-BF16) cut to 4 layers:
    # Mamba2, latent MoE, Mamba2, attention (its pattern's first three layers, then its first
    # attention layer, the 8th: one of each kind, Mamba2 to MoE 1:1 as in its 40 + 40 + 8 layers).
    # The numbers as public code quotes its config.json (Megatron-Bridge's NemotronH bridge test:
    # 512 experts top-22 of width 2688, latent 1024, shared expert 5376, routed_scaling_factor 5;
    # other projects' checks of the released config: hidden 4096, 32 heads of 128, 2 kv heads,
    # Mamba2 128 heads of 64, 8 groups, state 128, vocabulary 131072), cross-checked with NVIDIA's
    # deployment guide (latent "d=4096 -> l=1024"); the official file itself was not read. No MTP
    # layer (not trained). 4.2B parameters (2.8B the MoE layer's experts): ~67 GB of fp32 weights,
    # gradients and AdamW states.
    "nemotron-3-super-4l": (
        "nemotron_h",
        dict(
            vocab_size=131072,
            hidden_size=4096,
            layers_block_type=["linear_attention", "moe", "linear_attention", "full_attention"],
            num_attention_heads=32,
            num_key_value_heads=2,
            head_dim=128,
            mamba_num_heads=128,
            mamba_head_dim=64,
            ssm_state_size=128,
            n_groups=8,
            conv_kernel=4,
            chunk_size=128,
            n_routed_experts=512,
            num_experts_per_tok=22,
            moe_intermediate_size=2688,
            moe_latent_size=1024,
            n_shared_experts=1,
            moe_shared_expert_intermediate_size=5376,
            n_group=1,
            topk_group=1,
            routed_scaling_factor=5.0,
            norm_topk_prob=True,
            mlp_hidden_act="relu2",
            layer_norm_epsilon=1e-5,
            num_nextn_predict_layers=0,
            tie_word_embeddings=False,
        ),
        8192,
    ),
    # zai-org/GLM-5's shape (transformers 5.19's GlmMoeDsaConfig defaults, which are its config)
    # cut to 3 layers: its first (dense) layer and 2 MoE layers (256 experts top-8 of width 2,048,
    # one shared expert, the sigmoid router with groups of 1), MLA at its real head and latent
    # sizes, the DSA indexer (32 heads of 128, top-2048 keys) in every layer. Run with :bf16
    # (~21.7B parameters: fp32 weights with AdamW's states do not fit one GPU).
    "glm-5-3l": (
        "glm_moe_dsa",
        dict(
            vocab_size=154880,
            hidden_size=6144,
            intermediate_size=12288,
            moe_intermediate_size=2048,
            num_hidden_layers=3,
            num_attention_heads=64,
            num_key_value_heads=64,
            n_shared_experts=1,
            n_routed_experts=256,
            routed_scaling_factor=2.5,
            kv_lora_rank=512,
            q_lora_rank=2048,
            qk_rope_head_dim=64,
            v_head_dim=256,
            qk_nope_head_dim=192,
            n_group=1,
            topk_group=1,
            num_experts_per_tok=8,
            norm_topk_prob=True,
            rms_norm_eps=1e-5,
            index_topk=2048,
            index_head_dim=128,
            index_n_heads=32,
            first_k_dense_replace=1,
            indexer_types=["full", "full", "full"],
            num_nextn_predict_layers=0,
            tie_word_embeddings=False,
        ),
        16384,
    ),
}
# The same with 128 routed experts instead of 256 (~12B parameters), for one H100 (80 GB) when no
# H200 is to be had: a token's work is the same (top-8 of experts of the same width); only the
# weights, their gradients and the SGD update halve, and transformers' loop over experts runs
# half as many iterations (its side gains, so the ratio is not flattered).
SHAPES["glm-5-3l-e128"] = (SHAPES["glm-5-3l"][0], SHAPES["glm-5-3l"][1] | {"n_routed_experts": 128}, 16384)

# The images of a vision-language shape's row, (t, h, w) patch grids, each image's tokens
# (t h w / 4) after a run of text: 8 pictures of 448 x 448 (28 x 28 patches of 16, 196 tokens
# each), 1,568 image tokens and 6,624 text tokens in the 8,192 of the row.
IMAGES = {
    "qwen3.5-0.8b-vl": [(1, 28, 28)] * 8,
    "qwen3.5-vl-tiny": [(1, 4, 4), (1, 4, 8), (1, 6, 4)],
}

DEVICE = "cuda"


def hf_dict(name: str, layers: int | None = None) -> dict:
    """The shape's config.json; `layers` cuts (or extends) it to that many decoder layers. A
    vision-language shape's is the released layout: text_config, vision_config, image_token_id."""
    model_type, fields, _ = SHAPES[name]
    base = dict(vocab_size=VOCAB, rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=40960)
    cut = {"num_hidden_layers": layers} if layers else {}
    if "text_config" in fields:
        text = dict(model_type=model_type + "_text") | base | fields["text_config"] | cut
        outer = dict(model_type=model_type, tie_word_embeddings=text["tie_word_embeddings"])
        return outer | fields | dict(text_config=text)
    return dict(model_type=model_type) | base | fields | cut


def our_args(name: str, layers: int | None = None) -> ModelArgs:
    from primerl_models.families import family_for

    cfg = hf_dict(name, layers)
    return family_for(cfg).args_from_hf(cfg)


def flops_per_token(args: ModelArgs, seq: int) -> float:
    return args.train_flops([seq]) / seq


def vision_flops(args: ModelArgs, grids: list[tuple[int, int, int]], trained: bool) -> float:
    """FLOPs of the tower over these images: forward alone when frozen (nothing flows back into
    it), forward + backward (x3) when trained. Matrices per patch (embedding, qkv, proj, MLP),
    the merger per merged token, attention over each whole frame (QK^T and AV, 4 D n^2)."""
    v = args.vision
    d, f, m = v.hidden_size, v.intermediate_size, v.hidden_size * v.spatial_merge_size**2
    patches = sum(t * h * w for t, h, w in grids)
    per_patch = v.patch_dim * d + v.depth * (4 * d * d + 2 * d * f)
    per_token = m * m + m * v.out_hidden_size
    attention = v.depth * sum(4 * d * (h * w) ** 2 * t for t, h, w in grids)
    forward = 2 * per_patch * patches + 2 * per_token * patches // v.spatial_merge_size**2 + attention
    return forward * (3 if trained else 1)


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


BF16 = False  # the :bf16 flag: weights in bf16, built so, and plain SGD (no optimizer state), for both


def build_transformers(name: str, ac: bool, train_tower: bool = False):
    import transformers

    cfg = hf_dict(name)
    config = transformers.AutoConfig.for_model(cfg["model_type"], **{k: v for k, v in cfg.items() if k != "model_type"})
    vlm = "vision_config" in cfg
    with torch.device(DEVICE), default_dtype(torch.bfloat16 if BF16 else torch.float32):
        # GPT-OSS's sinks are not in transformers' sdpa path; its flex path has them
        attn = "flex_attention" if cfg["model_type"] == "gpt_oss" else "sdpa"
        auto = transformers.AutoModelForImageTextToText if vlm else transformers.AutoModelForCausalLM
        model = auto.from_config(config, attn_implementation=attn)
    model.config.use_cache = False
    if vlm:
        model.model.visual.requires_grad_(train_tower)
    if ac:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()

    def step(ids, pos, **images):
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            if images:  # one document: its 3-axis positions computed by the model from the image tokens
                types = (ids == cfg["image_token_id"]).int()
                return model(input_ids=ids, labels=ids, mm_token_type_ids=types, **images).loss
            return model(input_ids=ids, position_ids=pos, labels=ids).loss

    return model, step


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def build_ours(
    name: str,
    ac: bool,
    compile_layers: bool,
    attn: str = "auto",
    lora_rank: int = 0,
    train_tower: bool = False,
    fp8: str | None = None,
):
    args = our_args(name)
    args.freeze_vision = not train_tower
    with torch.device(DEVICE), default_dtype(torch.bfloat16 if BF16 else torch.float32):
        model = Transformer(args, attn_backend=attn)
        model.init_weights()
    if lora_rank:  # the trainer's adapters (primerl_trainer.lora) on every attention and MLP projection
        from types import SimpleNamespace

        from primerl_trainer.lora import apply_lora

        apply_lora(
            model,
            SimpleNamespace(
                rank=lora_rank,
                alpha=2.0 * lora_rank,
                dropout=0.0,
                targets=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
            ),
        )
    if fp8:  # the trainer's conversion (trainer.precision = "fp8"; needs torchao), before AC and compile as there
        from primerl_trainer.precision import convert_to_fp8

        recipe, large_only = FP8_RUNS[fp8]
        convert_to_fp8(model, recipe=recipe, large_only=large_only)
    if ac:  # the trainer's own wrapper (needs primerl-trainer's dependencies: msgspec)
        from primerl_trainer.placement import apply_activation_checkpointing

        apply_activation_checkpointing(model)
    if compile_layers:
        for layer in model.layers:
            layer.compile()
    model.train()

    def step(ids, pos, **images):
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            hidden = model(ids, pos, **images)[0, :-1].to(torch.bfloat16)
            if LOSS_IN_FORWARD:  # the NLL's gradients computed in the forward (trainer.loss_in_forward)
                n = hidden.shape[0]
                return chunked_token_loss(hidden, model.output_weight, ids[0, 1:], lambda pi, s, e: -pi / n)[0]
            logprobs, _ = chunked_logprobs(hidden, model.output_weight, ids[0, 1:], keep_logits=KEEP_LOGITS)
        return -logprobs.mean()

    return model, step


# The :fp8 flags: the decoder layers' projections as torchao Float8Linear (primerl_trainer.precision),
# flag -> (recipe, large_only). fp8 is what trainer.precision = "fp8" does; fp8gw keeps the weight
# gradient in bf16; fp8big converts only the layers torchao measured as faster in FP8 on an H100.
# (fp8gw runs on CUDA only: torchao's Float8Linear follows CUDA's autocast alone, and the CPU's
# bf16 activations then meet fp32 weights in its bf16 weight-gradient matmul.)
FP8_RUNS = {
    "fp8": ("rowwise", False),
    "fp8gw": ("rowwise_with_gw_hp", False),
    "fp8big": ("rowwise", True),
    "fp8tw": ("tensorwise", False),
}

PROFILE = False
KEEP_LOGITS = False  # the :keep flag: chunked_logprobs keeps the logits (trainer.keep_logits)
LOSS_IN_FORWARD = False  # the :lossfwd flag: chunked_token_loss (trainer.loss_in_forward)


HOST_PROFILE = False  # --host-profile
TRACE: str | None = None  # --trace: a gzipped Chrome trace of one step, host and GPU (bench/trace_gaps.py reads it)


def profile_step(run_step) -> None:
    """Print the top CUDA kernels of one step (after warm-up); with --trace, write that step's
    host and GPU timeline too, and list the step's host syncs (each one lets the GPU run dry)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = DEVICE == "cuda"
    activities = [ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]
    if TRACE:
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        run_step()
        sync()
    print(
        prof.key_averages().table(
            sort_by="cuda_time_total" if cuda else "cpu_time_total", row_limit=45, max_name_column_width=90
        )
    )
    if TRACE:
        import gzip
        import os
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            prof.export_chrome_trace(os.path.join(tmp, "trace.json"))
            with open(os.path.join(tmp, "trace.json"), "rb") as src, gzip.open(TRACE, "wb") as dst:
                dst.write(src.read())
        if cuda:
            syncs_of_step(run_step)


def host_profile(run_step) -> None:
    """Print where one step's host time goes (cProfile: the functions by own time and by time
    inside them); where the host is slower than the GPU, the GPU waits."""
    import cProfile
    import pstats

    sync()
    prof = cProfile.Profile()
    prof.enable()
    run_step()
    prof.disable()
    sync()
    stats = pstats.Stats(prof)
    stats.sort_stats("tottime").print_stats(40)
    stats.sort_stats("cumulative").print_stats(60)


def syncs_of_step(run_step) -> None:
    """Run one more step with torch's sync debug mode on and print where each host sync came from."""
    import traceback
    import warnings

    seen: dict[str, int] = {}

    def show(message, category, filename, lineno, file=None, line=None):
        stack = "".join(traceback.format_stack(limit=12)[:-2])
        seen[stack] = seen.get(stack, 0) + 1

    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():  # restores showwarning on leaving
            warnings.simplefilter("always")
            warnings.showwarning = show
            run_step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    sync()
    print(f"host syncs in one step: {sum(seen.values())} at {len(seen)} places")
    for stack, count in seen.items():
        print(f"--- {count}x\n{stack}")


def image_row(name: str, seq: int, g: torch.Generator) -> tuple[torch.Tensor, dict]:
    """A row of `seq` tokens holding the shape's images, each after an equal run of random text
    (the rest of the text after the last), and their random patches: (input_ids [1, seq],
    {pixel_values, image_grid_thw})."""
    cfg = hf_dict(name)
    vision, image = cfg["vision_config"], cfg["image_token_id"]
    merge, patch = vision.get("spatial_merge_size", 2), vision.get("patch_size", 16)
    width = vision.get("in_channels", 3) * vision.get("temporal_patch_size", 2) * patch * patch
    grids = IMAGES[name]
    tokens = [t * h * w // merge**2 for t, h, w in grids]
    text = seq - sum(tokens)
    if text < len(grids) + 1:
        raise ValueError(f"{name}: {seq} tokens cannot hold its {len(grids)} images ({sum(tokens)} image tokens)")
    ids = torch.randint(0, cfg["text_config"]["vocab_size"], (seq,), device=DEVICE, generator=g)
    ids[ids == image] = 0  # text tokens only, then the images' runs
    run, start = text // (len(grids) + 1), 0
    for n in tokens:
        start += run
        ids[start : start + n] = image
        start += n
    pixels = torch.randn(sum(t * h * w for t, h, w in grids), width, device=DEVICE, generator=g)
    return ids[None], {"pixel_values": pixels, "image_grid_thw": torch.tensor(grids, device=DEVICE)}


def measure(model, step, seq: int, steps: int, docs: int = 1, vocab: int = VOCAB, name: str | None = None) -> dict:
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=1e-5, foreach=True) if BF16 else torch.optim.AdamW(params, lr=1e-5, fused=True)
    g = torch.Generator(device=DEVICE).manual_seed(0)
    if name in IMAGES:
        if docs != 1:
            raise ValueError("a row with images is one document here (transformers' positions are per row)")
        ids, images = image_row(name, seq, g)
    else:
        ids, images = torch.randint(0, vocab, (1, seq), device=DEVICE, generator=g), {}
    bounds = torch.linspace(0, seq, docs + 1).long().tolist()
    pos = torch.cat([torch.arange(b - a) for a, b in zip(bounds, bounds[1:])])[None].to(DEVICE)
    if DEVICE == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times, losses = [], []

    def one_step():
        loss = step(ids, pos, **images)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    for i in range(steps + 3):  # 3 warm-up steps (compilation, allocator)
        sync()
        t0 = time.perf_counter()
        loss = one_step()
        sync()
        if i >= 3:
            times.append(time.perf_counter() - t0)
        losses.append(float(loss.detach()))
    if PROFILE:
        profile_step(one_step)
    if HOST_PROFILE:
        host_profile(one_step)
    return {
        "s_per_step": statistics.median(times),
        "tokens_per_s": seq / statistics.median(times),
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if DEVICE == "cuda" else float("nan"),
        "first_loss": losses[0],
        "last_loss": losses[-1],
    }


def run(
    name: str,
    impl: str,
    steps: int,
    ac: bool,
    compile_layers: bool,
    docs: int = 1,
    cudnn: bool = False,
    seq: int | None = None,
    lora_rank: int = 0,
    train_tower: bool = False,
    fp8: str | None = None,
) -> dict:
    seq = seq or SHAPES[name][2]
    model = step = None
    # cudnn: SDPA may not pick flash or memory-efficient kernels, which leaves cuDNN's.
    torch.backends.cuda.enable_flash_sdp(not cudnn)
    torch.backends.cuda.enable_mem_efficient_sdp(not cudnn)
    try:
        if impl == "transformers":
            model, step = build_transformers(name, ac, train_tower)
        else:
            model, step = build_ours(name, ac, compile_layers, lora_rank=lora_rank, train_tower=train_tower, fp8=fp8)
        result = measure(model, step, seq, steps, docs, our_args(name).vocab_size, name)
    except torch.OutOfMemoryError:
        result = {"oom": True}
    finally:
        model = step = None
        gc.collect()
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    args = our_args(name)
    images = {}
    flops = flops_per_token(args, seq) * seq
    if name in IMAGES:
        grids, merge = IMAGES[name], args.vision.spatial_merge_size
        images = {
            "tower": "trained" if train_tower else "frozen",
            "images": [list(g) for g in grids],
            "image_tokens": sum(t * h * w for t, h, w in grids) // merge**2,
            "patches": sum(t * h * w for t, h, w in grids),
        }
        flops += vision_flops(args, grids, train_tower)
    if "tokens_per_s" in result:
        result["mfu"] = result["tokens_per_s"] * flops / seq / PEAK_FLOPS
    return {
        "model": name,
        "impl": impl,
        "seq": seq,
        "ac": ac,
        "compile": compile_layers,
        "docs": docs,
        "cudnn": cudnn,
        **images,
        **result,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    # qwen3-30b-a3b (48 layers) is for several GPUs; the tiny shape for --device cpu
    default = [n for n in SHAPES if n not in ("qwen3-30b-a3b", "qwen3.5-vl-tiny") and not n.startswith("glm-5")]
    parser.add_argument("--models", default=",".join(default))
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    parser.add_argument("--profile", action="store_true", help="print the top kernels of one step")
    parser.add_argument("--host-profile", action="store_true", help="print where one step's host time goes (cProfile)")
    parser.add_argument(
        "--trace",
        default=None,
        help="with --profile: write one step's host + GPU timeline here "
        "(gzipped Chrome trace, {run} in the path replaced by the run's flags; bench/trace_gaps.py) "
        "and list its host syncs",
    )
    parser.add_argument("--tf32", action="store_true", help="fp32 matmuls on TF32 tensor cores (torch's global switch)")
    parser.add_argument("--seq", type=int, default=None, help="tokens in the row (default: the shape's)")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="override a config.json field of every shape run (a JSON value), e.g. n_routed_experts=64; "
        "the rows record it",
    )
    parser.add_argument(
        "--runs",
        default="transformers,ours",
        help="comma list of impl[:ac][:eager][:cudnn][:docsN][:loraR][:tower][:torchgdn][:keep][:lossfwd][:bf16][:fp8], e.g. "
        "transformers:ac,ours,ours:docs8,ours:lora16,ours:tower (tower: the vision tower trained, "
        "not frozen; torchgdn: Gated DeltaNet in the fp32 torch form, not fla's kernels; keep: the logits kept "
        "for the backward, not recomputed; lossfwd: the loss's gradients computed in the forward, chunk by chunk (trainer.loss_in_forward); bf16: weights in bf16 and plain SGD, for shapes whose fp32 weights "
        "and AdamW states do not fit; fp8: ours with trainer.precision = fp8's FP8 projections, fp8gw the same with "
        "the weight gradient in bf16, fp8big only the large projections; MFU stays against the bf16 peak)",
    )
    parser.add_argument(
        "--device",
        default="cuda",
        choices=["cuda", "cpu"],
        help="cpu: check the code path (tiny shapes, :eager runs); no memory, timings mean nothing",
    )
    args = parser.parse_args()
    global PROFILE, DEVICE, KEEP_LOGITS, LOSS_IN_FORWARD, TRACE, HOST_PROFILE, BF16
    PROFILE = args.profile
    HOST_PROFILE = args.host_profile
    TRACE = args.trace
    DEVICE = args.device
    torch.backends.cuda.matmul.allow_tf32 = args.tf32
    # fla's kernels where installed (transformers' Qwen3.5 takes them too), with primerl's
    # replacement for the one fla refuses on Hopper with this Triton (gated_delta.py), registered now
    fla = DEVICE == "cuda" and gated_delta.available()
    overrides = {}
    for item in args.set:
        field, _, raw = item.partition("=")
        overrides[field] = json.loads(raw)
    for name in args.models.split(","):
        model_type, fields, seq_len = SHAPES[name]
        SHAPES[name] = (model_type, fields | overrides, seq_len)
    rows = []
    for name in args.models.split(","):
        for spec in args.runs.split(","):
            impl, *flags = spec.split(":")
            docs = next((int(f[4:]) for f in flags if f.startswith("docs")), 1)
            lora = next((int(f[4:]) for f in flags if f.startswith("lora")), 0)
            # torchgdn: Gated DeltaNet layers through the exact fp32 chunked form, not fla's kernels
            gated_deltanet.FAST_KERNELS = "torchgdn" not in flags
            KEEP_LOGITS = "keep" in flags
            LOSS_IN_FORWARD = "lossfwd" in flags
            if LOSS_IN_FORWARD and impl != "ours":
                raise SystemExit(f"--runs {spec}: :lossfwd is for ours (transformers computes its own loss)")
            BF16 = "bf16" in flags
            fp8 = next((f for f in flags if f in FP8_RUNS), None)
            if fp8 and impl != "ours":
                raise SystemExit(f"--runs {spec}: :{fp8} is for ours (transformers' models are not converted)")
            TRACE = args.trace and args.trace.replace("{run}", spec.replace(":", "-"))
            row = run(
                name,
                impl,
                args.steps,
                ac="ac" in flags,
                compile_layers=impl == "ours" and "eager" not in flags,
                docs=docs,
                cudnn="cudnn" in flags,
                seq=args.seq,
                lora_rank=lora,
                train_tower="tower" in flags,
                fp8=fp8,
            )
            row["precision"] = fp8 or "bf16"
            row["gdn"] = "fla" if fla and "torchgdn" not in flags else "torch"
            row["keep_logits"] = KEEP_LOGITS
            row["loss_in_forward"] = LOSS_IN_FORWARD
            row["weights"] = "bf16 + SGD" if BF16 else "fp32 + AdamW"
            row["lora_rank"] = lora
            row["tf32"] = args.tf32
            if overrides:
                row["overrides"] = overrides
            rows.append(row)
            print(json.dumps(row), flush=True)
    print()
    print(
        f"{'model':<18} {'impl':<13} {'prec':<6} {'AC':<3} {'attn':<6} {'gdn':<5} {'keep':<4} {'docs':>4} {'tower':<7} {'tokens/s':>9} {'MFU':>6} "
        f"{'peak GiB':>9} {'vs transformers':>16} {'vs ours bf16':>13}"
    )
    for r in rows:
        ref = next(
            (
                x
                for x in rows
                if x["model"] == r["model"]
                and x["impl"] == "transformers"
                and x.get("tower") == r.get("tower")
                and "tokens_per_s" in x
            ),
            None,
        )  # the first
        # the first bf16 run of ours on the model (the reference of the :fp8 runs)
        ours = next(
            (
                x
                for x in rows
                if x["model"] == r["model"]
                and x["impl"] == "ours"
                and x.get("precision") == "bf16"
                and "tokens_per_s" in x
            ),
            None,
        )
        attn = "cudnn" if r["cudnn"] else "auto"
        head = (
            f"{r['model']:<18} {r['impl']:<13} {r.get('precision', 'bf16'):<6} {'y' if r['ac'] else 'n':<3} {attn:<6} {r['gdn']:<5} {'fwd' if r.get('loss_in_forward') else 'y' if r.get('keep_logits') else 'n':<4} {r['docs']:>4} "
            f"{r.get('tower', '-'):<7}"
        )
        if "tokens_per_s" not in r:
            print(f"{head} {'OOM':>9}")
            continue
        ratio = f"{r['tokens_per_s'] / ref['tokens_per_s']:.2f}x" if ref else "-"
        vs_ours = f"{r['tokens_per_s'] / ours['tokens_per_s']:.2f}x" if ours and r["impl"] == "ours" else "-"
        print(f"{head} {r['tokens_per_s']:>9.0f} {r['mfu']:>6.1%} {r['peak_gib']:>9.1f} {ratio:>16} {vs_ours:>13}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
