"""GLM-5 (`glm_moe_dsa`): Multi-head Latent Attention with DSA's top-k indexer (blocks/mla.py)
against transformers' own implementation (CPU, fp32), with sequences longer than `index_topk`
so that the indexer's selection decides the result; packed rows, and the checkpoint both ways."""

import json

import pytest
import torch
import transformers
from primerl_models import carried_tensors, load_model, read_config, save_hf
from primerl_models.args import MLA, DenseMLP, Layer, ModelArgs, Rope
from primerl_models.blocks import mla
from primerl_models.families import family_for
from primerl_models.model import Transformer
from primerl_models.testing import save_transformers
from safetensors.torch import load_file, save_file

COMMON = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=4,
    initializer_range=0.2,
    rms_norm_eps=1e-6,
    max_position_embeddings=64,
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
)
CASES = {
    # 3 layers: the second reuses the first's selection ("shared"); each query sees 5 keys;
    # YaRN with mscale != mscale_all_dim (cos and sin scaled, and the softmax scale by
    # mscale_all_dim^2); biases on q_a, kv_a and o; a dense first layer; groups of experts.
    "glm5-topk5-shared-yarn-bias": dict(
        num_hidden_layers=3,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        index_n_heads=16,
        index_head_dim=16,
        index_topk=5,
        indexer_types=["full", "shared", "full"],
        attention_bias=True,
        first_k_dense_replace=1,
        n_group=2,
        topk_group=1,
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=10000.0,
            factor=4.0,
            original_max_position_embeddings=16,
            mscale=1.0,
            mscale_all_dim=0.5,
        ),
    ),
    # ... and 11 keys a query, every layer its own indexer and MoE, a value head narrower than
    # the key's nope part, a wider rope part, an indexer head as wide as it, plain RoPE, no bias,
    # two shared experts' width, no renormalisation.
    "glm5-topk11-full-moe-narrow-v": dict(
        num_hidden_layers=2,
        q_lora_rank=24,
        kv_lora_rank=32,
        qk_nope_head_dim=8,
        qk_rope_head_dim=16,
        v_head_dim=12,
        index_n_heads=16,
        index_head_dim=16,
        index_topk=11,
        indexer_types=["full", "full"],
        attention_bias=False,
        first_k_dense_replace=0,
        n_shared_experts=2,
        norm_topk_prob=False,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0),
    ),
}
LENGTH = 40


def hf_checkpoint(case: str, folder, shard: str | None = None, **overrides):
    config = transformers.GlmMoeDsaConfig(**{**COMMON, **CASES[case], **overrides})
    # router biases, the attention biases, every norm (the indexer's LayerNorm too) drawn away
    # from their init, so that one in the wrong place shows
    return save_transformers(config, folder, shard, router_bias_std=0.1, bias_std=0.2, norm_std=0.2)


def boundary_ties(monkeypatch) -> list[int]:
    """Spies on the selection: appends, per selection made, how many queries find their
    topk-th and (topk+1)-th best keys scored equal (a choice torch.topk leaves unspecified)."""
    counts, choose = [], mla.topk_keys

    def spy(scores_BTT, allowed_BTT, topk):
        best = scores_BTT.masked_fill(~allowed_BTT, float("-inf")).sort(dim=-1, descending=True).values
        if best.shape[-1] > topk:
            kth, next_ = best[..., topk - 1], best[..., topk]
            counts.append(int(((kth == next_) & next_.isfinite()).sum()))
        return choose(scores_BTT, allowed_BTT, topk)

    monkeypatch.setattr(mla, "topk_keys", spy)
    return counts


