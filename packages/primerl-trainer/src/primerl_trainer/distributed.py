"""Process groups: torchrun ranks (or a lone process) on NCCL for GPUs, gloo for CPUs.

World size 1 runs the same code as world size N: without torchrun's environment a one-rank
group is made on a free local port, so FSDP2, DCP and every collective work unchanged.
"""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Dist:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        dist.barrier()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(timeout_s: float = 1800.0) -> Dist:
    """Join (or make) the default process group; pick this rank's device."""
    if "RANK" not in os.environ:  # a lone process: make a one-rank group
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    return Dist(dist.get_rank(), dist.get_world_size(), local_rank, device)


def all_reduce_sum(values: list[float], d: Dist) -> list[float]:
    """Sum a few floats over all ranks (one collective)."""
    t = torch.tensor(values, dtype=torch.float64, device=d.device)
    dist.all_reduce(t)
    return t.tolist()


def all_reduce_max(value: float, d: Dist) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=d.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def shutdown() -> None:
    """Leave the process group together: no rank tears it down while another still uses it."""
    if dist.is_initialized():
        try:
            dist.barrier()
        finally:
            dist.destroy_process_group()
