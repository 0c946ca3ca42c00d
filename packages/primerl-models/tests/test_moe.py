"""The MoE block's moves of rows to their experts and back (blocks/moe.take_rows): forward and
backward against references that use no sorting at all (each token through its own top_k
experts, one at a time), CPU fp32."""

from __future__ import annotations

import pytest
import torch
from primerl_models.args import Experts, MoEMLP, Routing, SharedExpert
from primerl_models.blocks.moe import MoE, take_rows


def test_take_rows_backward_equals_the_scatter_add_of_plain_indexing():
    """take_rows' gathers give the gradient autograd gives x[take] (a scatter-add), for a
    permutation (k = 1) and for each row taken k = 3 times."""
    g = torch.Generator().manual_seed(0)
    for n, k in ((7, 1), (5, 3)):
        x = torch.randn(n, 4, generator=g, dtype=torch.float64, requires_grad=True)
        back = torch.randperm(n * k, generator=g)  # row a of back-order is x's row a // k
        take = torch.empty_like(back).scatter_(0, back, torch.arange(n * k)) // k
        assert torch.equal(take[back], torch.arange(n * k) // k)
        upstream = torch.randn(n * k, 4, generator=g, dtype=torch.float64)
        (expected,) = torch.autograd.grad(x[take], x, upstream)
        got = take_rows(x, take, back, k)
        assert torch.equal(got, x[take])
        (grad,) = torch.autograd.grad(got, x, upstream)
        torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-12)


def reference(moe: MoE, x_ND: torch.Tensor) -> torch.Tensor:
    """Each token through its own top_k experts, one after another (no sorting, no indexing of
    rows), weighted by the router's weights; plus the shared expert."""
    weights_NK, experts_NK = moe.router(x_ND)
    p = dict(moe.experts.named_parameters(recurse=False))
    rows = []
    for n in range(x_ND.shape[0]):
        y = x_ND.new_zeros(x_ND.shape[1])
        for k in range(moe.top_k):
            e = int(experts_NK[n, k])
            h = torch.nn.functional.silu(x_ND[n] @ p["w_gate"][e]) * (x_ND[n] @ p["w_up"][e])
            y = y + weights_NK[n, k] * (h @ p["w_down"][e])
        rows.append(y)
    out = torch.stack(rows)
    return out if moe.shared_experts is None else out + moe.shared_experts(x_ND)


@pytest.mark.parametrize("shared", [None, SharedExpert(size=12)])
def test_moe_forward_and_gradients_equal_a_per_token_reference(shared):
    """Outputs and the gradients of the input and of every weight (router, experts, shared
    expert) of MoE.forward equal the per-token reference's: a row sent to the wrong expert or
    a gradient returned to the wrong token or copy fails."""
    torch.manual_seed(0)
    spec = MoEMLP(Routing(num_experts=6, top_k=3, norm_topk_prob=True), Experts(size=10), shared)
    moe = MoE(16, spec)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(2, 9, 16, requires_grad=True)
    upstream = torch.randn(2, 9, 16)
    params = [x, *moe.parameters()]
    got = moe(x)
    grads = torch.autograd.grad(got, params, upstream)
    expected = reference(moe, x.view(-1, 16)).view(2, 9, 16)
    expected_grads = torch.autograd.grad(expected, params, upstream)
    assert moe.tokens_per_expert.sum() == 18 * 3
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    for (name, _), grad, want in zip([("x", x), *moe.named_parameters()], grads, expected_grads):
        assert want.abs().max() > 1e-3, name  # every weight takes part
        torch.testing.assert_close(grad, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")