def logits_of_both(case, folder):
    hf = hf_checkpoint(case, folder)
    ours = load_model(folder).eval()
    ids = torch.randint(0, COMMON["vocab_size"], (2, LENGTH), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(LENGTH).expand(2, LENGTH)
    with torch.no_grad():
        return hf(input_ids=ids, position_ids=pos).logits, ours.logits(ids, pos)


@pytest.mark.parametrize("case", CASES)
def test_logits_match_transformers(case, tmp_path, monkeypatch):
    """16 indexer heads: no exact ties at the top-k boundary (asserted), so that the selection
    is the same whatever the tie-break (with few heads, scores of 0 are common: blocks/mla.py)."""
    assert CASES[case]["index_topk"] < LENGTH
    ties = boundary_ties(monkeypatch)
    expected, got = logits_of_both(case, tmp_path)
    assert len(ties) == CASES[case]["indexer_types"].count("full") and sum(ties) == 0, ties
    assert expected.std() > 0.1  # logits large enough for the tolerance to mean something
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("case", CASES)
def test_attending_to_every_key_instead_of_the_selected_ones_fails_parity(case, tmp_path, monkeypatch):
    """The mutation the parity test must catch: the indexer's choice dropped (dense causal
    attention), everything else equal."""
    monkeypatch.setattr(mla, "topk_keys", lambda scores_BTT, allowed_BTT, topk: allowed_BTT)
    expected, got = logits_of_both(case, tmp_path)
    assert (got - expected).abs().max() > 100 * 1e-4


@pytest.mark.parametrize("case", CASES)
def test_packed_row_equals_each_sequence_alone(case, tmp_path, monkeypatch):
    """Documents longer and shorter than index_topk: the selection and causality stay in each.
    Two indexer heads, so that equal scores at the top-k boundary occur (asserted), and are
    broken alike wherever the document sits."""
    hf_checkpoint(case, tmp_path, index_n_heads=2)
    ties = boundary_ties(monkeypatch)
    ours = load_model(tmp_path).eval()
    lengths = [9, 17, 4, 13]
    seqs = [torch.randint(0, COMMON["vocab_size"], (1, n), generator=torch.Generator().manual_seed(n)) for n in lengths]
    packed_ids = torch.cat(seqs, dim=1)
    packed_pos = torch.cat([torch.arange(n) for n in lengths])[None]
    with torch.no_grad():
        packed = ours.logits(packed_ids, packed_pos)
        alone = torch.cat([ours.logits(s, torch.arange(s.shape[1])[None]) for s in seqs], dim=1)
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=0)
    assert sum(ties) > 0, ties
    with torch.no_grad():  # and the packing mattered: one sequence gives other logits
        unpacked = ours.logits(packed_ids, torch.arange(packed_ids.shape[1])[None])
    assert (unpacked[:, lengths[0] :] - alone[:, lengths[0] :]).abs().max() > 1e-2


def test_shared_layers_reuse_the_selection_of_the_last_full_layer():
    cfg = {
        **transformers.GlmMoeDsaConfig(**{**COMMON, **CASES["glm5-topk5-shared-yarn-bias"]}).to_dict(),
        "num_hidden_layers": 5,
        "indexer_types": None,
        "mlp_layer_types": None,
        "layer_types": None,
        "index_topk_freq": 2,
        "index_skip_topk_offset": 2,
    }
    args = family_for(cfg).args_from_hf(cfg)
    specs = [layer.mixer for layer in args.layers]
    assert all(isinstance(s, MLA) for s in specs)
    # transformers' derivation: layer i is full when max(i - offset + 1, 0) % freq == 0
    assert [(s.indexer is not None, s.reuse_topk, s.topk_slot) for s in specs] == [
        (True, False, 0),
        (True, False, 1),
        (False, True, 1),
        (True, False, 3),
        (False, True, 3),
    ]
    assert [type(layer.mlp).__name__ for layer in args.layers] == ["DenseMLP"] + ["MoEMLP"] * 4
    for key, value, why in [
        ("indexer_types", ["shared", "full", "full", "full", "full"], "first layer must run its indexer"),
        ("num_key_value_heads", 2, "expands its latent to all 4 heads"),
        ("q_lora_rank", None, "reads the query latent"),
    ]:
        with pytest.raises(ValueError, match=f"`{key}` = .* is not supported .*{why}"):
            family_for(cfg).args_from_hf({**cfg, key: value})


