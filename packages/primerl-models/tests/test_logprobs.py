"""The chunked logprob/entropy path against the plain full-logits formula (float64)."""

import pytest
import torch
from primerl_models import chunked_logprobs, chunked_token_loss


def reference(hidden, weight, targets, temps):
    logits = (hidden @ weight.T) / temps[:, None]
    logp = torch.log_softmax(logits, dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return logp.gather(1, targets[:, None]).squeeze(1), entropy


@pytest.fixture
def data():
    g = torch.Generator().manual_seed(0)
    n, d, v = 37, 16, 50
    hidden = torch.randn(n, d, generator=g, dtype=torch.float64)
    weight = torch.randn(v, d, generator=g, dtype=torch.float64)
    targets = torch.randint(0, v, (n,), generator=g)
    temps = torch.rand(n, generator=g, dtype=torch.float64) + 0.5
    return hidden, weight, targets, temps


@pytest.mark.parametrize("chunk,keep", [(1, False), (8, False), (37, False), (100, False), (8, True), (100, True)])
def test_values_and_gradients_match_full_logits(data, chunk, keep):
    """keep: the logits held from the forward instead of recomputed in the backward."""
    hidden, weight, targets, temps = data
    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp, ent = chunked_logprobs(h1, w1, targets, temps, chunk_size=chunk, keep_logits=keep)
    ref_lp, ref_ent = reference(h2, w2, targets, temps)
    torch.testing.assert_close(lp, ref_lp, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(ent, ref_ent, atol=1e-10, rtol=1e-10)
    upstream = torch.linspace(-1, 1, len(targets), dtype=torch.float64)
    (lp * upstream).sum().backward()
    (ref_lp * upstream).sum().backward()
    torch.testing.assert_close(h1.grad, h2.grad, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(w1.grad, w2.grad, atol=1e-10, rtol=1e-10)


def test_float32_inputs_compute_in_float32(data):
    hidden, weight, targets, temps = data
    lp, ent = chunked_logprobs(hidden.float(), weight.float(), targets, temps.float(), chunk_size=8)
    ref_lp, ref_ent = reference(hidden, weight, targets, temps)
    assert lp.dtype == torch.float32
    torch.testing.assert_close(lp.double(), ref_lp, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ent.double(), ref_ent, atol=1e-4, rtol=1e-4)


def test_scalar_temperature_and_entropy_bounds(data):
    hidden, weight, targets, _ = data
    lp, ent = chunked_logprobs(hidden, weight, targets, 0.7, chunk_size=5)
    ref_lp, ref_ent = reference(hidden, weight, targets, torch.full((len(targets),), 0.7, dtype=torch.float64))
    torch.testing.assert_close(lp, ref_lp, atol=1e-10, rtol=1e-10)
    assert (
        bool((lp <= 0).all()) and bool((ent >= 0).all()) and bool((ent <= torch.log(torch.tensor(50.0)) + 1e-5).all())
    )


def test_gradcheck_float64(data):
    hidden, weight, targets, temps = data
    h = hidden[:6].clone().requires_grad_()
    w = weight.clone().requires_grad_()
    assert torch.autograd.gradcheck(
        lambda h, w: chunked_logprobs(h, w, targets[:6], temps[:6], chunk_size=4)[0], (h, w)
    )


def test_bad_inputs():
    with pytest.raises(ValueError, match="temperatures must be positive"):
        chunked_logprobs(torch.randn(3, 4), torch.randn(5, 4), torch.zeros(3, dtype=torch.long), 0.0)
    with pytest.raises(ValueError, match=r"hidden must be \[N, D\]"):
        chunked_logprobs(torch.randn(3, 4), torch.randn(5, 4), torch.zeros(2, dtype=torch.long))
    # the GPU kernels index the logits by target unchecked: ids outside [0, V) are refused first
    for bad in (5, -1):
        with pytest.raises(ValueError, match=r"targets must be token ids in \[0, 5\); got"):
            chunked_logprobs(torch.randn(3, 4), torch.randn(5, 4), torch.tensor([0, bad, 1]))


def test_model_forward_with_targets_equals_logprobs_of_the_full_logits(tmp_path):
    from primerl_models import load_model
    from primerl_models.tiny import build_tiny_model

    model = load_model(build_tiny_model(tmp_path, "qwen3", init_std=0.2))
    ids = torch.randint(0, 90, (2, 11))
    pos = torch.arange(11).expand(2, 11)
    targets = torch.randint(0, 90, (2, 11))
    temps = torch.rand(2, 11) + 0.5
    lp, ent = model(ids, pos, targets, temps, chunk_size=5)
    ref = torch.log_softmax(model.logits(ids, pos) / temps[..., None], -1).gather(2, targets[..., None])[..., 0]
    torch.testing.assert_close(lp, ref, atol=1e-5, rtol=1e-5)
    assert ent.shape == (2, 11)
    # trainer.keep_logits reaches the chunked path through the model: the graph then holds the
    # logits (a second backward is refused), the gradients are the same
    grads = []
    for keep in (False, True):
        model.zero_grad()
        model.keep_logits = keep
        lp_k, _ = model(ids, pos, targets, temps, chunk_size=5)
        lp_k.sum().backward(retain_graph=True)
        grads.append(model.output_weight.grad.clone())
        if keep:
            with pytest.raises(RuntimeError, match="differentiates once"):
                lp_k.sum().backward()
    torch.testing.assert_close(grads[1], grads[0], atol=1e-6, rtol=1e-6)


def test_kept_logits_refuse_a_second_backward(data):
    """The GPU backward writes the gradient over the kept logits: a second pass through them
    (retain_graph) is refused by name rather than differentiated wrongly."""
    hidden, weight, targets, temps = data
    h = hidden.clone().requires_grad_()
    lp, _ = chunked_logprobs(h, weight, targets, temps, chunk_size=8, keep_logits=True)
    lp.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="keep_logits=True.*differentiates once"):
        lp.sum().backward()


def aipo_like_terms(mu, adv, mask, scale):
    """A token-local loss that is not linear in the logprob: -min(exp(pi - mu), 2) A, masked,
    over `scale` tokens (the shape of the RL losses)."""

    def terms(pi, s, e):
        ratio = torch.exp(pi - mu[s:e]).clamp(max=2.0)
        return torch.where(mask[s:e], -ratio * adv[s:e], 0.0) / scale

    return terms


@pytest.mark.parametrize("chunk", [1, 8, 37, 100])
def test_token_loss_in_the_forward_equals_the_loss_of_the_full_logits(data, chunk):
    """chunked_token_loss: the loss and the gradients of hidden and weight (computed in the
    forward, scaled by the loss's own gradient in the backward) equal autograd's through the
    full logits, in float64."""
    hidden, weight, targets, temps = data
    g = torch.Generator().manual_seed(1)
    n = len(targets)
    mu = -torch.rand(n, generator=g, dtype=torch.float64) * 4
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    mask = torch.rand(n, generator=g) < 0.7
    terms = aipo_like_terms(mu, adv, mask, 29.0)
    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss, lp, ent = chunked_token_loss(h1, w1, targets, terms, temps, chunk_size=chunk)
    ref_lp, ref_ent = reference(h2, w2, targets, temps)
    ref_loss = terms(ref_lp, 0, n).sum()
    torch.testing.assert_close(loss, ref_loss.detach(), atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(lp, ref_lp.detach(), atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(ent, ref_ent.detach(), atol=1e-10, rtol=1e-10)
    assert not lp.requires_grad and not ent.requires_grad
    (0.3 * loss).backward()  # the backward scales the forward's gradients by the loss's
    (0.3 * ref_loss).backward()
    torch.testing.assert_close(h1.grad, h2.grad, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(w1.grad, w2.grad, atol=1e-12, rtol=1e-10)


def test_token_loss_without_gradients_and_bad_terms(data):
    hidden, weight, targets, temps = data
    with torch.no_grad():
        loss, lp, _ = chunked_token_loss(hidden, weight, targets, lambda pi, s, e: -pi, temps, chunk_size=8)
    ref_lp, _ = reference(hidden, weight, targets, temps)
    torch.testing.assert_close(loss, -ref_lp.sum(), atol=1e-10, rtol=1e-10)
    # only the hidden states trained (LoRA, a frozen output projection): no weight gradient
    h = hidden.clone().requires_grad_()
    loss, _, _ = chunked_token_loss(h, weight, targets, lambda pi, s, e: -pi, temps, chunk_size=8)
    loss.backward()
    h2 = hidden.clone().requires_grad_()
    (-reference(h2, weight, targets, temps)[0].sum()).backward()
    torch.testing.assert_close(h.grad, h2.grad, atol=1e-12, rtol=1e-10)
    with pytest.raises(ValueError, match=r"the loss's terms of tokens \[0, 8\) have shape \(\)"):
        chunked_token_loss(hidden, weight, targets, lambda pi, s, e: pi.sum(), temps, chunk_size=8)
