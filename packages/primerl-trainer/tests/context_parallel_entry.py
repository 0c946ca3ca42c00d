"""Run by test_context_parallel.py under torchrun (gloo, CPU): the same q, k, v of packed rows on
every rank; the whole rows' attention (the reference) and Ulysses attention over the ranks'
chunks, with their gradients; then whole tiny models (Qwen3, GLM-4.5) on the whole row and with
Ulysses over the ranks' chunks, their logprobs and parameter gradients. Saved to OUT/rank_R.pt."""

import copy
import os
import sys

import torch
import torch.distributed as dist
from primerl_models import PackedSeqs
from primerl_models.blocks.attention import attention
from primerl_models.families import FAMILIES, TinyShape
from primerl_models.model import Transformer
from primerl_trainer.context_parallel import UlyssesAttention, chunk_of, ulysses_attention


def whole_model(family: str) -> dict:
    """logprobs and gradients of a tiny model on one packed row of 16 tokens (documents of 5, 7
    and 4: the second crosses the split), whole and over the ranks' chunks."""
    cfg = FAMILIES[family].tiny_config(
        TinyShape(
            vocab_size=40,
            hidden_size=32,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            head_dim=8,
            moe_intermediate_size=16,
        )
    )
    model = Transformer(FAMILIES[family].args_from_hf(cfg))
    model.init_weights(std=0.3, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 40, (1, 16), generator=g)
    pos = torch.cat([torch.arange(n) for n in (5, 7, 4)])[None]
    targets, weights = torch.roll(ids, -1, dims=1), torch.randn(1, 16, generator=g)
    split = copy.deepcopy(model)
    lp_whole, _ = model(ids, pos, targets)
    (lp_whole * weights).sum().backward()
    split.attn_backend = UlyssesAttention()
    seqs = PackedSeqs.from_position_ids(pos)  # the whole row's boundaries
    lp, _ = split(chunk_of(ids), chunk_of(pos), chunk_of(targets), seqs=seqs)
    (lp * chunk_of(weights)).sum().backward()
    grads = {}
    for name, param in split.named_parameters():
        grad = param.grad.clone()
        dist.all_reduce(grad)  # what data-parallel reduction over the CP group sums
        grads[name] = grad
    return {
        "logprobs": lp.detach(),
        "ref_logprobs": chunk_of(lp_whole.detach()),
        "grads": grads,
        "ref_grads": {n: p.grad for n, p in model.named_parameters()},
    }


def main(out_dir: str) -> None:
    dist.init_process_group("gloo")
    rank, p = dist.get_rank(), dist.get_world_size()
    rows = [[4, 5, 3], [7, 5]]  # 2 rows of 12 tokens; a document crosses the split at 6 in each
    pos = torch.stack([torch.cat([torch.arange(n) for n in lengths]) for lengths in rows])
    seqs = PackedSeqs.from_position_ids(pos)
    g = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(2, 12, 4, 8, generator=g),
        torch.randn(2, 12, 2, 8, generator=g),
        torch.randn(2, 12, 2, 8, generator=g),
    )
    w = torch.randn(2, 12, 4, 8, generator=g)
    c = 12 // p
    mine = slice(rank * c, (rank + 1) * c)
    results = {}
    sinks = torch.randn(4, generator=g)
    for case, window, with_sinks in (("sdpa", None, False), ("window+sinks", 3, True)):
        full = [x.clone().requires_grad_() for x in (q, k, v)]
        s_full = sinks.clone().requires_grad_() if with_sinks else None
        ref = attention(*full, seqs, "sdpa", window=window, sinks_H=s_full)
        (ref * w).sum().backward()
        local = [x[:, mine].clone().requires_grad_() for x in (q, k, v)]
        s_local = sinks.clone().requires_grad_() if with_sinks else None
        out = ulysses_attention(*local, seqs, "sdpa", window=window, sinks_H=s_local)
        (out * w[:, mine]).sum().backward()
        # the whole row's gradient of each chunk: this rank's loss reaches every rank's chunk
        results[case] = {
            "ref": ref.detach()[:, mine],
            "out": out.detach(),
            "ref_grads": [x.grad for x in full],
            "grads": [x.grad for x in local],
        }
        if with_sinks:  # each rank's sink gradient covers its heads; summed over ranks, the whole
            grad = s_local.grad.clone()
            dist.all_reduce(grad)
            results[case].update(sinks_grad=grad, ref_sinks_grad=s_full.grad)
    for family in ("qwen3", "glm4_moe", "gpt_oss", "afmoe", "laguna", "qwen3_5_text", "nemotron_h"):
        results[family] = whole_model(family)
    torch.save(results, os.path.join(out_dir, f"rank_{rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
