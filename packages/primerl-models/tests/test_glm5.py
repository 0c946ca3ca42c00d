"""GLM-5 (`glm_moe_dsa`): Multi-head Latent Attention with DSA's top-k indexer (blocks/mla.py)
against transformers' own implementation (CPU, fp32), with sequences longer than `index_topk`
so that the indexer's selection decides the result; packed rows, and the checkpoint both ways."""

import json

import pytest
import torch
import transformers
from primerl_models import carried_tensors, load_model, published_config, read_config, save_hf, to_hf
from primerl_models.args import MLA, DenseMLP, Layer, ModelArgs, Rope
from primerl_models.blocks import mla
from primerl_models.families import family_for
from primerl_models.hf import quantize_fp8
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


@pytest.fixture(params=["sparse", "oracle"])
def path(request, monkeypatch) -> str:
    """Both paths of blocks/mla.py: the sparse absorbed one (the default) and the dense oracle."""
    monkeypatch.setattr(mla, "FAST_PATH", request.param == "sparse")
    return request.param


def boundary_ties(monkeypatch) -> list[int]:
    """Spies on the selection (either path's): appends, per selection made, how many queries
    find their topk-th and (topk+1)-th best keys scored equal (a choice torch.topk leaves
    unspecified)."""
    counts = []

    def spying(choose):
        def spy(scores_BCT, allowed_BCT, topk):
            best = scores_BCT.masked_fill(~allowed_BCT, float("-inf")).sort(dim=-1, descending=True).values
            if best.shape[-1] > topk:
                kth, next_ = best[..., topk - 1], best[..., topk]
                counts.append(int(((kth == next_) & next_.isfinite()).sum()))
            return choose(scores_BCT, allowed_BCT, topk)

        return spy

    monkeypatch.setattr(mla, "topk_keys", spying(mla.topk_keys))
    monkeypatch.setattr(mla, "topk_indices", spying(mla.topk_indices))
    return counts


def logits_of_both(case, folder):
    hf = hf_checkpoint(case, folder)
    ours = load_model(folder).eval()
    ids = torch.randint(0, COMMON["vocab_size"], (2, LENGTH), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(LENGTH).expand(2, LENGTH)
    with torch.no_grad():
        return hf(input_ids=ids, position_ids=pos).logits, ours.logits(ids, pos)


@pytest.mark.parametrize("case", CASES)
def test_logits_match_transformers(case, path, tmp_path, monkeypatch):
    """16 indexer heads: no exact ties at the top-k boundary (asserted), so that the selection
    is the same whatever the tie-break (with few heads, scores of 0 are common: blocks/mla.py)."""
    assert CASES[case]["index_topk"] < LENGTH
    ties = boundary_ties(monkeypatch)
    expected, got = logits_of_both(case, tmp_path)
    assert len(ties) == CASES[case]["indexer_types"].count("full") and sum(ties) == 0, ties
    assert expected.std() > 0.1  # logits large enough for the tolerance to mean something
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("case", CASES)
def test_attending_to_every_key_instead_of_the_selected_ones_fails_parity(case, path, tmp_path, monkeypatch):
    """The mutation the parity test must catch: the indexer's choice dropped (dense causal
    attention), everything else equal."""
    every = mla.topk_indices
    monkeypatch.setattr(mla, "topk_keys", lambda scores_BCT, allowed_BCT, topk: allowed_BCT)
    monkeypatch.setattr(
        mla, "topk_indices", lambda scores_BCT, allowed_BCT, topk: every(scores_BCT, allowed_BCT, 10**9)
    )
    expected, got = logits_of_both(case, tmp_path)
    assert (got - expected).abs().max() > 100 * 1e-4


@pytest.mark.parametrize("case", CASES)
def test_packed_row_equals_each_sequence_alone(case, path, tmp_path, monkeypatch):
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


def test_sparse_path_equals_the_oracle_in_values_and_every_gradient(tmp_path, monkeypatch):
    """The absorbed sparse path (gathered latent rows, the chunked forward and its hand-written
    backward) against the dense oracle, fp32: two packed rows of documents longer and shorter
    than index_topk, a shared layer, and chunks of a few queries (the indexer's and attention's)."""
    hf_checkpoint("glm5-topk5-shared-yarn-bias", tmp_path)
    model = load_model(tmp_path)
    lengths = [[13, 3, 16], [7, 25]]
    ids = torch.randint(0, COMMON["vocab_size"], (2, 32), generator=torch.Generator().manual_seed(4))
    pos = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths])
    weights = torch.randn(2, 32, COMMON["vocab_size"], generator=torch.Generator().manual_seed(5))

    def run(fast: bool):
        monkeypatch.setattr(mla, "FAST_PATH", fast)
        monkeypatch.setattr(mla, "CHUNK_BYTES", 6000)  # a few queries a chunk
        model.zero_grad()
        logits = model.logits(ids, pos)
        (logits * weights).sum().backward()
        return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    (oracle, oracle_grads), (sparse, sparse_grads) = run(False), run(True)
    torch.testing.assert_close(sparse, oracle, atol=1e-5, rtol=1e-5)
    assert sparse_grads.keys() == oracle_grads.keys()
    assert any("kv_a_proj" in n for n in sparse_grads) and any("kv_b_proj" in n for n in sparse_grads)
    for name, grad in oracle_grads.items():
        err = (sparse_grads[name] - grad).norm() / grad.norm().clamp_min(1e-12)
        assert err < 1e-5, (name, float(err))


