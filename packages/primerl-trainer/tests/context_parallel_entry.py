"""Run by test_context_parallel.py under torchrun (gloo, CPU): the same q, k, v of a packed row on
every rank; the whole row's attention (the reference) and Ulysses attention over the ranks'
chunks, with their gradients, saved to OUT/rank_R.pt."""

import os
import sys

import torch
import torch.distributed as dist
from primerl_models import PackedSeqs
from primerl_models.common.attention import attention
from primerl_trainer.context_parallel import ulysses_attention


def main(out_dir: str) -> None:
    dist.init_process_group("gloo")
    rank, p = dist.get_rank(), dist.get_world_size()
    rows = [[4, 5, 3], [7, 5]]  # 2 rows of 12 tokens; a document crosses the split at 6 in each
    pos = torch.stack([torch.cat([torch.arange(n) for n in lengths]) for lengths in rows])
    seqs = PackedSeqs.from_position_ids(pos)
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(2, 12, 4, 8, generator=g), torch.randn(2, 12, 2, 8, generator=g), torch.randn(2, 12, 2, 8, generator=g)
    w = torch.randn(2, 12, 4, 8, generator=g)
    c = 12 // p
    mine = slice(rank * c, (rank + 1) * c)
    results = {}
    for backend in ("sdpa",):
        full = [x.clone().requires_grad_() for x in (q, k, v)]
        ref = attention(*full, seqs, backend)
        (ref * w).sum().backward()
        local = [x[:, mine].clone().requires_grad_() for x in (q, k, v)]
        out = ulysses_attention(*local, seqs, backend)
        (out * w[:, mine]).sum().backward()
        # the whole row's gradient of each chunk: this rank's loss reaches every rank's chunk
        results[backend] = {
            "ref": ref.detach()[:, mine], "out": out.detach(),
            "ref_grads": [x.grad for x in full], "grads": [x.grad for x in local],
        }
    torch.save(results, os.path.join(out_dir, f"rank_{rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
