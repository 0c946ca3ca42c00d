"""What FP8 training (trainer.precision = "fp8") costs in precision, against bf16 in the same run.

1. Logprob mismatch on the RL trainer step's shape (bench/trainer_step.py's: Qwen3-1.7B, one
   16,384-token row of 8 documents, random weights): the same weights and tokens through the
   model with its projections in bf16 (bf16 parameters, as FSDP2 gathers them in the trainer)
   and in FP8 (the trainer's own conversion, primerl_trainer.precision), and in fp32 for scale.
   Per pair: mean token KL over the whole vocabulary, mean / p99 / max |logprob difference| of
   the row's next tokens. In RL the servers sample in bf16 and the trainer recomputes the
   logprobs: fp8 vs bf16 is the mismatch FP8 adds to the importance ratios, bf16 vs fp32 what
   bf16 already has. Random weights give nearly flat distributions (the entropy column says how
   flat), so part 2 measures again on trained weights.
2. A short SFT run (default 30 AdamW steps of a 8-layer, 1024-wide Qwen3 on a random Markov
   chain: learnable, with a known floor) from the same initial weights and batches: bf16, fp8
   (trainer.precision = "fp8") and fp8gw (torchao's recipe with the weight gradient in bf16),
   fp32 master weights under bf16 autocast; the loss table, then part 1's mismatch on the
   trained bf16 model's weights, on held-out data.

    PYTHONPATH=packages/primerl-models/src:packages/primerl-trainer/src python bench/fp8_mismatch.py
    python bench/fp8_mismatch.py --device cpu     # a smoke check of the code path on tiny shapes

Needs torchao (primerl-trainer's dependency). On the CPU, torch's `_scaled_mm` takes e4m3
operands too, so the FP8 path runs there (slowly; without autocast, fp32 against FP8); its
numbers only check the code.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
from pathlib import Path

import torch
from primerl_models import ModelArgs, Transformer
from primerl_models.families import FAMILIES, TinyShape

sys.path.insert(0, str(Path(__file__).parent))
from model_step import our_args  # noqa: E402  (the trainer step's shapes)
from primerl_trainer.precision import convert_to_fp8  # noqa: E402

FORWARDS = {"fp8": ("rowwise", False), "fp8big": ("rowwise", True)}
"""The FP8 forwards compared with bf16's: the trainer's, and only the large projections (model_step's :fp8big).
fp8gw's forward is fp8's (it differs in the backward only)."""
RECIPES = {"fp8": "rowwise", "fp8gw": "rowwise_with_gw_hp"}
"""The SFT runs beside bf16."""


def packed(ids_NT: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Documents [N, T] as one packed row: ids and positions [1, N T], and the mask [1, N T] of the
    tokens whose next token is in the same document."""
    n, t = ids_NT.shape
    pos = torch.arange(t, device=ids_NT.device).repeat(n)[None]
    inside = torch.ones(n, t, dtype=torch.bool, device=ids_NT.device)
    inside[:, -1] = False
    return ids_NT.reshape(1, -1), pos, inside.reshape(1, -1)


@torch.no_grad()
def hidden_states(model: Transformer, ids, pos) -> torch.Tensor:
    return model(ids, pos)[0]


@torch.no_grad()
def compare(
    hidden: dict[str, torch.Tensor], heads: dict[str, torch.Tensor], ids, inside, pairs, chunk: int
) -> list[dict]:
    """Per (p, q) of `pairs`: mean KL(p || q) over the vocabulary, and |log p - log q| of the next
    tokens (mean, p99, max), over the tokens whose next token is in their document; the logits
    in fp32 from each model's hidden states and its own output weight."""
    targets = torch.roll(ids[0], -1)
    keep = inside[0]
    kl = {pair: [] for pair in pairs}
    diff = {pair: [] for pair in pairs}
    entropy, target_lp = [], []
    for start in range(0, targets.shape[0], chunk):
        sl = slice(start, start + chunk)
        logp = {k: torch.log_softmax(h[sl].float() @ heads[k].float().T, dim=-1) for k, h in hidden.items()}
        t, m = targets[sl], keep[sl]
        first = next(iter(logp.values()))
        entropy.append(-(first.exp() * first).sum(-1)[m])
        target_lp.append(first.gather(1, t[:, None])[:, 0][m])
        for p, q in pairs:
            kl[(p, q)].append((logp[p].exp() * (logp[p] - logp[q])).sum(-1)[m])
            diff[(p, q)].append((logp[p].gather(1, t[:, None]) - logp[q].gather(1, t[:, None]))[:, 0][m].abs())
        del logp
    rows = []
    for pair in pairs:
        k, d = torch.cat(kl[pair]), torch.cat(diff[pair])
        rows.append(
            {
                "pair": f"{pair[1]} vs {pair[0]}",
                "mean_kl": float(k.mean()),
                "mean_abs_dlogp": float(d.mean()),
                "p99_abs_dlogp": float(torch.quantile(d.float(), 0.99)),
                "max_abs_dlogp": float(d.max()),
                "tokens": int(d.numel()),
            }
        )
    rows[0]["entropy"] = float(torch.cat(entropy).mean())
    rows[0]["mean_target_logprob"] = float(torch.cat(target_lp).mean())
    return rows


def mismatch(base: Transformer, ids, pos, inside, device: str, chunk: int) -> list[dict]:
    """Part 1 on `base`'s weights (fp32, on `device`): fp32, bf16 and each FP8 forward of FORWARDS."""
    cuda = device == "cuda"
    bf16 = torch.bfloat16 if cuda else torch.float32  # the CPU: fp32 against FP8 (a smoke check)
    models = {"fp32": base, "bf16": copy.deepcopy(base).to(bf16)} if cuda else {"fp32": base}
    base.attn_backend = "sdpa"  # fp32: the flash (varlen) kernels take bf16 only
    for name, (recipe, large_only) in FORWARDS.items():
        models[name] = copy.deepcopy(base).to(bf16)
        if not convert_to_fp8(models[name], recipe, large_only):
            del models[name]  # nothing large enough to convert: the same forward as bf16
    for m in models.values():
        m.eval()
    hidden = {k: hidden_states(m, ids, pos) for k, m in models.items()}
    heads = {k: m.output_weight for k, m in models.items()}
    refs = ("bf16", "fp32") if cuda else ("fp32",)
    pairs = [("fp32", "bf16")] * cuda + [(ref, k) for k in models if k.startswith("fp8") for ref in refs]
    return compare(hidden, heads, ids, inside, pairs, chunk)


def markov_chain(vocab: int, successors: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A random first-order chain: each token's `successors` next tokens [V, S] and their
    probabilities [V, S] (Dirichlet(0.5): a few likely, most rare)."""
    nexts = torch.randint(0, vocab, (vocab, successors), generator=g)
    probs = -torch.log(torch.rand(vocab, successors, generator=g)).pow(2)  # Gamma(0.5)-like weights
    return nexts, probs / probs.sum(-1, keepdim=True)


def walk(nexts, probs, docs: int, length: int, g: torch.Generator, device: str) -> torch.Tensor:
    """`docs` walks of `length` tokens [docs, length] (on the CPU, then moved), each from a
    uniform first token."""
    cur = torch.randint(0, nexts.shape[0], (docs,), generator=g)
    out = [cur]
    for _ in range(length - 1):
        cur = nexts[cur, torch.multinomial(probs[cur], 1, generator=g)[:, 0]]
        out.append(cur)
    return torch.stack(out, dim=1).to(device)


def qwen3_args(shape: TinyShape) -> ModelArgs:
    f = FAMILIES["qwen3"]
    return f.args_from_hf(f.tiny_config(shape))


SFT_SHAPE = TinyShape(
    vocab_size=8192, hidden_size=1024, num_layers=8, num_heads=16, num_kv_heads=8, head_dim=64, intermediate_size=3072
)
CPU_SHAPE = TinyShape(vocab_size=256, hidden_size=64, num_layers=2, head_dim=16, intermediate_size=128)
"""Both parts' shape on the CPU (a smoke check)."""


def sft(args: ModelArgs, batches, device: str, lr: float, recipe: str | None) -> tuple[list[float], Transformer, float]:
    """AdamW steps over `batches` (each (ids, pos, inside)) from seed 0's weights, fp32 master
    weights under bf16 autocast (fp32 on the CPU); the losses, the model and seconds per step."""
    torch.manual_seed(0)
    with torch.device(device):
        model = Transformer(args)
    model.init_weights()
    if recipe is not None:
        convert_to_fp8(model, recipe)
    opt = torch.optim.AdamW(
        model.parameters(), lr=lr, weight_decay=0.0, **({"fused": True} if device == "cuda" else {})
    )
    losses, t0 = [], time.perf_counter()
    for i, (ids, pos, inside) in enumerate(batches):
        for group in opt.param_groups:
            group["lr"] = lr * min(1.0, (i + 1) / 5)  # 5 steps of warm-up
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
            logprobs, _ = model(ids, pos, torch.roll(ids, -1))
        loss = -(logprobs * inside).sum() / inside.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    if device == "cuda":
        torch.cuda.synchronize()
    return losses, model, (time.perf_counter() - t0) / len(batches)


def print_mismatch(title: str, rows: list[dict]) -> None:
    print(f"\n{title}")
    first = rows[0]
    print(
        f"  fp32 distributions: mean entropy {first['entropy']:.3f} nats, mean next-token logprob {first['mean_target_logprob']:.3f}"
    )
    print(f"  {'pair':<14} {'mean KL':>10} {'mean |dlogp|':>13} {'p99 |dlogp|':>12} {'max |dlogp|':>12} {'tokens':>8}")
    for r in rows:
        print(
            f"  {r['pair']:<14} {r['mean_kl']:>10.2e} {r['mean_abs_dlogp']:>13.2e} {r['p99_abs_dlogp']:>12.2e} "
            f"{r['max_abs_dlogp']:>12.2e} {r['tokens']:>8}"
        )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--model", default="qwen3-1.7b", help="part 1's shape (bench/model_step.py's SHAPES)")
    p.add_argument("--seq", type=int, default=16384)
    p.add_argument("--docs", type=int, default=8)
    p.add_argument("--steps", type=int, default=30, help="part 2's SFT steps")
    p.add_argument("--sft-seq", type=int, default=16384, help="tokens per SFT step (documents of 512)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--skip-shape", action="store_true", help="part 2 only")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    a = p.parse_args()
    device = a.device
    if device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: no GPU here (try --device cpu for a smoke check)")
        if torch.cuda.get_device_capability() < (8, 9):
            raise SystemExit(f"{torch.cuda.get_device_name()} has no FP8 matmuls (compute capability < 8.9)")
        torch.backends.cuda.matmul.allow_tf32 = False
    else:  # tiny shapes: the code path only
        a.model, a.seq, a.docs, a.steps, a.sft_seq = "tiny", 256, 4, min(a.steps, 4), 1024
    results: dict = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu"}
    g = torch.Generator().manual_seed(0)

    if not a.skip_shape:  # part 1: the trainer step's shape, random weights
        args = our_args(a.model) if device == "cuda" else qwen3_args(CPU_SHAPE)
        torch.manual_seed(0)
        with torch.device(device):
            base = Transformer(args)
        base.init_weights()
        ids, pos, inside = packed(torch.randint(0, args.vocab_size, (a.docs, a.seq // a.docs), generator=g).to(device))
        rows = mismatch(base, ids, pos, inside, device, chunk=1024)
        results["shape"] = {"model": a.model, "seq": a.seq, "docs": a.docs, "rows": rows}
        print_mismatch(
            f"1. {a.model}, {a.seq} tokens in {a.docs} documents, random weights (same weights, same tokens)", rows
        )
        del base
        if device == "cuda":
            torch.cuda.empty_cache()

    # part 2: SFT on a random Markov chain, the same weights and batches for each run
    args = qwen3_args(SFT_SHAPE if device == "cuda" else CPU_SHAPE)
    nexts, probs = markov_chain(args.vocab_size, 8, g)
    floor = float(-(probs * probs.clamp_min(1e-12).log()).sum(-1).mean())
    docs = a.sft_seq // 512
    batches = [packed(walk(nexts, probs, docs, 512, g, device)) for _ in range(a.steps + 1)]
    held_out = batches.pop()
    curves, speed, trained = {}, {}, None
    for name, recipe in {"bf16": None, **RECIPES}.items():
        curves[name], model, speed[name] = sft(args, batches, device, a.lr, recipe)
        if name == "bf16":
            trained = model
        del model
    if device == "cpu":
        print("\n(on the CPU the bf16 run computes in fp32: no autocast)")
    print(
        f"\n2. SFT, {args.num_layers} layers of {args.hidden_size}, vocabulary {args.vocab_size}, {a.sft_seq} tokens a step, lr {a.lr}"
    )
    print(
        f"   on a random Markov chain (its entropy, the loss floor: about {floor:.2f} nats); same initial weights and batches"
    )
    names = list(curves)
    print(
        "  "
        + f"{'step':>4} "
        + " ".join(f"{n:>8}" for n in names)
        + " "
        + " ".join(f"{n + '-bf16':>11}" for n in names[1:])
    )
    for i in range(len(batches)):
        if i % max(1, len(batches) // 10) and i != len(batches) - 1:
            continue
        vals = [curves[n][i] for n in names]
        print(
            f"  {i:>4} "
            + " ".join(f"{v:>8.4f}" for v in vals)
            + " "
            + " ".join(f"{v - vals[0]:>+11.4f}" for v in vals[1:])
        )
    print(
        "  s/step "
        + " ".join(f"{n}={speed[n]:.3f}" for n in names)
        + " (eager: FP8's casts unfused; timings are model_step.py's job)"
    )
    results["sft"] = {
        "layers": args.num_layers,
        "hidden": args.hidden_size,
        "floor": floor,
        "losses": curves,
        "s_per_step": speed,
    }

    assert trained is not None
    ids, pos, inside = held_out
    rows = mismatch(trained, ids, pos, inside, device, chunk=1024)
    results["trained"] = rows
    print_mismatch("3. the same mismatch on the trained bf16 run's weights, held-out walks", rows)
    finite = all(math.isfinite(v) for c in curves.values() for v in c)
    print(f"\nall losses finite: {finite}")
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
