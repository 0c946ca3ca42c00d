"""Expert parallelism, applied from outside the model: each MoE layer keeps E / P of its experts
on each rank of an EP group, and its tokens travel to their experts' ranks and back by
all-to-all (uneven splits; gloo and NCCL alike).

    shard_experts(model, ep_mesh)   # every MoE layer of a Transformer, before FSDP (placement.py)

The stacked expert weights become DTensors sharded on dim 0 over the 1-D `ep_mesh` (rank r of
it holds experts [r L, (r + 1) L)), under the same names and with the global [E, ...] shape, so
FSDP2 shards them further over the ranks that hold the same experts, DCP saves and loads them
across layouts, and `full_tensor()` publishes the whole weight.

The model code stays free of torch.distributed: `MoE.forward` sorts its assignments by expert
and calls `experts(x_AD, counts_E)` with the counts over all E experts, as on one rank; the
wrapper installed here sends each rank its experts' rows (counts first, then rows), regroups the
rows it receives by local expert, runs `GroupedExperts.run` on the local shards (biases too), and sends the
outputs back into the caller's order. The router, the shared experts and the weighting of the
outputs stay on each rank, unchanged. Each rank's local expert gradients then hold the
contributions of every rank's tokens of its EP group (the all-to-all's backward carries them);
placement.py sets FSDP2's reduction of the expert weights so that they and the dense weights
end up as the same sum over every rank's tokens.

Legend: A assignments on this rank, E experts, P ranks in the EP group, L = E / P local experts.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from primerl_models.blocks.moe import GroupedExperts, MoE, inverse_order, take_rows
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from primerl_trainer.distributed import all_to_all


def _local(w: torch.Tensor) -> torch.Tensor:
    return w.to_local() if isinstance(w, DTensor) else w


def _dispatch(experts: GroupedExperts, group, size: int, local: int):
    """The forward of sharded experts: the local experts' math between the dispatch and the combine."""

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
        back_R = inverse_order(order_R)
        weights = {name: _local(p) for name, p in experts.named_parameters(recurse=False)}
        out_RD = experts.run(take_rows(rows_RD, order_R, back_R), recv_PL.sum(0), weights)
        # 4. back to source-rank order, then to the ranks the rows came from
        return all_to_all(take_rows(out_RD, back_R, order_R), send, recv, group)

    return forward


def shard_experts(model: nn.Module, ep_mesh: DeviceMesh) -> int:
    """Shard the experts of every MoE layer of `model` over the 1-D `ep_mesh`: rank r of it
    keeps experts [r L, (r + 1) L) of each stacked weight, a DTensor (Shard(0)) under the same
    name. Every rank must hold the same full weights before. Returns how many layers were sharded."""
    size, rank, group = ep_mesh.size(), ep_mesh.get_local_rank(), ep_mesh.get_group()
    sharded = 0
    for module in model.modules():
        if not isinstance(module, MoE) or getattr(module.experts, "_primerl_ep", None):
            continue
        if module.num_experts % size:
            raise ValueError(f"{module.num_experts} experts cannot be split over an expert-parallel group of {size}")
        experts, local = module.experts, module.num_experts // size
        for name, p in list(experts.named_parameters(recurse=False)):
            shard = p.detach()[rank * local : (rank + 1) * local].clone()
            dt = DTensor.from_local(shard, ep_mesh, [Shard(0)], run_check=False)
            setattr(experts, name, nn.Parameter(dt, requires_grad=p.requires_grad))
        experts.forward = _dispatch(experts, group, size, local)
        setattr(experts, "_primerl_ep", (size, rank))  # a marker (getattr above), not a module attribute
        sharded += 1
    return sharded
