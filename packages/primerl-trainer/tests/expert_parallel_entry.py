"""Run by test_expert_parallel.py under torchrun (gloo, CPU): each rank feeds its own tokens to
one MoE layer with all experts (the reference) and to a copy whose experts are sharded over the
ranks, and writes what both gave to OUT/rank_R.pt."""

import copy
import os
import sys

import torch
import torch.distributed as dist
from primerl_models import Experts, MoEMLP, Routing, SharedExpert
from primerl_models.blocks.moe import MoE
from primerl_trainer.expert_parallel import shard_experts
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor


def local(t):
    return t.to_local() if isinstance(t, DTensor) else t


SPECS = {
    "qwen3_moe": MoEMLP(Routing(num_experts=4, top_k=2, scoring="softmax", norm_topk_prob=True), Experts(size=8)),
    "glm4_moe": MoEMLP(
        Routing(
            num_experts=4,
            top_k=2,
            scoring="sigmoid",
            norm_topk_prob=True,
            correction_bias=True,
            n_group=2,
            topk_group=1,
            scaling=2.5,
        ),
        Experts(size=8),
        SharedExpert(size=8),
    ),
    "gpt_oss": MoEMLP(
        Routing(num_experts=4, top_k=2, scoring="softmax_topk", bias=True),
        Experts(size=8, bias=True, activation="clamped", limit=0.5),
    ),
    # Nemotron 3 Super: experts in an 8-wide latent of the 16-wide hidden state, the projections
    # in and out whole on every rank (the all-to-all carries latent rows)
    "nemotron_h_latent": MoEMLP(
        Routing(num_experts=4, top_k=2, scoring="sigmoid", norm_topk_prob=True, correction_bias=True, scaling=2.5),
        Experts(size=8, activation="relu2"),
        SharedExpert(size=8, activation="relu2"),
        latent_size=8,
    ),
}


def main(out_dir: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    results = {}
    for name, spec in SPECS.items():
        torch.manual_seed(0)  # the same weights on every rank
        moe = MoE(16, spec)
        with torch.no_grad():
            for p in moe.parameters():
                p.normal_(0.0, 0.3)
            if moe.router.e_score_correction_bias is not None:
                moe.router.e_score_correction_bias.normal_(0.0, 0.1)
        sharded = copy.deepcopy(moe)
        assert shard_experts(sharded, mesh) == 1
        g = torch.Generator().manual_seed(100 + rank)  # each rank its own tokens (and routing)
        tokens = 5 + 4 * rank
        x = torch.randn(1, tokens, 16, generator=g)
        w = torch.randn(1, tokens, 16, generator=g)
        row = {}
        for tag, model in (("ref", moe), ("ep", sharded)):
            xi = x.clone().requires_grad_()
            out = model(xi)
            (out * w).sum().backward()
            row[tag] = {
                "out": out.detach(),
                "x_grad": xi.grad,
                "grads": {n: local(p.grad).clone() for n, p in model.named_parameters()},
                "shapes": {n: tuple(local(p).shape) for n, p in model.named_parameters()},
                "counts": model.tokens_per_expert.clone(),
            }
        results[name] = row
    torch.save(results, os.path.join(out_dir, f"rank_{rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
