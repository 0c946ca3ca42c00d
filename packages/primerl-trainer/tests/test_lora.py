"""Low-rank adapters on a tiny model (CPU, fp32): the adapted model is the merged model, its
adapter gradients are the merged weight's gradient through B A, and training moves only the
adapters."""

import pytest
import torch
from primerl_models import Transformer
from primerl_models.families import FAMILIES, TinyShape
from primerl_trainer.config import LoRAConfig
from primerl_trainer.lora import LoRALinear, adapter_state_dict, apply_lora, merged_state_dict
from torch import nn


def tiny(family="qwen3", seed=0):
    cfg = FAMILIES[family].tiny_config(
        TinyShape(
            vocab_size=48,
            hidden_size=32,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            head_dim=8,
            moe_intermediate_size=16,
        )
    )
    model = Transformer(FAMILIES[family].args_from_hf(cfg))
    model.init_weights(std=0.2, generator=torch.Generator().manual_seed(seed))
    return model


def same_as_merged(model, family):
    """The model with its adapters folded in (merged_state_dict); asserts both give the same
    logprobs (fp32, 1e-5) and backpropagates the same loss through both. Returns it."""
    merged = tiny(family)
    merged.load_state_dict(merged_state_dict(model))
    ids, pos, targets, weights = batch()
    lp, _ = model(ids, pos, targets)
    (lp * weights).sum().backward()
    lp_merged, _ = merged(ids, pos, targets)
    (lp_merged * weights).sum().backward()
    torch.testing.assert_close(lp, lp_merged, atol=1e-5, rtol=0)
    return merged


def batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 48, (1, 20), generator=g)
    pos = torch.cat([torch.arange(n) for n in (12, 8)])[None]
    return ids, pos, torch.roll(ids, -1, dims=1), torch.randn(1, 20, generator=g)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_adapted_model_is_the_merged_model_and_its_gradients_go_through_b_a(family):
    model = tiny(family)
    adapted = apply_lora(model, LoRAConfig(rank=4, alpha=8.0, targets=["q_proj", "v_proj", "*_proj"]))
    assert adapted and all(isinstance(model.get_submodule(n), LoRALinear) for n in adapted)
    with torch.no_grad():  # a trained-looking adapter: B away from its zero start
        for name in adapted:
            model.get_submodule(name).lora_B.weight.normal_(0.0, 0.1)
    merged = same_as_merged(model, family)
    for name in adapted:
        layer, ref = model.get_submodule(name), merged.get_submodule(name)
        a, b, s, g_w = layer.lora_A.weight, layer.lora_B.weight, layer.lora_scale, ref.weight.grad
        # W' = W + s B A: dL/dA = s B^T dL/dW', dL/dB = s dL/dW' A^T. Both sides are sums over
        # the tokens in another order (fp32): within 1e-5 of the largest gradient element (the
        # adapters' init is unseeded; a per-element 1e-5 failed about once in 11 runs).
        for got, want in ((a.grad, s * b.detach().T @ g_w), (b.grad, s * g_w @ a.detach().T)):
            torch.testing.assert_close(got, want, atol=1e-5 * max(1.0, float(want.abs().max())), rtol=0, msg=name)
        assert layer.weight.grad is None  # frozen
    assert all(p.grad is None for n, p in model.named_parameters() if ".lora_" not in n)


