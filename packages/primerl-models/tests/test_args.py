"""The per-layer description: parameter counts against the built modules, FLOPs against a hand
computation, and bad descriptions refused by name."""

import pytest
import torch
from primerl_models import Attention, DenseMLP, Experts, Layer, ModelArgs, MoEMLP, Rope, Routing
from primerl_models.families import FAMILIES, TinyShape
from primerl_models.model import Transformer


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("tie", [False, True])
def test_parameter_counts_are_those_of_the_built_model(family, tie):
    cfg = FAMILIES[family].tiny_config(TinyShape(vocab_size=50, num_layers=3, tie_embeddings=tie))
    args = FAMILIES[family].args_from_hf(cfg)
    with torch.device("meta"):
        model = Transformer(args)
    assert args.num_params() == sum(p.numel() for p in model.parameters())
    embedding = model.embed_tokens.weight.numel()
    # (Nemotron-H never ties, whatever the config says)
    tied = args.tie_embeddings
    assert args.num_params(embeddings=False) == sum(p.numel() for p in model.parameters()) - (0 if tied else embedding)
    # active: all but the (E - top_k) experts each token skips in every MoE layer (one expert:
    # its slice of every stacked parameter, biases included)
    skipped = sum(
        (m.num_experts - m.top_k) * sum(p[0].numel() for p in m.experts.parameters())
        for m in model.modules()
        if hasattr(m, "tokens_per_expert")
    )
    assert args.num_active_params() == args.num_params(embeddings=False) - skipped


def test_latent_expert_counts_are_those_of_the_built_layer():
    """Latent experts (Nemotron 3 Super): each expert L wide instead of D, plus one pair of
    D x L projections per layer, which every token goes through (active)."""
    spec = MoEMLP(Routing(num_experts=4, top_k=2), Experts(size=16, activation="relu2"), latent_size=8)
    args = ModelArgs("test", vocab_size=10, hidden_size=32, layers=[Layer(None, spec)])
    with torch.device("meta"):
        model = Transformer(args)
    assert args.num_params() == sum(p.numel() for p in model.parameters())
    d, latent, f = 32, 8, 16
    assert spec.num_params(d) == 4 * 2 * latent * f + 4 * d + 2 * d * latent
    assert spec.num_active_params(d) == 2 * 2 * latent * f + 4 * d + 2 * d * latent
    with pytest.raises(ValueError, match="moe_latent_size must be a positive width"):
        MoEMLP(Routing(num_experts=4, top_k=2), Experts(size=16), latent_size=0)


def test_train_flops_count_each_layer_by_its_own_kind():
    """Two layers of different heads and MLPs: 6 N_active per token plus, per layer,
    6 H K n^2 per document (causal QK^T and AV, forward and backward)."""
    rope = Rope(rotary_dim=8)
    wide = Attention(num_heads=8, num_kv_heads=2, head_dim=16, rope=rope)
    narrow = Attention(num_heads=2, num_kv_heads=1, head_dim=8, rope=rope)
    args = ModelArgs(
        "test",
        vocab_size=10,
        hidden_size=32,
        layers=[Layer(wide, DenseMLP(64)), Layer(narrow, MoEMLP(Routing(num_experts=4, top_k=1), Experts(size=16)))],
    )
    d = 32
    attn_wide = d * 8 * 16 * 2 + d * 2 * 16 * 2
    attn_narrow = d * 2 * 8 * 2 + d * 1 * 8 * 2
    active = (attn_wide + 3 * d * 64 + 2 * d) + (attn_narrow + 3 * d * 16 + 4 * d + 2 * d) + d + 10 * d
    assert args.num_active_params() == active
    lengths = [5, 11]
    expected = 6 * active * 16 + (6 * 8 * 16 + 6 * 2 * 8) * (25 + 121)
    assert args.train_flops(lengths) == expected


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: Routing(num_experts=6, top_k=2, n_group=4), r"n_group \(4\) must divide"),
        (lambda: Routing(num_experts=8, top_k=2, n_group=2, topk_group=3), r"topk_group \(3\)"),
        (lambda: Routing(num_experts=8, top_k=5, n_group=4, topk_group=2), r"more than the 4 experts"),
        (lambda: Routing(num_experts=4, top_k=5), r"num_experts_per_tok \(5\)"),
        (lambda: Attention(num_heads=6, num_kv_heads=4, head_dim=8, rope=Rope(8)), r"multiple of"),
        (lambda: Attention(num_heads=4, num_kv_heads=2, head_dim=8, rope=Rope(16)), r"rotary_dim \(16\) is larger"),
        (lambda: Rope(rotary_dim=7), r"positive even"),
    ],
)
def test_bad_descriptions_are_refused_by_name(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_a_config_with_bad_groups_fails_naming_them():
    cfg = FAMILIES["glm4_moe"].tiny_config(TinyShape(vocab_size=50, num_experts=6)) | {"n_group": 4}
    with pytest.raises(ValueError, match=r"n_group \(4\) must divide the number of experts \(6\)"):
        FAMILIES["glm4_moe"].args_from_hf(cfg)
