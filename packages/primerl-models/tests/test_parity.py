"""Our models against transformers' own implementations with the same weights (CPU, fp32): two
or more tiny configs per family that switch its options on and off, saved by transformers'
own save_pretrained (routers' correction biases drawn non-zero, so that they change the
choice of experts)."""

import pytest
import torch
import transformers
from primerl_models import load_model
from primerl_models.testing import save_transformers

LAGUNA_ROPE = {
    "full_attention": {"rope_type": "default", "rope_theta": 500000.0, "partial_rotary_factor": 0.5},
    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0},
}
COMMON = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    head_dim=16,
    initializer_range=0.2,
    rms_norm_eps=1e-6,
)
CASES = {
    "llama-gqa-untied": (transformers.LlamaConfig, dict(num_key_value_heads=2, tie_word_embeddings=False)),
    "llama-mha-tied-llama3-rope": (
        transformers.LlamaConfig,
        dict(
            num_key_value_heads=4,
            tie_word_embeddings=True,
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=500000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=16,
            ),
        ),
    ),
    "qwen3-gqa-tied": (transformers.Qwen3Config, dict(num_key_value_heads=2, tie_word_embeddings=True)),
    "qwen3-untied-bias": (transformers.Qwen3Config, dict(num_key_value_heads=1, attention_bias=True)),
    "qwen3moe-top2-norm": (
        transformers.Qwen3MoeConfig,
        dict(
            num_key_value_heads=2,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        ),
    ),
    "qwen3moe-top3-unnormed-mixed-layers": (
        transformers.Qwen3MoeConfig,
        dict(
            num_key_value_heads=2,
            num_experts=6,
            num_experts_per_tok=3,
            moe_intermediate_size=32,
            norm_topk_prob=False,
            decoder_sparse_step=1,
            mlp_only_layers=[0],
        ),
    ),
    # GLM-4.5: dense first layer, sigmoid router with correction bias, 2 groups of which the
    # best 1 is searched, shared expert, scaling, per-head qk-norm, q/k/v bias, half RoPE.
    "glm4moe-groups-shared-qknorm-bias": (
        transformers.Glm4MoeConfig,
        dict(
            num_hidden_layers=3,
            num_key_value_heads=2,
            n_routed_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            n_shared_experts=1,
            first_k_dense_replace=1,
            n_group=2,
            topk_group=1,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            use_qk_norm=True,
            attention_bias=True,
            partial_rotary_factor=0.5,
        ),
    ),
    # ... and the other way: no dense layer, one group, two shared experts' width, no
    # renormalisation, no qk-norm, no bias, full RoPE.
    "glm4moe-flat-unnormed-full-rope": (
        transformers.Glm4MoeConfig,
        dict(
            num_key_value_heads=4,
            n_routed_experts=6,
            num_experts_per_tok=3,
            moe_intermediate_size=32,
            n_shared_experts=2,
            first_k_dense_replace=0,
            n_group=1,
            topk_group=1,
            routed_scaling_factor=1.0,
            norm_topk_prob=False,
            use_qk_norm=False,
            attention_bias=False,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=1.0),
        ),
    ),
    # MiniMax-M2: qk RMSNorm over the whole projection, partial rotary, sigmoid router with
    # correction bias. (Released configs say `rotary_dim`, which transformers reads only from
    # 5.19 on: before, it rotated whole heads. The factor means the same to every version.)
    "minimax-m2-partial-rope": (
        transformers.MiniMaxM2Config,
        dict(
            num_key_value_heads=2,
            num_local_experts=4,
            num_experts_per_tok=2,
            rope_parameters=dict(rope_type="default", rope_theta=5e6, partial_rotary_factor=0.5),
        ),
    ),
    "minimax-m2-full-rope-mha-top3": (
        transformers.MiniMaxM2Config,
        dict(
            num_key_value_heads=4,
            num_local_experts=6,
            num_experts_per_tok=3,
            rope_parameters=dict(rope_type="default", rope_theta=5e6, partial_rotary_factor=1.0),
        ),
    ),
    # GLM-4 dense: interleaved partial RoPE, sandwich norms, fused gate/up, q/k/v bias.
    "glm4-half-rope-bias": (
        transformers.Glm4Config,
        dict(num_key_value_heads=2, attention_bias=True, partial_rotary_factor=0.5, pad_token_id=0),
    ),
    "glm4-full-rope-tied-nobias": (
        transformers.Glm4Config,
        dict(
            num_key_value_heads=1,
            attention_bias=False,
            tie_word_embeddings=True,
            pad_token_id=0,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=1.0),
        ),
    ),
    # GPT-OSS: sinks, 4-token sliding windows on alternate layers (the documents are 40 long),
    # YaRN over an original context of 16 positions, biases everywhere (drawn non-zero), a
    # clamp low enough to cut the experts' pre-activations.
    "gptoss-sliding-full-yarn-sinks": (
        transformers.GptOssConfig,
        dict(
            num_key_value_heads=2,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=4,
            layer_types=["sliding_attention", "full_attention"],
            attention_bias=True,
            swiglu_limit=0.3,
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=150000.0,
                factor=4.0,
                beta_fast=32.0,
                beta_slow=1.0,
                truncate=False,
                original_max_position_embeddings=16,
            ),
        ),
    ),
    # ... and all-sliding 6-token windows, one kv head, no attention bias, plain RoPE, top-3.
    "gptoss-all-sliding-mqa-nobias-top3": (
        transformers.GptOssConfig,
        dict(
            num_hidden_layers=3,
            num_key_value_heads=1,
            num_local_experts=6,
            num_experts_per_tok=3,
            sliding_window=6,
            layer_types=["sliding_attention"] * 3,
            attention_bias=False,
            swiglu_limit=7.0,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0),
        ),
    ),
    # Trinity: sliding layers with 4-token windows and RoPE, a global layer without positions,
    # sigmoid output gates, sandwich norms (drawn away from 1), a dense first layer, expert
    # bias (drawn non-zero), one shared expert, route scale, muP embedding scale ...
    "afmoe-nope-global-gates-mup": (
        transformers.AfmoeConfig,
        dict(
            num_hidden_layers=3,
            num_key_value_heads=2,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            num_shared_experts=1,
            num_dense_layers=1,
            route_scale=2.5,
            sliding_window=4,
            mup_enabled=True,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        ),
    ),
    # ... and every layer MoE, the global layer first, one kv head, two shared experts' width,
    # top-3 of 6, tied embeddings, attention biases, no muP.
    "afmoe-all-moe-mqa-tied-bias": (
        transformers.AfmoeConfig,
        dict(
            num_key_value_heads=1,
            num_experts=6,
            num_experts_per_tok=3,
            moe_intermediate_size=32,
            num_shared_experts=2,
            num_dense_layers=0,
            route_scale=1.0,
            sliding_window=6,
            mup_enabled=False,
            layer_types=["full_attention", "sliding_attention"],
            tie_word_embeddings=True,
            attention_bias=True,
        ),
    ),
    # Laguna: a head count per layer, RoPE per layer type (half of each head rotating on the
    # full layer, theta 5e5; all of it on the sliding ones), 4-token windows, a softplus gate per
    # head, a soft-capped sigmoid router with correction bias, a shared expert, routed scaling ...
    "laguna-heads-per-layer-softcap-headgate": (
        transformers.LagunaConfig,
        dict(
            num_hidden_layers=3,
            num_key_value_heads=2,
            num_attention_heads_per_layer=[4, 2, 6],
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            sliding_window=4,
            layer_types=["full_attention", "sliding_attention", "sliding_attention"],
            gating=True,
            mlp_layer_types=["dense", "sparse", "sparse"],
            moe_routed_scaling_factor=2.5,
            moe_router_logit_softcapping=1.5,
            rope_parameters=LAGUNA_ROPE,
        ),
    ),
    # ... and a gate per element, the MoE layer first, one kv head, biases, tied embeddings,
    # no soft-cap, top-3 of 6.
    "laguna-elementgate-mqa-tied-bias": (
        transformers.LagunaConfig,
        dict(
            num_key_value_heads=1,
            num_attention_heads_per_layer=[2, 4],
            num_experts=6,
            num_experts_per_tok=3,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
            sliding_window=6,
            layer_types=["sliding_attention", "full_attention"],
            gating=False,
            mlp_layer_types=["sparse", "dense"],
            moe_routed_scaling_factor=1.0,
            moe_router_logit_softcapping=0.0,
            attention_bias=True,
            tie_word_embeddings=True,
            rope_parameters=LAGUNA_ROPE,
        ),
    ),
}