def test_gradients_reach_the_attention_and_not_the_indexer(tmp_path):
    hf_checkpoint("glm5-topk5-shared-yarn-bias", tmp_path)
    ours = load_model(tmp_path)
    assert ours.args.num_params() == sum(p.numel() for p in ours.parameters())  # MFU counts them
    ids = torch.randint(0, COMMON["vocab_size"], (1, 24), generator=torch.Generator().manual_seed(3))
    ours.logits(ids, torch.arange(24)[None]).square().mean().backward()
    grads = {name: p.grad for name, p in ours.named_parameters()}
    assert all(grads[n] is None for n in grads if ".indexer." in n)
    attn = [n for n in grads if ".self_attn." in n and ".indexer." not in n]
    assert attn and all(grads[n] is not None and grads[n].abs().sum() > 0 for n in attn), attn


def hf_tensors(folder) -> dict[str, torch.Tensor]:
    out = {}
    for f in folder.glob("*.safetensors"):
        out.update(load_file(f))
    return out


def test_round_trip_exact_mtp_carried_and_transformers_loads_what_we_save(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    hf_checkpoint("glm5-topk5-shared-yarn-bias", src, shard="30KB")
    n, d = 3, COMMON["hidden_size"]
    g = torch.Generator().manual_seed(5)
    mtp = {  # some of GLM-5's MTP layer, with its real names (layer num_hidden_layers)
        f"model.layers.{n}.eh_proj.weight": torch.randn(d, 2 * d, generator=g),
        f"model.layers.{n}.enorm.weight": torch.randn(d, generator=g),
        f"model.layers.{n}.self_attn.q_a_proj.weight": torch.randn(32, d, generator=g),
        f"model.layers.{n}.self_attn.indexer.wk.weight": torch.randn(16, d, generator=g),
        f"model.layers.{n}.mlp.gate.e_score_correction_bias": torch.randn(8, generator=g),
    }
    save_file(mtp, src / "model-mtp.safetensors")
    index = json.loads((src / "model.safetensors.index.json").read_text())
    index["weight_map"].update({name: "model-mtp.safetensors" for name in mtp})
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    cfg = read_config(src)
    model = load_model(src)
    assert not any(name.startswith(f"layers.{n}.") for name in model.state_dict())
    assert "layers.0.self_attn.indexer.k_norm.bias" in model.state_dict()
    assert "layers.1.self_attn.indexer.wk.weight" not in model.state_dict()  # a shared layer has none
    save_hf(model.state_dict(), cfg, dst, max_shard_bytes=30_000, carried=carried_tensors(src, cfg, torch.float32))
    before, after = hf_tensors(src), hf_tensors(dst)
    assert sorted(before) == sorted(after)
    for name in before:
        assert before[name].dtype == after[name].dtype and torch.equal(before[name], after[name]), name
    ids = torch.randint(0, COMMON["vocab_size"], (1, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        a = transformers.AutoModelForCausalLM.from_pretrained(src).eval()(ids).logits
        b = transformers.AutoModelForCausalLM.from_pretrained(dst).eval()(ids).logits
    torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_mla_without_query_latent_or_indexer_matches_deepseek_v3(tmp_path):
    """The block's other form, which no GLM-5 config takes: one q_proj (q_lora_rank None) and no
    indexer (every key of the document), against transformers' DeepSeek-V3 (dense layers only,
    its experts being another family's)."""
    config = transformers.DeepseekV3Config(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        first_k_dense_replace=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=None,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=12,
        rope_interleave=True,
        initializer_range=0.2,
        rms_norm_eps=1e-6,
        attention_bias=True,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0),
    )
    hf = save_transformers(config, tmp_path, bias_std=0.2, norm_std=0.2)
    attn = MLA(
        num_heads=4,
        q_lora_rank=None,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=12,
        rope=Rope(rotary_dim=8, theta=10000.0, interleaved=True),
        bias=True,
    )
    args = ModelArgs("deepseek_v3", 96, 64, [Layer(attn, DenseMLP(96))] * 2, rms_norm_eps=1e-6)
    ours = Transformer(args).eval()
    ours.load_state_dict({k.removeprefix("model."): v for k, v in hf.state_dict().items()})
    ids = torch.randint(0, 96, (2, LENGTH), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(LENGTH).expand(2, LENGTH)
    with torch.no_grad():
        expected, got = hf(input_ids=ids, position_ids=pos).logits, ours.logits(ids, pos)
    assert expected.std() > 0.1
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
