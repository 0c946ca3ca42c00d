"""Conversion to and from Hugging Face checkpoints, and the errors of bad checkpoints."""

import json

import pytest
import torch
import transformers
from primerl_models import load_model, read_config, save_hf, to_hf, to_ours
from primerl_models.families import family_for
from safetensors.torch import load_file, save_file

MOE = transformers.Qwen3MoeConfig(
    vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
    mlp_only_layers=[1], tie_word_embeddings=False,
)
DENSE = transformers.Qwen3Config(
    vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, tie_word_embeddings=True,
)


def save_transformers(config, folder, shard=None):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(folder, **({"max_shard_size": shard} if shard else {}))


def hf_tensors(folder) -> dict[str, torch.Tensor]:
    out = {}
    for f in folder.glob("*.safetensors"):
        out.update(load_file(f))
    return out


@pytest.mark.parametrize("config", [MOE, DENSE], ids=["moe", "dense-tied"])
def test_round_trip_gives_identical_tensors(config, tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    save_transformers(config, src, shard="30KB")  # transformers' own small shards + index
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
    with pytest.raises(ValueError, match=r"model_type 'gpt2' is not implemented .*supported: glm4, glm4_moe, llama, minimax_m2, qwen3, qwen3_moe"):
        load_model(tmp_path)


def test_unsupported_option_is_named(tmp_path):
    save_transformers(DENSE, tmp_path)
    write_config(tmp_path, use_sliding_window=True)
    with pytest.raises(ValueError, match="`use_sliding_window` = True is not supported"):
        load_model(tmp_path)


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