def hf_checkpoint(case: str, folder, shard: str | None = None):
    config_cls, extra = CASES[case]
    return save_transformers(
        config_cls(**{**COMMON, **extra}),
        folder,
        shard,
        router_bias_std=0.1,
        bias_std=0.2 if case.startswith(("gptoss", "afmoe", "laguna")) else 0.0,
        norm_std=0.2 if case.startswith(("afmoe", "laguna")) else 0.0,
    )


@pytest.mark.parametrize("case", CASES)
def test_logits_match_transformers(case, tmp_path):
    hf = hf_checkpoint(case, tmp_path)
    ours = load_model(tmp_path).eval()
    ids = torch.randint(0, COMMON["vocab_size"], (2, 40), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(40).expand(2, 40)
    with torch.no_grad():
        expected = hf(input_ids=ids, position_ids=pos).logits
        got = ours.logits(ids, pos)
    assert expected.std() > 0.1  # logits large enough for the tolerance to mean something
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    "case",
    [
        "qwen3-gqa-tied",
        "qwen3moe-top2-norm",
        "glm4moe-groups-shared-qknorm-bias",
        "minimax-m2-partial-rope",
        "glm4-half-rope-bias",
        "gptoss-sliding-full-yarn-sinks",
        "afmoe-nope-global-gates-mup",
        "laguna-heads-per-layer-softcap-headgate",
    ],
)
def test_packed_row_equals_each_sequence_alone(case, tmp_path):
    hf_checkpoint(case, tmp_path)
    ours = load_model(tmp_path).eval()
    lengths = [7, 13, 4]
    seqs = [torch.randint(0, COMMON["vocab_size"], (1, n), generator=torch.Generator().manual_seed(n)) for n in lengths]
    packed_ids = torch.cat(seqs, dim=1)
    packed_pos = torch.cat([torch.arange(n) for n in lengths])[None]
    with torch.no_grad():
        packed = ours.logits(packed_ids, packed_pos)
        alone = torch.cat([ours.logits(s, torch.arange(s.shape[1])[None]) for s in seqs], dim=1)
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=0)
    # And the packing mattered: treating the row as one sequence gives other logits.
    with torch.no_grad():
        unpacked = ours.logits(packed_ids, torch.arange(packed_ids.shape[1])[None])
    assert (unpacked[:, lengths[0] :] - alone[:, lengths[0] :]).abs().max() > 1e-2


@pytest.mark.parametrize(
    "case, experts, top_k, moe_layers",
    [
        ("qwen3moe-top2-norm", 4, 2, 2),
        ("glm4moe-groups-shared-qknorm-bias", 8, 2, 2),  # 3 layers, the first dense
        ("minimax-m2-partial-rope", 4, 2, 2),
        ("gptoss-all-sliding-mqa-nobias-top3", 6, 3, 3),
    ],
)
def test_moe_counts_tokens_per_expert(case, experts, top_k, moe_layers, tmp_path):
    hf_checkpoint(case, tmp_path)
    ours = load_model(tmp_path).eval()
    with torch.no_grad():
        ours(torch.randint(0, 96, (1, 30)), torch.arange(30)[None])
    stats = ours.moe_stats()
    assert stats.shape == (moe_layers, experts)
    assert stats.sum(dim=1).tolist() == [30.0 * top_k] * moe_layers  # every token to top_k experts, per MoE layer
    ours.reset_moe_stats()
    assert ours.moe_stats().sum() == 0