def test_the_sparse_choice_is_the_oracles_with_ties_signed_zeros_and_negative_scores():
    """topk_indices (one topk over int64 keys) picks the keys topk_keys (a stable sort) does:
    the later of equal scores, -0.0 equal to 0.0, negative scores ordered, disallowed never."""
    g = torch.Generator().manual_seed(0)
    scores = torch.randint(-3, 4, (3, 50, 60), generator=g).float()  # few values: many ties
    scores[scores == 0] = torch.where(torch.rand(int((scores == 0).sum()), generator=g) < 0.5, -0.0, 0.0)
    scores = scores + torch.rand(3, 50, 60, generator=g).lt(0.1) * torch.randn(3, 50, 60, generator=g) * 1e-30
    allowed = torch.rand(3, 50, 60, generator=g) < 0.6
    allowed[1, 7] = False  # a query with no key allowed
    for topk in (1, 5, 37, 60, 80):
        index, valid = mla.topk_indices(scores, allowed, topk)
        chosen = torch.zeros(allowed.shape, dtype=torch.int64).scatter_add(-1, index, valid.long()) > 0
        assert torch.equal(chosen, mla.topk_keys(scores, allowed, topk)), topk
        assert torch.equal(valid.sum(-1), allowed.sum(-1).clamp_max(topk))


# -- GLM-5-FP8: block-FP8 checkpoints, dequantised at load ----------------------------------------

FP8_CASE = "glm5-topk5-shared-yarn-bias"
FP8_HIDDEN = 160  # [*, 160] matrices: a full block of 128 columns and a partial one of 32


def glm5_fp8_not_converted(cfg: dict) -> list[str]:
    """`modules_to_not_convert` in GLM-5-FP8's form: module names, each layer's norms, each MoE
    layer's router and its correction bias, each indexer's `k_norm` and `indexers_proj` (sic: no
    module has that name; the tensor it means, `indexer.weights_proj`, is stored bf16 without a
    scale), the MTP layer's own modules, the embedding, the final norm and the output layer."""
    names = ["model.embed_tokens", "model.norm", "lm_head"]
    mtp = cfg["num_hidden_layers"]
    for i, (indexer, mlp) in enumerate(zip(cfg["indexer_types"] + ["full"], cfg["mlp_layer_types"] + ["sparse"])):
        layer = f"model.layers.{i}"
        names += [f"{layer}.{m}" for m in ("input_layernorm", "post_attention_layernorm")]
        names += [f"{layer}.self_attn.{m}" for m in ("q_a_layernorm", "kv_a_layernorm")]
        if mlp == "sparse":
            names += [f"{layer}.mlp.gate", f"{layer}.mlp.gate.e_score_correction_bias"]
        if indexer == "full":
            names += [f"{layer}.self_attn.{m}" for m in ("indexers_proj", "indexer.k_norm", "indexer.k_norm.bias")]
    return names + [f"model.layers.{mtp}.{m}" for m in ("enorm", "hnorm", "eh_proj", "shared_head.norm")]


