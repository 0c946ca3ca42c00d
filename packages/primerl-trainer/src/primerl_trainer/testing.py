"""Test doubles and launchers for trainer tests (and for anyone testing against a trainer).

`FakeOrchestrator` is a stand-in for the orchestrator, and says so: it binds the same sockets
the real one does, pushes TrainBatches it is given to each rank and collects PolicyReady
messages. `launch_trainer` starts the real trainer under torchrun as a subprocess.
"""

from __future__ import annotations

import contextlib
import os
import random
import socket
import subprocess
import sys
from pathlib import Path
from typing import Literal

import numpy as np
from primerl_protocol import (
    BatchMessage,
    Heartbeat,
    MicroBatch,
    PolicyMessage,
    PolicyReady,
    Receiver,
    Sender,
    Shutdown,
    SocketSettings,
    TrainBatch,
)


def _ephemeral_low() -> int:
    try:
        return int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port_block(n: int) -> int:
    """A port p such that p .. p + n - 1 were all free just now, below the kernel's ephemeral
    range: a port taken from that range (bind to port 0) can be handed to any other process
    (vLLM's, verifiers' and torchrun's own sockets) before ours binds it."""
    rng = random.Random()
    high = max(_ephemeral_low() - n, 10000 + n)
    for _ in range(200):
        base = rng.randrange(10000, high)
        ok = True
        for p in range(base, base + n):
            with socket.socket() as t:
                try:
                    t.bind(("127.0.0.1", p))
                except OSError:
                    ok = False
                    break
        if ok:
            return base
    raise RuntimeError("no free port block")


def synthetic_micro_batch(
    vocab: int, seed: int, prompt: int = 6, completion: int = 10, num_seqs: int = 2
) -> MicroBatch:
    """Rows of `num_seqs` samples; sample i gets advantage +1 if i is even, else -1."""
    rng = np.random.default_rng(seed)
    n = prompt + completion
    mask = np.tile(np.r_[np.zeros(prompt, bool), np.ones(completion, bool)], num_seqs)
    adv = np.repeat(np.where(np.arange(num_seqs) % 2 == 0, 1.0, -1.0).astype(np.float32), n)
    return MicroBatch(
        input_ids=rng.integers(3, vocab, n * num_seqs, dtype=np.int32),
        loss_mask=mask,
        inference_logprobs=np.where(mask, -4.0, 0.0).astype(np.float32),
        advantages=adv,
        temperatures=np.ones(n * num_seqs, np.float32),
        seq_lens=np.full(num_seqs, n, np.int32),
        sample_ids=np.arange(num_seqs, dtype=np.int64) + 100 * seed,
        policy_steps=np.zeros(num_seqs, np.int32),
    )


def synthetic_batches(step: int, num_ranks: int, vocab: int, micro_batches: int = 2) -> list[TrainBatch]:
    """The same data every step (a fixed batch), split over ranks."""
    per_rank = [[synthetic_micro_batch(vocab, seed=r * 10 + i) for i in range(micro_batches)] for r in range(num_ranks)]
    loss_tokens = sum(int(mb.loss_mask.sum()) for mbs in per_rank for mb in mbs)
    seqs = sum(len(mb.seq_lens) for mbs in per_rank for mb in mbs)
    return [
        TrainBatch(
            step=step, rank=r, num_ranks=num_ranks, micro_batches=mbs, num_loss_tokens=loss_tokens, num_sequences=seqs
        )
        for r, mbs in enumerate(per_rank)
    ]


def write_trainer_config(
    path: Path,
    model: str | Path,
    run_dir: str | Path,
    port: int,
    max_steps: int,
    trainer,
    *,
    seq_len: int = 64,
    recv_timeout_s: float = 120.0,
    wandb: Literal["auto", "online", "offline", "disabled"] = "disabled",
) -> Path:
    """A trainer run config (TOML at `path`) whose sockets meet a FakeOrchestrator made with the
    same `port` (policy at `port`, batches at `port + 1`); `trainer` is its TrainerConfig."""
    from primerl_protocol.config import ModelConfig, TransportConfig, WandbConfig, to_toml

    from primerl_trainer.config import TrainerRunConfig

    cfg = TrainerRunConfig(
        model=ModelConfig(name=str(model)),
        seq_len=seq_len,
        max_steps=max_steps,
        run_dir=str(run_dir),
        transport=TransportConfig(
            batch_port=port + 1, policy_port=port, sockets=SocketSettings(recv_timeout_s=recv_timeout_s, linger_ms=0)
        ),
        wandb=WandbConfig(mode=wandb),
        trainer=trainer,
    )
    path.write_text(to_toml(cfg))
    return path


