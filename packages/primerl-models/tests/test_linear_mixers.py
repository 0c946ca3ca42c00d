"""Mixers with a recurrent state (Gated DeltaNet: Qwen3.5, Qwen3.5-MoE; Mamba2: Nemotron-H)
against transformers and against the recurrence itself (CPU).

transformers' torch fallback does not restart the state inside a row, so each document of our
packed row is compared with transformers on that document alone. Documents are longer than
the conv kernel and several span more than one 64-token chunk, so the chunk hand-over and the
reset at a document that starts inside a row both matter.
"""

import pytest
import torch
import torch.nn.functional as F
import transformers
from primerl_models import PackedSeqs, carried_tensors, load_model, read_config, save_hf
from primerl_models.blocks.gated_deltanet import gated_delta_rule
from primerl_models.blocks.mamba2 import ssd_scan
from primerl_models.blocks.recurrent import causal_conv
from primerl_models.families import FAMILIES
from primerl_models.families.base import TinyShape
from primerl_models.packing import doc_positions
from primerl_models.testing import qwen35_draw, save_transformers, save_with_mtp
from safetensors.torch import load_file

# initializer_range 0.1 (0.2 in test_parity.py): with 3-4 layers of 0.2 the logits' own fp32
# rounding (ours and transformers' alike, against our fp64 run) reaches 1e-4, the tolerance.
COMMON = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    head_dim=16,
    initializer_range=0.1,
    rms_norm_eps=1e-6,
)
CASES = {
    # 3 DeltaNet layers to 1 full (the released ratio), 2 key heads serving 4 value heads, value
    # heads wider than key heads, half-rotary GQA attention, untied.
    "qwen35-3to1-grouped-heads": (
        transformers.Qwen3_5TextConfig,
        dict(
            num_hidden_layers=4,
            num_key_value_heads=2,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=8,
            linear_value_head_dim=16,
            linear_conv_kernel_dim=4,
            layer_types=["linear_attention"] * 3 + ["full_attention"],
            rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5),
        ),
    ),
    # full attention first, equal key and value heads, a kernel of 3, the default quarter RoPE, tied.
    "qwen35-full-first-equal-heads-tied": (
        transformers.Qwen3_5TextConfig,
        dict(
            num_hidden_layers=3,
            num_key_value_heads=1,
            linear_num_key_heads=3,
            linear_num_value_heads=3,
            linear_key_head_dim=16,
            linear_value_head_dim=8,
            linear_conv_kernel_dim=3,
            tie_word_embeddings=True,
            layer_types=["full_attention", "linear_attention", "linear_attention"],
        ),
    ),
    # MoE: top-2 of 4 with the gated shared expert.
    "qwen35moe-top2-shared": (
        transformers.Qwen3_5MoeTextConfig,
        dict(
            num_hidden_layers=2,
            num_key_value_heads=2,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            layer_types=["linear_attention", "full_attention"],
        ),
    ),
    # top-3 of 6, 3 layers, one key head for 2 value heads.
    "qwen35moe-top3-one-key-head": (
        transformers.Qwen3_5MoeTextConfig,
        dict(
            num_hidden_layers=3,
            num_key_value_heads=4,
            linear_num_key_heads=1,
            linear_num_value_heads=2,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            num_experts=6,
            num_experts_per_tok=3,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
            layer_types=["linear_attention", "linear_attention", "full_attention"],
        ),
    ),
    # Nemotron-H: every block kind (Mamba2 with 2 groups of 4 heads, MoE with the shared
    # expert and a non-zero correction bias, attention without positions, a ReLU^2 MLP).
    "nemotronh-all-kinds-groups": (
        transformers.NemotronHConfig,
        dict(
            layers_block_type=["linear_attention", "moe", "full_attention", "mlp"],
            num_key_value_heads=2,
            mamba_num_heads=8,
            mamba_head_dim=8,
            ssm_state_size=16,
            n_groups=2,
            conv_kernel=4,
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            moe_shared_expert_intermediate_size=48,
            n_group=1,
            topk_group=1,
        ),
    ),
    # ... one group, a kernel of 3 without bias, MHA first, 6 experts top-3 in 2 groups, scaled,
    # not renormalised, two Mamba2 layers; tie_word_embeddings set, which transformers' Nemotron-H
    # ignores (it never ties), and so must we.
    "nemotronh-one-group-nobias-tied": (
        transformers.NemotronHConfig,
        dict(
            layers_block_type=["full_attention", "linear_attention", "moe", "linear_attention", "mlp"],
            num_key_value_heads=4,
            mamba_num_heads=4,
            mamba_head_dim=16,
            ssm_state_size=8,
            n_groups=1,
            conv_kernel=3,
            use_conv_bias=False,
            n_routed_experts=6,
            num_experts_per_tok=3,
            moe_intermediate_size=32,
            moe_shared_expert_intermediate_size=32,
            n_group=2,
            topk_group=1,
            routed_scaling_factor=2.0,
            norm_topk_prob=False,
            tie_word_embeddings=True,
        ),
    ),
    # Nemotron 3 Super's latent experts (LatentMoE): 8 experts top-3 in a latent of 24 (of 64),
    # between fc1_latent_proj and fc2_latent_proj; the router and the shared expert on the full
    # width; two MoE layers, Super's routed_scaling_factor of 5.
    "nemotronh-latent-experts": (
        transformers.NemotronHConfig,
        dict(
            layers_block_type=["linear_attention", "moe", "full_attention", "moe"],
            num_key_value_heads=2,
            mamba_num_heads=8,
            mamba_head_dim=8,
            ssm_state_size=16,
            n_groups=2,
            conv_kernel=4,
            n_routed_experts=8,
            num_experts_per_tok=3,
            moe_intermediate_size=32,
            moe_shared_expert_intermediate_size=48,
            moe_latent_size=24,
            n_group=1,
            topk_group=1,
            routed_scaling_factor=5.0,
        ),
    ),
}
LENGTHS = [70, 5, 130]  # 2, 1 and 3 chunks of 64


