"""Conversion to and from Hugging Face checkpoints, and the errors of bad checkpoints."""

import json

import pytest
import torch
import transformers
from primerl_models import carried_tensors, load_model, published_config, read_config, save_hf, to_hf, to_ours
from primerl_models.families import family_for
from primerl_models.testing import save_transformers
from safetensors.torch import load_file, save_file

MOE = transformers.Qwen3MoeConfig(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=16,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    num_experts=4,
    num_experts_per_tok=2,
    mlp_only_layers=[1],
    tie_word_embeddings=False,
)
DENSE = transformers.Qwen3Config(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    tie_word_embeddings=True,
)

GPT_OSS = transformers.GptOssConfig(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=16,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    num_local_experts=4,
    num_experts_per_tok=2,
    sliding_window=4,
)


def hf_tensors(folder) -> dict[str, torch.Tensor]:
    out = {}
    for f in folder.glob("*.safetensors"):
        out.update(load_file(f))
    return out


@pytest.mark.parametrize("config", [MOE, DENSE, GPT_OSS], ids=["moe", "dense-tied", "gpt_oss"])
def test_round_trip_gives_identical_tensors(config, tmp_path):
    """GPT-OSS: its stacked experts with gate and up interleaved, their biases, sinks, router bias."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    save_transformers(config, src, shard="30KB", bias_std=0.1)  # transformers' own small shards + index
    assert (src / "model.safetensors.index.json").exists()
    model = load_model(src)
    save_hf(model.state_dict(), read_config(src), dst, max_shard_bytes=40_000)
    before, after = hf_tensors(src), hf_tensors(dst)
    assert sorted(before) == sorted(after)
    for name in before:
        assert torch.equal(before[name], after[name]), name
    assert (dst / "model.safetensors.index.json").exists()
    # transformers loads what we wrote.
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(dst)
    assert sum(p.numel() for p in reloaded.parameters()) > 0


def test_experts_are_stacked_for_grouped_gemm(tmp_path):
    save_transformers(MOE, tmp_path)
    hf = hf_tensors(tmp_path)
    args = family_for(read_config(tmp_path)).args_from_hf(read_config(tmp_path))
    ours = to_ours(hf, args)
    w_gate = ours["layers.0.mlp.experts.w_gate"]
    assert w_gate.shape == (4, 32, 16)  # [E, D, F]
    assert torch.equal(w_gate[2], hf["model.layers.0.mlp.experts.2.gate_proj.weight"].T)
    assert ours["layers.0.mlp.experts.w_down"].shape == (4, 16, 32)  # [E, F, D]
    assert "layers.1.mlp.gate_proj.weight" in ours  # layer 1 is dense (mlp_only_layers)
    back = to_hf(ours, args)
    assert all(torch.equal(back[k], hf[k]) for k in hf)


def write_config(folder, **changes):
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))


def test_unsupported_model_type_lists_supported(tmp_path):
    save_transformers(DENSE, tmp_path)
    write_config(tmp_path, model_type="gpt2")
    with pytest.raises(
        ValueError,
        match=r"model_type 'gpt2' is not implemented .*supported: afmoe, glm4, glm4_moe, glm_moe_dsa, gpt_oss, laguna, llama, minimax_m2, nemotron_h, qwen3, qwen3_5, qwen3_5_moe, qwen3_5_moe_text, qwen3_5_text, qwen3_moe",
    ):
        load_model(tmp_path)


def test_unsupported_option_is_named(tmp_path):
    save_transformers(DENSE, tmp_path)
    write_config(tmp_path, use_sliding_window=True)
    with pytest.raises(ValueError, match="`use_sliding_window` = True is not supported"):
        load_model(tmp_path)


def test_trinity_routing_that_transformers_does_not_implement_is_named(tmp_path):
    """vLLM reads score_func / route_norm / n_group / topk_group of a Trinity config, transformers
    does not: a value other than the released one would train one way and serve another."""
    save_transformers(AFMOE, tmp_path)
    for key, value, released in [("score_func", "softmax", "sigmoid"), ("route_norm", False, True), ("n_group", 2, 1)]:
        write_config(tmp_path, **{key: value})
        with pytest.raises(ValueError, match=f"`{key}` = {value!r} is not supported"):
            load_model(tmp_path)
        write_config(tmp_path, **{key: released})
    load_model(tmp_path)  # the released values load


def test_missing_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path)


def test_missing_weights(tmp_path):
    save_transformers(DENSE, tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"no \*.safetensors files"):
        load_model(tmp_path)


def test_missing_shard_is_named(tmp_path):
    save_transformers(DENSE, tmp_path, shard="30KB")
    shard = sorted(tmp_path.glob("model-*.safetensors"))[0]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=f"{shard.name} is listed in model.safetensors.index.json but missing"):
        load_model(tmp_path)


def test_corrupt_file_is_named(tmp_path):
    save_transformers(DENSE, tmp_path)
    file = tmp_path / "model.safetensors"
    file.write_bytes(file.read_bytes()[:1000])
    with pytest.raises(ValueError, match="model.safetensors: not a readable safetensors file"):
        load_model(tmp_path)


def test_wrong_shape_and_missing_tensor_are_named(tmp_path):
    save_transformers(DENSE, tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(8, 32)
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError) as err:
        load_model(tmp_path)
    assert "missing tensors: layers.1.mlp.down_proj.weight" in str(err.value)
    assert "tensor layers.0.self_attn.q_proj.weight has shape (8, 32), expected (32, 32)" in str(err.value)


def test_missing_expert_is_named(tmp_path):
    save_transformers(MOE, tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.0.mlp.experts.3.up_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing tensors: model.layers.0.mlp.experts.3.up_proj.weight"):
        load_model(tmp_path)


# GLM-4.5 with its MTP layer (layer num_hidden_layers, as the released checkpoints store it),
# MiniMax-M2 and GLM-4: their own names both ways, and what is not trained carried through.
GLM_MOE = transformers.Glm4MoeConfig(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=16,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_shared_experts=1,
    first_k_dense_replace=1,
    n_group=2,
    topk_group=1,
    use_qk_norm=True,
    attention_bias=True,
    num_nextn_predict_layers=1,
    pad_token_id=0,
)
MINIMAX = transformers.MiniMaxM2Config(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=16,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    num_local_experts=4,
    num_experts_per_tok=2,
    rotary_dim=4,
    bos_token_id=0,
    eos_token_id=1,
)
GLM4 = transformers.Glm4Config(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    pad_token_id=0,
    eos_token_id=1,
)
AFMOE = transformers.AfmoeConfig(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=16,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    num_experts=4,
    num_experts_per_tok=2,
    num_shared_experts=1,
    num_dense_layers=1,
    layer_types=["sliding_attention", "full_attention"],
    mup_enabled=True,
)
LAGUNA = transformers.LagunaConfig(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=16,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    num_experts=4,
    num_experts_per_tok=2,
    shared_expert_intermediate_size=16,
    num_attention_heads_per_layer=[4, 2],
    layer_types=["full_attention", "sliding_attention"],
)


def add_tensors(folder, tensors: dict, file: str = "model-extra.safetensors"):
    """Tensors written into their own shard of a checkpoint (and its index, when it has one)."""
    save_file(tensors, folder / file)
    index = folder / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
        data["weight_map"].update({name: file for name in tensors})
        index.write_text(json.dumps(data))


def mtp_layer(config) -> dict[str, torch.Tensor]:
    """Some of the tensors of GLM-4.5's MTP layer, with their real names."""
    n, d = config.num_hidden_layers, config.hidden_size
    g = torch.Generator().manual_seed(5)
    return {
        f"model.layers.{n}.eh_proj.weight": torch.randn(d, 2 * d, generator=g),
        f"model.layers.{n}.enorm.weight": torch.randn(d, generator=g),
        f"model.layers.{n}.shared_head.norm.weight": torch.randn(d, generator=g),
        f"model.layers.{n}.self_attn.q_proj.weight": torch.randn(32, d, generator=g),
        f"model.layers.{n}.mlp.gate.e_score_correction_bias": torch.randn(4, generator=g),
    }


