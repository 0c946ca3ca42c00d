"""Process groups: torchrun ranks (or a lone process) on NCCL for GPUs, gloo for CPUs.

World size 1 runs the same code as world size N: without torchrun's environment a one-rank
group is made on a free local port, so FSDP2, DCP and every collective work unchanged.

Stopping together: a rank that fails leaves a note in the group's key-value store (`post_note`)
and exits at once (`shutdown(wait=False)`: no barrier, which would pair with whatever
collective another rank is in, or wait 30 minutes). A rank waiting for data reads the notes
between short polls (`read_note`), so it stops within seconds; a rank inside a collective is
freed by gloo noticing the peer's closed connection, or by torchrun ending the job.
"""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import Store


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


def _all_reduce(values: list[float], d: Dist, op) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=d.device)
    dist.all_reduce(t, op=op)
    return t.tolist()


def all_reduce_sum(values: list[float], d: Dist) -> list[float]:
    """Sum a few floats over all ranks (one collective)."""
    return _all_reduce(values, d, dist.ReduceOp.SUM)


def all_reduce_maxes(values: list[float], d: Dist) -> list[float]:
    """The maximum over ranks of each of `values`, in one collective."""
    return _all_reduce(values, d, dist.ReduceOp.MAX)


def all_reduce_max(value: float, d: Dist) -> float:
    return all_reduce_maxes([value], d)[0]


def all_reduce_tensor_sum(t: torch.Tensor, d: Dist) -> torch.Tensor:
    """The sum over all ranks of a tensor (a copy; `t` is unchanged)."""
    out = t.detach().to(d.device, copy=True)
    dist.all_reduce(out)
    return out


def all_gather_objects(value, d: Dist) -> list:
    """Every rank's `value` (picklable), in rank order, on every rank."""
    out = [None] * d.world_size
    dist.all_gather_object(out, value)
    return out


# Kinds of notes: "failed" (a rank cannot go on; everyone leaves now) and "stopping" (a rank
# was told to stop; the others join it at their next agreement on the batch).
NOTE_KINDS = ("failed", "stopping")


def _store() -> Store:
    # The default group's store (the TCPStore the group was made with): it answers without a
    # collective, so it works while other ranks are stuck in one. Torch has no public getter.
    return dist.distributed_c10d._get_default_store()


def post_note(kind: str, text: str) -> str:
    """Leave `text` for every rank under `kind`; the first note of a kind wins and is returned.
    Best effort: a store that is gone is logged by the caller's own error, not raised here."""
    assert kind in NOTE_KINDS, kind
    try:
        if (first := read_note(kind)) is not None:
            return first
        _store().set(f"primerl/{kind}", text)
    except RuntimeError:  # DistStoreError and friends: the store's host has exited
        pass
    return text


def read_note(kind: str) -> str | None:
    """The note of `kind`, or None; a store that cannot be reached reads as a failure."""
    assert kind in NOTE_KINDS, kind
    key = f"primerl/{kind}"
    try:
        store = _store()
        return store.get(key).decode() if store.check([key]) else None
    except RuntimeError as err:
        return f"the process group's store cannot be reached ({err}): another rank has exited"


def shutdown(wait: bool = True) -> None:
    """Leave the process group. `wait`: together, so no rank tears it down while another still
    uses it. Without (this rank failed): at once; the group is left to the process's exit, as
    destroying it could wait on work that will never finish."""
    if dist.is_initialized() and wait:
        try:
            dist.barrier()
        finally:
            dist.destroy_process_group()


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with uneven splits; the backward sends the gradients back the other way."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
        ctx.out_splits, ctx.in_splits, ctx.group = out_splits, in_splits, group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        back = grad.new_empty((sum(ctx.in_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), ctx.in_splits, ctx.out_splits, group=ctx.group)
        return back, None, None, None


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group=None) -> torch.Tensor:
    """Rows of `x` (in_splits[r] of them for rank r, in rank order) to their ranks; returns the
    rows received (out_splits[r] from rank r). Differentiable."""
    return _AllToAll.apply(x, out_splits, in_splits, group)
