"""Activation checkpointing: same gradients, layers recomputed in backward, names unchanged."""

import torch
from primerl_models import load_model
from primerl_trainer.placement import apply_activation_checkpointing
from primerl_models.tiny import build_tiny_model


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