def save_with_biases(config, folder, shard=None):
    """transformers' checkpoint, the routers' correction biases drawn non-zero first."""
    return save_transformers(config, folder, shard, router_bias_std=0.1)


@pytest.mark.parametrize(
    "config", [GLM_MOE, MINIMAX, GLM4, AFMOE, LAGUNA], ids=["glm4_moe-mtp", "minimax_m2", "glm4", "afmoe", "laguna"]
)
def test_new_families_round_trip_exactly_and_carry_what_is_not_trained(config, tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    save_with_biases(config, src, shard="20KB")
    extra = mtp_layer(config) if config.model_type == "glm4_moe" else {}
    if extra:
        add_tensors(src, extra)
    cfg = read_config(src)
    model = load_model(src)
    assert not any(name.startswith(f"layers.{config.num_hidden_layers}.") for name in model.state_dict())
    save_hf(model.state_dict(), cfg, dst, max_shard_bytes=30_000, carried=carried_tensors(src, cfg, torch.float32))
    before, after = hf_tensors(src), hf_tensors(dst)
    assert sorted(before) == sorted(after)
    for name in before:
        assert before[name].dtype == after[name].dtype and torch.equal(before[name], after[name]), name
    for name, tensor in extra.items():
        assert torch.equal(after[name], tensor), name
    biases = [n for n in before if n.endswith(("e_score_correction_bias", ".expert_bias"))]
    assert bool(biases) == (config.model_type != "glm4"), biases
    assert all(before[n].abs().sum() > 0 for n in biases)
    # transformers loads what we wrote, with the same logits as the source
    ids = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        a = transformers.AutoModelForCausalLM.from_pretrained(src).eval()(ids).logits
        b = transformers.AutoModelForCausalLM.from_pretrained(dst).eval()(ids).logits
    torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_router_correction_biases_stay_fp32_in_bf16_models(tmp_path):
    save_with_biases(GLM_MOE, tmp_path)
    source = hf_tensors(tmp_path)
    model = load_model(tmp_path, dtype=torch.bfloat16)
    buf = model.layers[1].mlp.router.e_score_correction_bias
    assert buf.dtype == torch.float32 and model.layers[1].mlp.router.weight.dtype == torch.bfloat16
    assert torch.equal(buf, source["model.layers.1.mlp.gate.e_score_correction_bias"])


def quantize_fp8(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-wise e4m3 quantisation as DeepSeek-V3 / MiniMax-M2 checkpoints store it: per block,
    scale = amax / 448 (e4m3's largest value), stored as weight_scale_inv."""
    rows, cols = w.shape
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    scale = torch.empty(grid)
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(grid[0]):
        for j in range(grid[1]):
            r, c = slice(i * block[0], (i + 1) * block[0]), slice(j * block[1], (j + 1) * block[1])
            scale[i, j] = w[r, c].abs().max().clamp(min=1e-12) / 448.0
            q[r, c] = (w[r, c] / scale[i, j]).to(torch.float8_e4m3fn)
    return q, scale


@pytest.mark.parametrize("shape, block", [((48, 36), (16, 12)), ((40, 30), (16, 16)), ((128, 256), (128, 128))])
def test_fp8_quantisation_matches_the_block_by_block_reference_and_inverts_dequantisation(shape, block):
    """hf.quantize_fp8 (one pass, what the trainer publishes for FP8 servers) against the
    loop above, block by block: the same e4m3 values and scales, bit for bit, with partial
    blocks and an all-zero block; and dequantize_fp8 of it is within e4m3's rounding (half a
    step: 2^-4 of the value, or 2^-10 of the scale in the subnormals) of the weight."""
    from primerl_models.hf import dequantize_fp8
    from primerl_models.hf import quantize_fp8 as quantize_fast

    w = torch.randn(shape, generator=torch.Generator().manual_seed(shape[0])) * torch.logspace(-3, 1, shape[1])
    w[: block[0], : block[1]] = 0  # an all-zero block
    q, scale = quantize_fast(w, block)
    q_ref, scale_ref = quantize_fp8(w, block)
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
    assert torch.equal(scale, scale_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    cfg = {"quantization_config": {"quant_method": "fp8", "weight_block_size": list(block)}}
    back = dequantize_fp8({"x.weight": q, "x.weight_scale_inv": scale}, cfg, torch.float32, "test")["x.weight"]
    full = scale.repeat_interleave(block[0], 0)[: shape[0]].repeat_interleave(block[1], 1)[:, : shape[1]]
    assert ((back - w).abs() <= torch.maximum(w.abs() * 2**-4, full * 2**-10)).all()
    assert torch.equal(back[: block[0], : block[1]], torch.zeros(block))
    # a stack of weights (a layer's experts, quantised in one call) gives each its own
    stack = torch.stack([w, w * 3, -w])
    q3, scale3 = quantize_fast(stack, block)
    for i in range(3):
        q_i, scale_i = quantize_fp8(stack[i], block)
        assert torch.equal(scale3[i], scale_i) and torch.equal(q3[i].view(torch.uint8), q_i.view(torch.uint8))


def quantised_checkpoint(tmp_path, tensors: dict, quantization_config: dict):
    """tmp_path/<quant_method>: `tensors` with tmp_path/plain's config and `quantization_config`."""
    folder = tmp_path / quantization_config["quant_method"]
    folder.mkdir()
    save_file(tensors, folder / "model.safetensors")
    cfg = read_config(tmp_path / "plain") | {"quantization_config": quantization_config}
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder, cfg


def test_fp8_block_quantised_checkpoint_is_dequantised_at_load(tmp_path):
    """MiniMax-M2 is published in block-quantised fp8: each linear weight in e4m3 with one fp32
    scale per 128 x 128 block. Here blocks of 16 x 12 (12 does not divide 32: partial blocks).
    Expected: transformers on the dequantised weights (fp8 value x its block's scale)."""
    hf = save_with_biases(MINIMAX, tmp_path / "plain").eval()
    tensors = hf_tensors(tmp_path / "plain")
    block = (16, 12)
    quantised, dequantised = {}, {}
    for name, w in tensors.items():
        if w.ndim == 2 and ("self_attn" in name or ".experts." in name):
            q, s = quantize_fp8(w, block)
            quantised[name], quantised[name + "_scale_inv"] = q, s
            full = s.repeat_interleave(block[0], 0)[: w.shape[0]].repeat_interleave(block[1], 1)[:, : w.shape[1]]
            dequantised[name] = q.float() * full
        else:
            quantised[name] = w
    folder, cfg = quantised_checkpoint(
        tmp_path,
        quantised,
        {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block)},
    )
    ours = load_model(folder).eval()
    # the reference: transformers on the dequantised weights (which differ from the originals)
    assert max((dequantised[n] - tensors[n]).abs().max() for n in dequantised) > 1e-4
    save_file(tensors | dequantised, tmp_path / "plain" / "model.safetensors")
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "plain").eval()
    assert set(reference.state_dict()) == set(hf.state_dict())
    ids = torch.randint(0, 64, (2, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(
            ours.logits(ids, torch.arange(20).expand(2, 20)), reference(ids).logits, atol=1e-4, rtol=0
        )
    # what the trainer publishes is plain weights: no quantization_config
    assert "quantization_config" not in published_config(cfg) and published_config(cfg)["model_type"] == "minimax_m2"


def test_fp8_scale_of_the_wrong_shape_missing_scales_and_other_quantisations_are_named(tmp_path):
    save_with_biases(MINIMAX, tmp_path)
    tensors = hf_tensors(tmp_path)
    name = "model.layers.0.self_attn.q_proj.weight"
    q, s = quantize_fp8(tensors[name], (16, 16))
    tensors[name], tensors[name + "_scale_inv"] = q, s[:1]
    save_file(tensors, tmp_path / "model.safetensors")
    write_config(tmp_path, quantization_config={"quant_method": "fp8", "weight_block_size": [16, 16]})
    with pytest.raises(ValueError, match=r"q_proj.weight_scale_inv has shape \(1, 2\), expected \(2, 2\)"):
        load_model(tmp_path)
    write_config(tmp_path, quantization_config={"quant_method": "awq", "bits": 4})
    with pytest.raises(ValueError, match=r"quant_method: 'awq'.* is not supported"):
        load_model(tmp_path)
    # a scale whose weight is missing, an fp8 weight without its scale
    write_config(tmp_path, quantization_config={"quant_method": "fp8", "weight_block_size": [16, 16]})
    tensors[name + "_scale_inv"] = s
    del tensors[name]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(
        ValueError, match=r"q_proj.weight_scale_inv has no weight model.layers.0.self_attn.q_proj.weight"
    ):
        load_model(tmp_path)
    tensors[name] = q
    del tensors[name + "_scale_inv"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(
        ValueError, match=r"fp8 tensors without a weight_scale_inv: model.layers.0.self_attn.q_proj.weight"
    ):
        load_model(tmp_path)


def test_unsupported_minimax_options_are_named(tmp_path):
    save_with_biases(MINIMAX, tmp_path)
    write_config(tmp_path, scoring_func="softmax")
    with pytest.raises(ValueError, match="minimax_m2: `scoring_func` = 'softmax' is not supported"):
        load_model(tmp_path)
    write_config(tmp_path, scoring_func="sigmoid", attn_type_list=[0, 1])
    with pytest.raises(ValueError, match="`attn_type_list`"):
        load_model(tmp_path)


FP4 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]  # e2m1's magnitudes; bit 3 is the sign


def quantize_mxfp4(w_t):
    """[E, R, C] (C divisible by 32) -> MXFP4 blocks uint8 [E, R, C/32, 16], scales uint8
    [E, R, C/32], and the values they stand for: each group of 32 scaled by the power of two
    that maps its largest magnitude to at most 6, each value rounded to the nearest e2m1."""
    e, r, c = w_t.shape
    groups = w_t.reshape(e, r, c // 32, 32)
    exponent = torch.floor(torch.log2(groups.abs().amax(-1).clamp(min=2.0**-100) / 6.0)) + 1
    scaled = groups / torch.pow(2.0, exponent)[..., None]
    magnitudes = torch.tensor(FP4)
    index = (scaled.abs()[..., None] - magnitudes).abs().argmin(-1)
    nibbles = index + 8 * (scaled < 0).long()
    values = magnitudes[index] * torch.where(scaled < 0, -1.0, 1.0) * torch.pow(2.0, exponent)[..., None]
    blocks = (nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)).to(torch.uint8)
    return blocks, (exponent + 127).to(torch.uint8), values.reshape(e, r, c)


GPT_OSS_MX = transformers.GptOssConfig(
    vocab_size=64,
    hidden_size=64,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_local_experts=4,
    num_experts_per_tok=2,
    sliding_window=4,
)


def test_mxfp4_experts_are_dequantised_at_load(tmp_path):
    """GPT-OSS is released with its experts' matrices in MXFP4 (`*_blocks`, `*_scales`, stored
    as [E, out, in / 32, 16] of the [E, in, out] matrices). Expected: transformers on the
    values the blocks stand for (computed here from the nibbles' definition)."""
    save_transformers(GPT_OSS_MX, tmp_path / "plain", bias_std=0.1)
    tensors = hf_tensors(tmp_path / "plain")
    quantised, dequantised = {}, {}
    for name, w in tensors.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales, values = quantize_mxfp4(w.transpose(1, 2))
            quantised[name + "_blocks"], quantised[name + "_scales"] = blocks, scales
            dequantised[name] = values.transpose(1, 2).contiguous()
        else:
            quantised[name] = w
    folder, cfg = quantised_checkpoint(
        tmp_path,
        quantised,
        {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router"]},
    )
    ours = load_model(folder).eval()
    assert max((dequantised[n] - tensors[n]).abs().max() for n in dequantised) > 1e-3  # FP4 is coarse
    save_file(tensors | dequantised, tmp_path / "plain" / "model.safetensors")
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "plain").eval()
    ids = torch.randint(0, 64, (2, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(
            ours.logits(ids, torch.arange(20).expand(2, 20)), reference(ids).logits, atol=1e-4, rtol=0
        )
    assert "quantization_config" not in published_config(cfg)
    # blocks without their scales are named
    del quantised["model.layers.0.mlp.experts.down_proj_scales"]
    save_file(quantised, folder / "model.safetensors")
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.experts.down_proj_blocks has no scales"):
        load_model(folder)
