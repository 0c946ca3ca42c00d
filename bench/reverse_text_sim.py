"""A fast stand-in of the reverse-text example for choosing its settings: the same tiny Qwen3
(primerl-models), the same SFT data and warm-up, then RL with one-step-stale samples (what
max_async_level = 1 gives), GRPO advantages and an AIPO-style loss, with sampling done here in
plain PyTorch instead of vLLM. Runs many settings in one go on a GPU (or slowly on a CPU).

    PYTHONPATH=packages/primerl-models/src python bench/reverse_text_sim.py --out sweep.json

Only for choosing settings: the example itself (examples/reverse_text) is the measurement.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import random
import string
import tempfile
import time
from pathlib import Path

import torch
from primerl_models.hf import load_model
from primerl_models.tiny import build_tiny_model

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("scoring", ROOT / "packages/primerl-envs/src/primerl_envs/scoring.py")
scoring = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(scoring)

ALPHABET = string.ascii_lowercase


def strings(rng: random.Random, n: int) -> list[str]:
    return ["".join(rng.choice(ALPHABET) for _ in range(rng.randint(4, 8))) for _ in range(n)]


class Tok:
    def __init__(self, folder: Path):
        from tokenizers import Tokenizer

        self.t = Tokenizer.from_file(str(folder / "tokenizer.json"))
        self.end = self.t.token_to_id("<|im_end|>")
        self.pad = self.t.token_to_id("<|endoftext|>")

    def prompt(self, text: str) -> list[int]:
        return self.t.encode(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n").ids

    def chars(self, text: str) -> list[int]:
        return self.t.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self.t.decode(ids)


def left_pad(seqs: list[list[int]], pad: int, device):
    """Rows right-aligned; the padding is its own document (positions restart)."""
    t = max(map(len, seqs))
    ids = torch.full((len(seqs), t), pad, dtype=torch.long)
    pos = torch.zeros((len(seqs), t), dtype=torch.long)
    for i, s in enumerate(seqs):
        p = t - len(s)
        ids[i, p:] = torch.tensor(s)
        pos[i, :p] = torch.arange(p)
        pos[i, p:] = torch.arange(len(s))
    return ids.to(device), pos.to(device)


def seq_logprobs(model, seqs: list[list[int]], starts: list[int], pad: int, device, temperature: float = 1.0):
    """Per-row (token logprobs [B, T-1], completion mask [B, T-1]) of right-aligned rows."""
    ids, pos = left_pad(seqs, pad, device)
    logits = model.logits(ids, pos).float() / temperature
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
    t = ids.shape[1]
    mask = torch.zeros_like(lp, dtype=torch.bool)
    for i, (s, st) in enumerate(zip(seqs, starts)):
        off = t - len(s)
        mask[i, off + st - 1 :] = True  # predicting tokens st.. of the sequence
    return lp, mask


@torch.no_grad()
def sample(model, prompts: list[list[int]], tok: Tok, max_tokens: int, temperature: float, device, gen):
    seqs = [list(p) for p in prompts]
    done = [False] * len(seqs)
    for _ in range(max_tokens):
        ids, pos = left_pad(seqs, tok.pad, device)
        logits = model.logits(ids, pos)[:, -1].float() / temperature
        nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)[:, 0].tolist()
        for i, n in enumerate(nxt):
            if not done[i]:
                seqs[i].append(n)
                done[i] = n == tok.end
        if all(done):
            break
    # finished rows may have grown pad-free; rows that stopped early keep their tokens only
    return seqs


def sft(model, tok: Tok, steps: int, lr: float, warmup: int, batch: int, device, seed: int):
    rng = random.Random(1234)
    data = strings(rng, 8192)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    order = list(range(len(data)))
    random.Random(seed).shuffle(order)
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr * min(1.0, (step + 1) / warmup) if warmup else lr
        texts = [data[order[(step * batch + i) % len(data)]] for i in range(batch)]
        prompts = [tok.prompt(t) for t in texts]
        seqs = [p + tok.chars(t[::-1]) + [tok.end] for p, t in zip(prompts, texts)]
        lp, mask = seq_logprobs(model, seqs, [len(p) for p in prompts], tok.pad, device)
        loss = -(lp * mask).sum() / mask.sum()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    return float(loss)


def rl(model, tok: Tok, cfg: dict, device, seed: int) -> list[dict]:
    """k = 1: the batch trained at step n was sampled by the weights before step n - 1."""
    import copy

    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=0.01)
    rng = random.Random(seed)
    gen = torch.Generator(device=device).manual_seed(seed)
    tasks = strings(random.Random(0), 10000)
    sampler = copy.deepcopy(model)
    rows, k = [], cfg.get("k", 1)
    history = [copy.deepcopy(model.state_dict())]
    for step in range(cfg["steps"]):
        # sample with the policy k steps old
        sampler.load_state_dict(history[max(0, len(history) - 1 - k)])
        texts = [tasks[rng.randrange(len(tasks))] for _ in range(cfg["prompts"])]
        prompts = [tok.prompt(t) for t in texts for _ in range(cfg["group"])]
        answers = [t[::-1] for t in texts for _ in range(cfg["group"])]
        seqs = sample(sampler, prompts, tok, 16, cfg.get("temperature", 1.0), device, gen)
        comps = [s[len(p) :] for s, p in zip(seqs, prompts)]
        rewards = torch.tensor(
            [scoring.lcs_ratio(tok.decode([c for c in comp if c != tok.end]), a) for comp, a in zip(comps, answers)]
        )
        r = rewards.view(cfg["prompts"], cfg["group"])
        adv = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-6)).view(-1)
        keep = [i for i in range(len(seqs)) if (r.std(1) > 0).repeat_interleave(cfg["group"])[i] and len(comps[i])]
        starts = [len(p) for p in prompts]
        with torch.no_grad():
            mu, _ = seq_logprobs(sampler, [seqs[i] for i in keep], [starts[i] for i in keep], tok.pad, device)
        for g in opt.param_groups:
            g["lr"] = cfg["lr"] * min(1.0, (step + 1) / cfg["warmup"]) if cfg["warmup"] else cfg["lr"]
        pi, mask = seq_logprobs(model, [seqs[i] for i in keep], [starts[i] for i in keep], tok.pad, device)
        ratio = (pi - mu).detach().exp()
        a = adv[keep].to(device)[:, None]
        loss = -(ratio.clamp(max=8.0) * a * pi * mask).sum() / mask.sum()
        kl = float(((ratio - ratio.log() - 1) * mask).sum() / mask.sum())
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        history.append(copy.deepcopy(model.state_dict()))
        history = history[-(k + 2) :]
        rows.append({"step": step, "reward": float(rewards.mean()), "kl": kl})
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="sweep.json")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--grid", help="JSON of the grid to run instead of the default")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    folder = Path(tempfile.mkdtemp()) / "base"
    build_tiny_model(
        folder,
        "qwen3",
        alphabet=ALPHABET,
        hidden_size=128,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        seed=0,
    )
    tok = Tok(folder)
    results = []
    sft_cache = {}
    grid = {
        "sft_steps": [40, 50, 60],
        "lr": [1e-4, 2e-4, 3e-4, 5e-4],
        "prompts": [8, 16, 32],
        "warmup": [10],
        "k": [1],
        "seed": [0],
    }
    if args.quick:
        grid = {"sft_steps": [50], "lr": [2e-4], "prompts": [16], "warmup": [10]}
    if args.grid:
        grid = json.loads(args.grid)
    steps = args.steps
    grid = {"k": [1], "seed": [0]} | grid
    for k, seed, sft_steps, lr, prompts, warmup in itertools.product(
        *(grid[n] for n in ("k", "seed", "sft_steps", "lr", "prompts", "warmup"))
    ):
        t0 = time.time()
        if sft_steps not in sft_cache:
            model = load_model(folder, device, attn_backend="sdpa")
            sft_loss = sft(model, tok, sft_steps, 1e-3, 20, 128, device, seed=1)
            sft_cache[sft_steps] = ({k: v.clone() for k, v in model.state_dict().items()}, sft_loss)
        state, sft_loss = sft_cache[sft_steps]
        model = load_model(folder, device, attn_backend="sdpa")
        model.load_state_dict(state)
        cfg = {"lr": lr, "prompts": prompts, "group": 8, "warmup": warmup, "steps": steps, "k": k, "seed": seed}
        rows = rl(model, tok, cfg, device, seed=seed)
        first = sum(r["reward"] for r in rows[:20]) / 20
        last = sum(r["reward"] for r in rows[-20:]) / 20
        maxkl = max(r["kl"] for r in rows)
        mid = sum(r["reward"] for r in rows[80:100]) / 20
        over = sum(r["kl"] > 1e-2 for r in rows)
        res = {
            "sft_steps": sft_steps,
            "sft_loss": sft_loss,
            **cfg,
            "first20": first,
            "last20": last,
            "steps80_100": mid,
            "max_kl": maxkl,
            "kl_over": over,
            "s": time.time() - t0,
            "rows": rows,
        }
        results.append(res)
        print(
            f"k {k} seed {seed} sft {sft_steps} ({sft_loss:.2f}) lr {lr:.0e} prompts {prompts}: first20 {first:.3f} "
            f"80-100 {mid:.3f} last20 {last:.3f} rise {last - first:+.3f} max kl {maxkl:.1e} ({over} over 1e-2) ({time.time() - t0:.0f}s)",
            flush=True,
        )
        Path(args.out).write_text(json.dumps(results))


if __name__ == "__main__":
    main()
