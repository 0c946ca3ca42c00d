"""Expert parallelism, applied from outside the model: each MoE layer keeps E / P of its experts
on each rank of an EP group, and its tokens travel to their experts' ranks and back by
all-to-all (uneven splits; gloo and NCCL alike).

    shard_experts(model, group)     # every MoE layer of a Transformer, before FSDP

Status (issue 21): the dispatch and the sharding, proved against one rank on gloo. Not yet:
the device mesh from `trainer.parallel`, FSDP2 over the remaining ranks, DCP across layouts,
moe_stats and clipping over the group.

The model code stays free of torch.distributed: `MoE.forward` sorts its assignments by expert
and calls `experts(x_AD, counts_E)` with the counts over all E experts, as on one rank; the
wrapper installed here sends each rank its experts' rows (counts first, then rows), regroups the
rows it receives by local expert, runs the local experts, and sends the outputs back into the
caller's order. The router, the shared experts and the weighting of the outputs stay on each
rank, unchanged. Each rank's local expert gradients then hold the contributions of every rank's
tokens (the all-to-all's backward carries them), which is what a data-parallel average over the
EP group would give for the whole stacked weight.

Legend: A assignments on this rank, E experts, P ranks in the EP group, L = E / P local experts.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from primerl_models.common.moe import MoE
from torch import nn

from primerl_trainer.distributed import all_to_all


def _dispatch(inner, group, size: int, local: int):
    """The forward of sharded experts: `inner` (the experts' own forward, on the local
    weights) between the dispatch and the combine."""

    def forward(x_AD: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        # 1. counts: what this rank sends each rank, per local expert there; then what it receives
        send_PL = counts_E.view(size, local)
        recv_PL = torch.empty_like(send_PL)
        dist.all_to_all_single(recv_PL, send_PL.contiguous(), group=group)
        send, recv = send_PL.sum(1).tolist(), recv_PL.sum(1).tolist()
        # 2. rows (sorted by expert, so each rank's are one block), grouped by source rank there
        rows_RD = all_to_all(x_AD, recv, send, group)
        # 3. regroup by local expert (stable: within an expert, source rank order)
        expert_R = torch.repeat_interleave(torch.arange(local, device=x_AD.device).repeat(size), recv_PL.flatten())
        order_R = expert_R.argsort(stable=True)
        out_RD = inner(rows_RD[order_R], recv_PL.sum(0))
        # 4. back to source-rank order, then to the ranks the rows came from
        return all_to_all(out_RD[order_R.argsort()], send, recv, group)

    return forward


def shard_experts(model: nn.Module, group=None) -> int:
    """Shard the experts of every MoE layer of `model` over `group` (default: all ranks): rank
    r keeps experts [r L, (r + 1) L) of each stacked weight, under the same parameter names.
    Every rank must hold the same full weights before. Returns how many layers were sharded."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    sharded = 0
    for module in model.modules():
        if not isinstance(module, MoE) or getattr(module.experts, "_primerl_ep", None):
            continue
        if module.num_experts % size:
            raise ValueError(f"{module.num_experts} experts cannot be split over an expert-parallel group of {size}")
        experts, local = module.experts, module.num_experts // size
        for name, p in list(experts.named_parameters(recurse=False)):
            shard = p.detach()[rank * local:(rank + 1) * local].clone()
            setattr(experts, name, nn.Parameter(shard, requires_grad=p.requires_grad))
        experts.forward = _dispatch(experts.forward, group, size, local)
        experts._primerl_ep = (size, rank)
        sharded += 1
    return sharded