def dequantised_by_blocks(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """fp8 values times their block's scale, block by block (the reference: no code of ours)."""
    out = q.float()
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            out[i * block[0] : (i + 1) * block[0], j * block[1] : (j + 1) * block[1]] *= scale[i, j]
    return out


def glm5_fp8_checkpoint(folder, block: tuple[int, int]) -> tuple[dict, dict[str, torch.Tensor]]:
    """folder/fp8: a tiny GLM-5 with an MTP layer stored as GLM-5-FP8 is: every matrix not in
    `modules_to_not_convert` (nor the indexer's weights_proj) in e4m3 with an fp32
    `weight_scale_inv` per block, everything else bf16 (the routers' correction biases fp32),
    and the quantization_config. folder/plain: its config and the values the fp8 tensors stand
    for, in fp32 (transformers' reference). Returns the fp8 config and those values, MTP ones
    included (HF names)."""
    plain, quantised = folder / "plain", folder / "fp8"
    hf_checkpoint(FP8_CASE, plain, hidden_size=FP8_HIDDEN)
    cfg = read_config(plain)
    n, d, g = cfg["num_hidden_layers"], FP8_HIDDEN, torch.Generator().manual_seed(7)
    mtp = {  # some of the MTP layer (layer n), with GLM-5's names
        f"model.layers.{n}.eh_proj.weight": torch.randn(d, 2 * d, generator=g) * 0.05,
        f"model.layers.{n}.enorm.weight": torch.randn(d, generator=g),
        f"model.layers.{n}.self_attn.q_a_proj.weight": torch.randn(32, d, generator=g) * 0.05,
        f"model.layers.{n}.mlp.experts.0.down_proj.weight": torch.randn(d, 32, generator=g) * 0.05,
        f"model.layers.{n}.mlp.gate.e_score_correction_bias": torch.randn(8, generator=g),
    }
    tensors = hf_tensors(plain) | mtp
    skip = set(glm5_fp8_not_converted(cfg)) | {f"model.layers.{i}.self_attn.indexer.weights_proj" for i in range(n + 1)}
    stored, values = {}, {}
    for name, t in tensors.items():
        if name.endswith(".weight") and t.ndim == 2 and name.removesuffix(".weight") not in skip:
            q, scale = quantize_fp8(t, block)
            stored[name], stored[name + "_scale_inv"] = q, scale
            values[name] = dequantised_by_blocks(q, scale, block)
        else:
            stored[name] = t if name.endswith("e_score_correction_bias") else t.bfloat16()
            values[name] = stored[name].float()
    # fp8 is coarse: the values differ from the weights before quantising, so the reference is theirs
    assert max((values[k] - tensors[k]).abs().max() for k in tensors if k + "_scale_inv" in stored) > 1e-3
    quantised.mkdir()
    save_file(stored, quantised / "model.safetensors")
    quant = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": list(block)}
    cfg = {**cfg, "quantization_config": {**quant, "modules_to_not_convert": glm5_fp8_not_converted(cfg)}}
    (quantised / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file({k: v for k, v in values.items() if k not in mtp}, plain / "model.safetensors")
    return cfg, values


def logits_of(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("block", [(128, 128), (32, 48)], ids=["block128", "block32x48"])
def test_fp8_checkpoint_loads_dequantised_and_saves_plain_weights_transformers_loads(block, tmp_path):
    """GLM-5-FP8's layout: each weight equals its fp8 values times its block's scale, exactly
    (blocks of 128 as published: matrices of several blocks and partial ones; and smaller
    blocks: many of each); the logits are transformers' on those values; and what we save from
    the loaded model (published_config: no quantization_config) is plain fp32 weights, the MTP
    layer's dequantised too, which transformers loads to the same logits."""
    cfg, values = glm5_fp8_checkpoint(tmp_path, block)
    stored = hf_tensors(tmp_path / "fp8")
    scales = {n: s.shape for n, s in stored.items() if n.endswith("_scale_inv")}
    assert len(scales) > 40 and max(s.numel() for s in scales.values()) > 1
    assert any(stored[n.removesuffix("_scale_inv")].shape[1] % block[1] for n in scales)  # partial blocks
    assert stored["model.layers.0.self_attn.indexer.weights_proj.weight"].dtype == torch.bfloat16
    ours = load_model(tmp_path / "fp8").eval()
    # (a) every weight is the dequantised value, exactly
    got = to_hf(ours.state_dict(), ours.args)
    n = cfg["num_hidden_layers"]
    assert sorted(got) == sorted(k for k in values if not k.startswith(f"model.layers.{n}."))
    for name, t in got.items():
        assert torch.equal(t, values[name]), name
    # (b) transformers on the dequantised values (which differ from the weights before quantising)
    plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "plain").eval()
    ids = torch.randint(0, COMMON["vocab_size"], (2, LENGTH), generator=torch.Generator().manual_seed(3))
    expected = logits_of(plain, ids)
    assert expected.std() > 0.1
    got_logits = ours.logits(ids, torch.arange(LENGTH).expand(2, LENGTH)).detach()
    torch.testing.assert_close(got_logits, expected, atol=1e-4, rtol=0)
    # what we save is plain weights: no fp8, no scales, no quantization_config claiming them
    dst = tmp_path / "saved"
    save_hf(
        ours.state_dict(), published_config(cfg), dst, carried=carried_tensors(tmp_path / "fp8", cfg, torch.float32)
    )
    assert "quantization_config" not in read_config(dst)
    saved = hf_tensors(dst)
    assert sorted(saved) == sorted(values)
    for name, t in saved.items():  # ours fp32; the MTP layer's as stored, but dequantised
        as_stored = name.startswith(f"model.layers.{n}.") and name + "_scale_inv" not in stored
        assert t.dtype == (stored[name].dtype if as_stored else torch.float32), name
        assert torch.equal(t.float(), values[name]), name
    torch.testing.assert_close(
        logits_of(transformers.AutoModelForCausalLM.from_pretrained(dst).eval(), ids), expected, atol=0, rtol=0
    )


def test_fp8_weight_without_its_scale_or_with_a_scale_of_the_wrong_shape_is_named(tmp_path):
    cfg, _ = glm5_fp8_checkpoint(tmp_path, (128, 128))
    folder = tmp_path / "fp8"
    good = hf_tensors(folder)

    def load_with(**changes):
        tensors = {**good, **changes}
        save_file({k: v for k, v in tensors.items() if v is not None}, folder / "model.safetensors")
        return load_model(folder)

    down = "model.layers.1.mlp.experts.3.down_proj.weight"  # [160, 32]: 2 x 1 blocks
    with pytest.raises(ValueError, match=rf"{down}_scale_inv has shape \(1, 1\), expected \(2, 1\) for {down} "):
        load_with(**{down + "_scale_inv": good[down + "_scale_inv"][:1]})
    gate = "model.layers.2.mlp.shared_experts.gate_proj.weight"  # [32, 160]: 1 x 2 blocks, given 2 x 1
    with pytest.raises(ValueError, match=rf"{gate}_scale_inv has shape \(2, 1\), expected \(1, 2\)"):
        load_with(**{gate + "_scale_inv": good[gate + "_scale_inv"].T.contiguous()})
    wq_b = "model.layers.0.self_attn.indexer.wq_b.weight"
    with pytest.raises(ValueError, match=rf"fp8 tensors without a weight_scale_inv: {wq_b}"):
        load_with(**{wq_b + "_scale_inv": None})
    # the MTP layer's (carried, read when published): its own error, naming it
    mtp = f"model.layers.{cfg['num_hidden_layers']}.self_attn.q_a_proj.weight"
    load_with(**{mtp + "_scale_inv": None})  # the model itself does not read the MTP layer
    with pytest.raises(ValueError, match=rf"fp8 tensors without a weight_scale_inv: {mtp}"):
        carried_tensors(folder, cfg)