def test_training_moves_only_the_adapters():
    model = tiny()
    apply_lora(model, LoRAConfig(rank=4, alpha=8.0))
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if ".lora_" not in n}
    before = {n: t.clone() for n, t in adapter_state_dict(model).items()}
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert len(trainable) == len(before)  # the optimizer sees the adapters alone
    opt = torch.optim.AdamW(trainable, lr=1e-2)
    ids, pos, targets, weights = batch()
    for _ in range(3):
        lp, _ = model(ids, pos, targets)
        (-(lp * weights.abs()).sum()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert len(opt.state) == len(before)
    for n, p in model.named_parameters():
        if n in frozen:
            assert torch.equal(p, frozen[n]), n  # bit-identical
    after = adapter_state_dict(model)
    assert all(not torch.equal(after[n], before[n]) for n in before if n.endswith("lora_B.weight"))
    # the names stay the model's: the adapted layer keeps `weight`, the adapter sits beside it
    assert "layers.0.self_attn.q_proj.weight" in model.state_dict()
    assert "layers.0.self_attn.q_proj.lora_A.weight" in after


def test_a_fresh_adapter_changes_nothing_and_bad_targets_are_named():
    model, ref = tiny(), tiny()
    apply_lora(model, LoRAConfig(rank=2, alpha=4.0, targets=["o_proj"]))
    ids, pos, targets, _ = batch()
    with torch.no_grad():
        torch.testing.assert_close(model(ids, pos, targets)[0], ref(ids, pos, targets)[0], atol=0, rtol=0)
    with pytest.raises(ValueError, match=r"trainer.lora.targets = \['qkv'\] matches no linear layer .*q_proj"):
        apply_lora(tiny(), LoRAConfig(targets=["qkv"]))


def test_a_vision_tower_is_never_adapted_and_stays_frozen():
    """Globs broad enough to match the Qwen3.5 vision tower's layers (`qkv`, `proj`,
    `linear_fc*`) adapt the language model's alone; every tower parameter ends frozen."""
    import transformers
    from primerl_models import Transformer
    from primerl_models.families import family_for

    text = transformers.Qwen3_5TextConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=4,
        head_dim=16,
        num_key_value_heads=2,
        num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"],
    )
    vision = dict(
        depth=2,
        hidden_size=32,
        intermediate_size=48,
        num_heads=2,
        out_hidden_size=64,
        patch_size=2,
        temporal_patch_size=2,
        spatial_merge_size=2,
        num_position_embeddings=16,
    )
    cfg = transformers.Qwen3_5Config(text_config=text, vision_config=vision, image_token_id=90).to_dict()
    with torch.device("meta"):
        model = Transformer(family_for(cfg).args_from_hf(cfg))
    assert any(n.startswith("visual.") and isinstance(m, nn.Linear) for n, m in model.named_modules())
    names = apply_lora(model, LoRAConfig(rank=2, alpha=4.0, targets=["*proj*", "qkv", "linear_fc*"]))
    assert names and not any(n.startswith("visual.") for n in names)
    assert any(n.endswith("mlp.gate_proj") for n in names)
    assert not any(p.requires_grad for n, p in model.named_parameters() if n.startswith("visual."))


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_adapted_experts_are_the_merged_experts_and_their_gradients_go_through_a_b(family):
    """trainer.lora.experts: each expert's stacked weight W [E, in, out] acts as W + s A B
    (A [E, in, r], B [E, r, out]): the model equals the one with the adapters folded in
    (fp32, 1e-5), dL/dA = s dL/dW' B^T and dL/dB = s A^T dL/dW' per expert, and only adapters
    get gradients (GPT-OSS: biased experts with the clamped SwiGLU)."""
    from primerl_models.blocks.moe import GroupedExperts

    torch.manual_seed(0)
    model = tiny(family)
    apply_lora(model, LoRAConfig(rank=3, alpha=6.0, targets=["q_proj"], experts=True))
    experts = [(n, m) for n, m in model.named_modules() if isinstance(m, GroupedExperts)]
    assert experts and all(m.lora_scale == 2.0 for _, m in experts)
    with torch.no_grad():
        for _, m in experts:
            for name, p in m.named_parameters(recurse=False):
                if name.startswith("lora_B_"):
                    p.normal_(0.0, 0.1)
    merged = same_as_merged(model, family)
    moved = 0
    for name, m in experts:
        ref = merged.get_submodule(name)
        for w, _ in ref.named_parameters(recurse=False):
            if not w.startswith("w_"):
                continue
            a, b, g_w = getattr(m, f"lora_A_{w}"), getattr(m, f"lora_B_{w}"), getattr(ref, w).grad
            for got, want in (
                (a.grad, 2.0 * g_w @ b.detach().transpose(1, 2)),
                (b.grad, 2.0 * a.detach().transpose(1, 2) @ g_w),
            ):
                torch.testing.assert_close(
                    got, want, atol=1e-5 * max(1.0, float(want.abs().max())), rtol=0, msg=f"{name}.{w}"
                )
            moved += int(not torch.equal(getattr(ref, w), getattr(m, w)))
    assert moved == sum(1 for _, m in experts for w, _ in m.named_parameters(recurse=False) if w.startswith("w_"))
    assert all(p.grad is None for n, p in model.named_parameters() if "lora_" not in n)


def test_experts_alone_need_no_linear_target():
    model = tiny("qwen3_moe")
    names = apply_lora(model, LoRAConfig(rank=2, targets=[], experts=True))
    assert names and all(n.endswith(".experts") for n in names)
    assert all(("lora_" in n) == p.requires_grad for n, p in model.named_parameters())


def test_experts_on_a_dense_model_are_refused():
    with pytest.raises(ValueError, match="no MoE layer"):
        apply_lora(tiny("qwen3"), LoRAConfig(rank=2, experts=True))