class FakeOrchestrator:
    """A test double of the orchestrator: same sockets, batches supplied by the test."""

    def __init__(self, host: str, batch_port: int, policy_port: int, num_ranks: int):
        settings = SocketSettings(linger_ms=0, send_timeout_s=60.0)
        self.senders = [
            Sender(
                f"tcp://{host}:{batch_port + r}", BatchMessage, channel=f"batches/rank{r}", bind=True, settings=settings
            )
            for r in range(num_ranks)
        ]
        self.policy = Receiver(
            f"tcp://{host}:{policy_port}", PolicyMessage, channel="policy", bind=True, settings=settings
        )

    def send(self, batches: list) -> None:
        for sender, batch in zip(self.senders, batches):
            sender.send(batch)

    def wait_policy(self, timeout_s: float = 120.0) -> PolicyReady:
        while True:
            msg = self.policy.recv(timeout_s=timeout_s)
            if isinstance(msg, PolicyReady):
                return msg

    def next_policy_message(self, timeout_s: float = 120.0) -> PolicyReady | Shutdown:
        """The trainer's next PolicyReady or Shutdown (heartbeats skipped)."""
        while True:
            msg = self.policy.recv(timeout_s=timeout_s)
            if not isinstance(msg, Heartbeat):
                return msg

    def close(self) -> None:
        for s in self.senders:
            s.close(0)
        self.policy.close(0)


def launch_trainer(
    config: Path,
    num_ranks: int,
    log_file: Path,
    entry: tuple[str, ...] = ("-m", "primerl.trainer_entry"),
    env: dict[str, str] | None = None,
) -> subprocess.Popen:
    """The real trainer under torchrun, in the background; output goes to `log_file`.
    `entry`: what torchrun runs on each rank (a test's own entry script, say), given `@ config`;
    `env`: extra environment variables."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={num_ranks}",
        f"--master-port={free_port_block(1)}",
        *entry,
        "@",
        str(config),
    ]
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **(env or {}))
    return subprocess.Popen(cmd, stdout=log_file.open("w"), stderr=subprocess.STDOUT, env=env)


def run_on_ranks(
    entry: Path, out: Path, num_ranks: int = 2, timeout_s: float = 600, args: tuple[str, ...] = ()
) -> list:
    """Run the script `entry OUT *args` under torchrun on `num_ranks` CPU ranks and return what
    each rank saved to OUT/rank_R.pt (torch.save); AssertionError with the output if it fails."""
    import torch

    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc-per-node={num_ranks}",
            f"--master-port={free_port_block(1)}",
            str(entry),
            str(out),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [torch.load(Path(out) / f"rank_{r}.pt") for r in range(num_ranks)]


def draw_adapters(model, std: float, seed: int) -> None:
    """Every LoRA layer's B drawn normal(0, std) (seeded), away from its zero start, as after
    training: a fresh adapter changes nothing, so it would prove nothing."""
    import torch

    from primerl_trainer.lora import LoRALinear

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LoRALinear):
                m.lora_B.weight.copy_(torch.randn(m.lora_B.weight.shape, generator=g) * std)


@contextlib.contextmanager
def one_rank_group(monkeypatch, timeout_s: float = 60):
    """A one-rank process group in this process (gloo on CPU, NCCL on a GPU), its torchrun
    environment set through `monkeypatch` (restored afterwards), torn down on exit; yields the Dist."""
    import torch.distributed as dist

    from primerl_trainer.distributed import init_distributed

    env = dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port_block(1)))
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    d = init_distributed(timeout_s=timeout_s)
    try:
        yield d
    finally:
        dist.destroy_process_group()