def realistic_draws(model):
    """Every parameter drawn as trained weights are (primerl_models.testing.qwen35_draw)."""
    for name, p in model.named_parameters():
        qwen35_draw(name, p)


def hf_checkpoint(case, folder, shard=None):
    config_cls, extra = CASES[case]
    if case.startswith("nemotronh"):  # plain norms: drawn around 1; routers' correction biases non-zero
        return save_transformers(config_cls(**{**COMMON, **extra}), folder, shard, router_bias_std=0.1, norm_std=0.2)
    return save_transformers(config_cls(**{**COMMON, **extra}), folder, shard, adjust=realistic_draws)


def packed(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    docs = [torch.randint(0, COMMON["vocab_size"], (1, n), generator=g) for n in lengths]
    return docs, torch.cat(docs, dim=1), torch.cat([torch.arange(n) for n in lengths])[None]


@pytest.mark.parametrize("case", CASES)
def test_each_document_of_a_packed_row_matches_transformers_alone(case, tmp_path):
    hf = hf_checkpoint(case, tmp_path)
    ours = load_model(tmp_path).eval()
    docs, ids, pos = packed(LENGTHS)
    with torch.no_grad():
        got = ours.logits(ids, pos)
        expected = torch.cat([hf(input_ids=d).logits for d in docs], dim=1)
    assert expected.std() > 0.1
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
    # The resets mattered: the row read as one document gives other logits after the first.
    with torch.no_grad():
        unpacked = ours.logits(ids, torch.arange(ids.shape[1])[None])
    assert (unpacked[:, LENGTHS[0] :] - expected[:, LENGTHS[0] :]).abs().max() > 1e-2


def naive_delta_rule(q, k, v, g, beta, lengths):
    """The recurrence token by token, each document from a zero state (fp64 oracle)."""
    out, start = [], 0
    for n in lengths:
        state = q.new_zeros(q.shape[1], q.shape[2], v.shape[2])  # [H, K, V]
        for t in range(start, start + n):
            state = state * g[t].exp()[:, None, None]
            kv = torch.einsum("hk,hkv->hv", k[t], state)
            state = state + torch.einsum("hk,hv->hkv", k[t], (v[t] - kv) * beta[t][:, None])
            out.append(torch.einsum("hk,hkv->hv", q[t], state))
        start += n
    return torch.stack(out)


def test_chunked_scan_equals_the_recurrence_with_its_gradients():
    torch.manual_seed(0)
    lengths = [70, 1, 64, 129]  # a one-token document, one exactly a chunk long
    n, h, kd, vd = sum(lengths), 3, 8, 5
    q = F.normalize(torch.randn(n, h, kd, dtype=torch.float64), dim=-1).requires_grad_()
    k = F.normalize(torch.randn(n, h, kd, dtype=torch.float64), dim=-1).requires_grad_()
    v = torch.randn(n, h, vd, dtype=torch.float64, requires_grad=True)
    g = (-torch.rand(n, h, dtype=torch.float64) * 0.5).requires_grad_()  # decays in (exp(-0.5), 1]
    beta = torch.rand(n, h, dtype=torch.float64, requires_grad=True)
    seqs = PackedSeqs.from_position_ids(torch.cat([torch.arange(m) for m in lengths])[None])
    got = gated_delta_rule(q, k, v, g, beta, seqs)
    ref = naive_delta_rule(q, k, v, g, beta, lengths)
    torch.testing.assert_close(got, ref, atol=1e-10, rtol=0)
    weights = torch.randn_like(ref)
    grads = torch.autograd.grad((got * weights).sum(), (q, k, v, g, beta))
    ref_grads = torch.autograd.grad((ref * weights).sum(), (q, k, v, g, beta))
    for name, a, b in zip("q k v g beta".split(), grads, ref_grads):
        torch.testing.assert_close(a, b, atol=1e-9, rtol=0, msg=name)


def test_causal_conv_restarts_at_each_document():
    torch.manual_seed(0)
    lengths, c, kernel = [6, 2, 9], 5, 4
    x = torch.randn(sum(lengths), c, dtype=torch.float64)
    w, b = torch.randn(c, kernel, dtype=torch.float64), torch.randn(c, dtype=torch.float64)
    seqs = PackedSeqs.from_position_ids(torch.cat([torch.arange(m) for m in lengths])[None])
    got = causal_conv(x, w, doc_positions(seqs), b)
    ref = torch.cat(
        [F.conv1d(d.T[None], w[:, None], b, padding=kernel - 1, groups=c)[0, :, : len(d)].T for d in x.split(lengths)]
    )
    torch.testing.assert_close(got, ref, atol=1e-12, rtol=0)


def vlm_checkpoint(folder, moe: bool):
    """A released-layout Qwen3.5 (VLM: vision tower, `model.language_model.` names) with tiny
    sizes, saved by transformers, plus MTP tensors as the released checkpoints have them."""
    text_cls, vlm_cls, case = (
        (transformers.Qwen3_5MoeTextConfig, transformers.Qwen3_5MoeConfig, "qwen35moe-top2-shared")
        if moe
        else (transformers.Qwen3_5TextConfig, transformers.Qwen3_5Config, "qwen35-3to1-grouped-heads")
    )
    text = {**COMMON, **CASES[case][1]}
    vision = dict(
        depth=1,
        hidden_size=16,
        intermediate_size=32,
        num_heads=2,
        out_hidden_size=COMMON["hidden_size"],
        patch_size=4,
        num_position_embeddings=16,
    )
    config = vlm_cls(text_config=text, vision_config=vision)
    torch.manual_seed(0)
    hf = transformers.AutoModelForImageTextToText.from_config(config).eval()
    with torch.no_grad():
        realistic_draws(hf.model.language_model)
    return hf, save_with_mtp(hf, folder)


@pytest.mark.parametrize("moe", [False, True], ids=["qwen3_5", "qwen3_5_moe"])
def test_released_vlm_layout_loads_text_and_vision_and_carries_mtp(moe, tmp_path):
    """The text model's logits (no image: the vision tower is test_vision.py's) and the files
    written back, the tower from our state dict and the MTP tensors carried."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    hf, mtp = vlm_checkpoint(src, moe)
    cfg = read_config(src)
    ours = load_model(src).eval()
    assert any(n.startswith("visual.") for n in ours.state_dict())
    assert not any(n.startswith("mtp") for n in ours.state_dict())
    _, ids, pos = packed([40])
    with torch.no_grad():
        torch.testing.assert_close(ours.logits(ids, pos), hf(input_ids=ids).logits, atol=1e-4, rtol=0)
    save_hf(ours.state_dict(), cfg, dst, max_shard_bytes=40_000, carried=carried_tensors(src, cfg, torch.float32))
    before, after = ({k: v for f in d.glob("*.safetensors") for k, v in load_file(f).items()} for d in (src, dst))
    assert sorted(before) == sorted(after)
    for name in before:
        assert before[name].dtype == after[name].dtype and torch.equal(before[name], after[name]), name
    assert any(n.startswith("model.visual.") for n in after) and all(torch.equal(after[n], t) for n, t in mtp.items())


def naive_ssd(c, b, v, a, lengths):
    """Mamba2's recurrence token by token, each document from a zero state (fp64 oracle)."""
    out, start = [], 0
    for n in lengths:
        state = v.new_zeros(c.shape[1], c.shape[2], v.shape[2])  # [H, S, P]
        for t in range(start, start + n):
            state = state * a[t].exp()[:, None, None] + torch.einsum("hs,hp->hsp", b[t], v[t])
            out.append(torch.einsum("hs,hsp->hp", c[t], state))
        start += n
    return torch.stack(out)


def test_ssd_scan_equals_the_recurrence_with_its_gradients():
    torch.manual_seed(0)
    lengths = [70, 1, 64, 129]
    n, h, s, p = sum(lengths), 3, 6, 5
    c, b, v = (torch.randn(n, h, d, dtype=torch.float64, requires_grad=True) for d in (s, s, p))
    a = (-torch.rand(n, h, dtype=torch.float64) * 3).requires_grad_()
    seqs = PackedSeqs.from_position_ids(torch.cat([torch.arange(m) for m in lengths])[None])
    got, ref = ssd_scan(c, b, v, a, seqs), naive_ssd(c, b, v, a, lengths)
    torch.testing.assert_close(got, ref, atol=1e-10, rtol=0)
    weights = torch.randn_like(ref)
    grads = torch.autograd.grad((got * weights).sum(), (c, b, v, a))
    ref_grads = torch.autograd.grad((ref * weights).sum(), (c, b, v, a))
    for name, x, y in zip("c b v a".split(), grads, ref_grads):
        torch.testing.assert_close(x, y, atol=1e-9, rtol=0, msg=name)


def test_latent_experts_run_in_the_latent_and_swapped_projections_fail_parity(tmp_path):
    """The latent case's experts are stacked at the latent width (EP shards them as any), its
    parameters count as transformers' do, and the parity check above sees the latent
    projections: each replaced by the other's transpose (same shapes), the logits move far
    beyond its 1e-4."""
    hf = hf_checkpoint("nemotronh-latent-experts", tmp_path)
    ours = load_model(tmp_path).eval()
    moe = ours.layers[1].mlp
    assert moe.fc1_latent_proj is not None and moe.fc2_latent_proj is not None
    assert moe.experts.w_up.shape == (8, 24, 32) and moe.experts.w_down.shape == (8, 32, 24)
    assert ours.args.num_params() == sum(p.numel() for p in hf.parameters())
    _, ids, pos = packed([40])
    with torch.no_grad():
        expected = hf(input_ids=ids).logits
        torch.testing.assert_close(ours.logits(ids, pos), expected, atol=1e-4, rtol=0)
        for layer in (1, 3):
            moe = ours.layers[layer].mlp
            fc1, fc2 = moe.fc1_latent_proj.weight, moe.fc2_latent_proj.weight
            fc1_t, fc2_t = fc1.T.clone(), fc2.T.clone()
            fc1.copy_(fc2_t)
            fc2.copy_(fc1_t)
        swapped = ours.logits(ids, pos)
    assert (swapped - expected).abs().max() > 1e-2


@pytest.mark.parametrize(
    "case",
    [
        "nemotronh-all-kinds-groups",
        "nemotronh-one-group-nobias-tied",
        "nemotronh-latent-experts",
        "qwen35-3to1-grouped-heads",
    ],
)
def test_round_trip_is_exact(case, tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    hf_checkpoint(case, src, shard="40KB")
    cfg = read_config(src)
    save_hf(load_model(src).state_dict(), cfg, dst, max_shard_bytes=40_000)
    before, after = ({k: v for f in d.glob("*.safetensors") for k, v in load_file(f).items()} for d in (src, dst))
    assert sorted(before) == sorted(after)
    for name in before:
        assert before[name].dtype == after[name].dtype and torch.equal(before[name], after[name]), name


def test_nemotron_h_pattern_string_and_unsupported_options():
    family = FAMILIES["nemotron_h"]
    cfg = family.tiny_config(TinyShape(vocab_size=32, num_layers=2)) | {
        "layers_block_type": ["linear_attention", "moe", "full_attention", "mlp"]
    }
    listed = family.args_from_hf(cfg)
    assert listed.layers[1].mlp.latent_size is None
    assert family.args_from_hf(cfg | {"moe_latent_size": 16}).layers[1].mlp.latent_size == 16
    pattern = {k: v for k, v in cfg.items() if k != "layers_block_type"} | {"hybrid_override_pattern": "ME*-"}
    assert family.args_from_hf(pattern).layers == listed.layers
    assert [type(layer.mixer).__name__ if layer.mixer else type(layer.mlp).__name__ for layer in listed.layers] == [
        "Mamba2",
        "MoEMLP",
        "Attention",
        "DenseMLP",
    ]
    for key, value, message in [
        ("hybrid_override_pattern", "M*X", "characters of"),
        ("mlp_hidden_act", "silu", "'relu2' only"),
    ]:
        bad = (pattern if key == "hybrid_override_pattern" else cfg) | {key: value}
        with pytest.raises(ValueError, match=f"nemotron_h: `{key}` = .*{message}"):
            family.args_from_hf(bad)


def test_conv_kernels_refuse_mismatched_shapes_before_any_kernel():
    """The CUDA conv (conv_kernels.py) indexes x, weight and positions unchecked inside its
    kernels: mismatched shapes are refused by name first (this runs on the CPU: no kernel)."""
    from primerl_models.kernels.conv import causal_conv_silu

    x, w, pos = torch.randn(10, 6), torch.randn(6, 4), torch.arange(10)
    for bad in [(x[None], w, pos), (x, w[:5], pos), (x, w, pos[:9])]:
        with pytest.raises(ValueError, match=r"x must be \[N, C\], weight \[C, K\], pos \[N\]; got"):
            causal_conv_silu(*bad)
