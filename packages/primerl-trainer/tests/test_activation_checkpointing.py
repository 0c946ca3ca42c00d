"""Activation checkpointing: same gradients, layers recomputed in backward, names unchanged."""

import torch
from primerl_models import load_model
from primerl_models.tiny import build_tiny_model
from primerl_trainer.placement import apply_activation_checkpointing


def grads(model, ids, pos):
    model.zero_grad()
    model.logits(ids, pos).logsumexp(-1).sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_checkpointed_layers_give_the_same_gradients_and_recompute(tmp_path):
    folder = build_tiny_model(tmp_path, "qwen3_moe", num_layers=3, init_std=0.2)
    plain, ckpt = load_model(folder), load_model(folder)
    names = list(ckpt.state_dict())
    assert apply_activation_checkpointing(ckpt, every=2) == 2  # layers 0 and 2
    assert list(ckpt.state_dict()) == names

    calls = {i: 0 for i in range(3)}
    for i, layer in enumerate(ckpt.layers):
        layer.self_attn.register_forward_pre_hook(lambda m, a, i=i: calls.__setitem__(i, calls[i] + 1))
    ids = torch.randint(0, 50, (2, 12))
    pos = torch.arange(12).expand(2, 12)
    expected, got = grads(plain, ids, pos), grads(ckpt, ids, pos)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], atol=1e-6, rtol=1e-5)
    assert calls == {0: 2, 1: 1, 2: 2}  # checkpointed layers ran again in backward
    # MoE stats count the tokens once, recomputation or not.
    assert ckpt.moe_stats().sum(dim=1).tolist() == [48.0] * 3


def test_checkpointed_layers_with_lora_give_the_adapters_the_same_gradients(tmp_path):
    """LoRA (adapters on every projection, the rest frozen) under activation checkpointing:
    the adapters' gradients equal the plain model's, and only they get gradients."""
    from primerl_trainer.config import LoRAConfig
    from primerl_trainer.lora import LoRALinear, apply_lora

    folder = build_tiny_model(tmp_path, "qwen3", num_layers=2, init_std=0.2)
    models = []
    for checkpointed in (False, True):
        model = load_model(folder)
        torch.manual_seed(0)  # the same adapters in both
        apply_lora(model, LoRAConfig(rank=4, alpha=8.0))
        with torch.no_grad():
            for m in model.modules():
                if isinstance(m, LoRALinear):
                    m.lora_B.weight.normal_(0.0, 0.1)
        if checkpointed:
            assert apply_activation_checkpointing(model) == 2
        models.append(model)
    ids = torch.randint(0, 50, (2, 12))
    pos = torch.arange(12).expand(2, 12)
    grad_sets = []
    for model in models:
        model.zero_grad()
        model.logits(ids, pos).logsumexp(-1).sum().backward()
        grad_sets.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    expected, got = grad_sets
    assert expected and all(".lora_" in n for n in expected) and sorted(got) == sorted(expected)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], atol=1e-6, rtol=1e-5)
