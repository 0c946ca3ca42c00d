"""The RL trainer: `train(config)` on every torchrun rank.

    torchrun --nproc-per-node 8 -m primerl.trainer_entry @ run.toml

Each step: receive this rank's TrainBatch over ZeroMQ (all ranks agree to drop a batch that
fails validation and wait for the step's next one), compute the trainer's logprobs of every
token at its sampling temperature, the configured loss normalised over the global batch,
backward, clip, AdamW; publish the weights (PolicyReady to the orchestrator); checkpoint every
K steps and at the end. A restart on the same run directory resumes from the newest
checkpoint. If no batch arrives within `transport.sockets.recv_timeout_s` (the orchestrator is
gone), the trainer stops with a clear error and keeps its checkpoints.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import msgspec
import numpy as np
import torch

from primerl_algos.losses import LossInputs, LossScale, compute_loss, mean_metrics
from primerl_protocol import (
    BatchMessage,
    Heartbeat,
    MicroBatch,
    PolicyMessage,
    Receiver,
    Sender,
    Shutdown,
    TrainBatch,
    TransportTimeout,
)
from primerl_trainer.checkpoint import Checkpointer
from primerl_trainer.distributed import Dist, all_reduce_max, all_reduce_sum, init_distributed, shutdown
from primerl_trainer.metrics import MetricsLogger
from primerl_trainer.model import load_for_training
from primerl_trainer.optim import build_optimizer, build_scheduler, clip_grad_norm
from primerl_trainer.publish import FolderPublisher

log = logging.getLogger("primerl.trainer")


class TrainerError(RuntimeError):
    """The trainer cannot go on (no data, bad state); the message says why and what is kept."""


def validate_batch(batch: TrainBatch, step: int, d: Dist, vocab_size: int, max_row_tokens: int) -> str | None:
    """Why this rank's batch cannot be trained on (naming the sample), or None."""
    if batch.rank != d.rank or batch.num_ranks != d.world_size:
        return f"batch for rank {batch.rank} of {batch.num_ranks} arrived at rank {d.rank} of {d.world_size}"
    if not batch.micro_batches:
        return f"batch for step {step} has no micro-batches"
    for i, mb in enumerate(batch.micro_batches):
        if mb.num_tokens > max_row_tokens:
            return f"micro-batch {i} has {mb.num_tokens} tokens, more than a row's {max_row_tokens}"
        bad = (mb.input_ids < 0) | (mb.input_ids >= vocab_size)
        if bad.any():
            t = int(np.argmax(bad))
            seq = int(np.searchsorted(np.cumsum(mb.seq_lens), t, side="right"))
            return (
                f"micro-batch {i}, sample {int(mb.sample_ids[seq])}: token id {int(mb.input_ids[t])} "
                f"is outside the vocabulary [0, {vocab_size})"
            )
        starts = mb.cu_seqlens()[:-1]
        trained_start = np.flatnonzero(mb.loss_mask[starts])
        if len(trained_start):
            seq = int(trained_start[0])
            return f"micro-batch {i}, sample {int(mb.sample_ids[seq])}: its first token is marked for training but has no context"
        if not np.all(mb.temperatures > 0):
            return f"micro-batch {i}: temperatures must be positive"
    return None


@dataclass
class StepData:
    batch: TrainBatch
    wait_s: float


class BatchSource:
    """This rank's batches, validated in agreement with the other ranks."""

    def __init__(self, cfg, d: Dist, vocab_size: int, max_row_tokens: int):
        t = cfg.transport
        self.receiver = Receiver(t.batch_endpoint(d.rank), BatchMessage, channel=f"batches/rank{d.rank}", settings=t.sockets)
        self.timeout_s = t.sockets.recv_timeout_s
        self.d, self.vocab_size, self.max_row_tokens = d, vocab_size, max_row_tokens
        self.num_refused = 0

    def next(self, step: int) -> StepData | None:
        """The batch of `step`, or None when the orchestrator said it is shutting down."""
        start = time.monotonic()
        while True:
            try:
                msg = self.receiver.recv(timeout_s=self.timeout_s)
            except TransportTimeout as err:
                raise TrainerError(
                    f"no batch for step {step} from the orchestrator ({err}); is it still running? "
                    "The checkpoints in the run directory are kept; rerun to resume."
                ) from None
            match msg:
                case Heartbeat():
                    continue
                case Shutdown(reason=reason):
                    log.info("orchestrator is shutting down (%s)", reason or "no reason given")
                    return None
                case TrainBatch() if msg.step < step:
                    log.warning("dropped a batch for step %d (stale: expecting step %d)", msg.step, step)
                    continue
                case TrainBatch() if msg.step > step:
                    raise TrainerError(f"got a batch for step {msg.step} while expecting step {step}: a step was skipped")
            problem = validate_batch(msg, step, self.d, self.vocab_size, self.max_row_tokens)
            # Every rank must agree, or the ones that train would wait forever in collectives.
            if all_reduce_max(1.0 if problem else 0.0, self.d):
                self.num_refused += 1
                log.error(
                    "refused the batch for step %d%s; waiting for another",
                    step, f" (rank {self.d.rank}: {problem})" if problem else " (another rank's was bad)",
                )
                continue
            return StepData(msg, time.monotonic() - start)

    def close(self) -> None:
        self.receiver.close(linger_ms=0)


def micro_batch_loss(model, mb: MicroBatch, loss_cfg, scale: LossScale, device: torch.device):
    """Loss (this micro-batch's share of the batch loss) and metric sums of one packed row."""
    ids = torch.from_numpy(mb.input_ids.astype(np.int64)).to(device)
    pos = torch.from_numpy(mb.position_ids().astype(np.int64)).to(device)
    temps = torch.from_numpy(mb.temperatures.copy()).to(device)
    # Token t is predicted from tokens < t: targets are the next tokens, row shifted by one.
    targets = torch.roll(ids, -1)
    logprobs, entropy = model(ids[None], pos[None], targets[None], torch.roll(temps, -1)[None])
    zero = logprobs.new_zeros(1)
    pi = torch.cat([zero, logprobs[0, :-1]])  # pi[t] = log p(token t | < t); token 0 has none
    ent = torch.cat([zero, entropy[0, :-1]])
    x = LossInputs(
        logprobs=pi,
        inference_logprobs=torch.from_numpy(mb.inference_logprobs.copy()).to(device),
        advantages=torch.from_numpy(mb.advantages.copy()).to(device),
        loss_mask=torch.from_numpy(mb.loss_mask.copy()).to(device),
        seq_lens=torch.from_numpy(mb.seq_lens.astype(np.int64)).to(device),
        entropy=ent,
    )
    return compute_loss(x, loss_cfg, scale)


def train_flops(args, seq_lens: np.ndarray) -> float:
    """FLOPs of forward + backward of one packed row: 6 N per token + causal attention."""
    n = seq_lens.astype(np.float64)
    return 6 * args.num_active_params() * n.sum() + 6 * args.num_layers * args.num_heads * args.head_dim * (n**2).sum()


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return 989e12 if ("H100" in name or "H200" in name) else None


def train(cfg) -> None:
    """Run the RL trainer with a root config (shared values + `trainer`)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    d = init_distributed()
    run_dir = Path(cfg.run_dir)
    tcfg = cfg.trainer
    torch.manual_seed(cfg.seed)
    model, loaded = load_for_training(cfg, d)
    args = model.args
    opt = build_optimizer(model, tcfg.optimizer, d.device)
    sched = build_scheduler(opt, tcfg.scheduler, cfg.max_steps)
    ckpt = Checkpointer(run_dir, tcfg.checkpoint.keep, d)
    start_step = 0
    if (latest := ckpt.latest()) is not None:
        meta = ckpt.load(latest, model, opt, sched)
        start_step = meta["step"] + 1
        log.info("resumed from %s; continuing at step %d", latest, start_step)
    publish_dtype = torch.float32 if tcfg.weights.dtype == "float32" else torch.bfloat16
    publisher = FolderPublisher(run_dir, loaded.folder, loaded.hf_config, tcfg.weights.keep, publish_dtype, d)
    row_tokens = tcfg.micro_batch_tokens or cfg.seq_len
    source = BatchSource(cfg, d, args.vocab_size, row_tokens)
    policy = (
        Sender(cfg.transport.policy_endpoint(), PolicyMessage, channel="policy", settings=cfg.transport.sockets)
        if d.is_main else None
    )
    metrics = MetricsLogger(run_dir, cfg.wandb, msgspec.to_builtins(cfg), d.is_main)
    peak = peak_flops(d.device)
    step = start_step
    try:
        while cfg.max_steps is None or step < cfg.max_steps:
            data = source.next(step)
            if data is None:
                break
            batch = data.batch
            scale = LossScale(tokens=batch.num_loss_tokens, sequences=batch.num_sequences)
            t0 = time.monotonic()
            if d.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            sums = []
            for mb in batch.micro_batches:
                loss, m = micro_batch_loss(model, mb, tcfg.loss, scale, d.device)
                # FSDP averages gradients over ranks; the loss is already a share of the global
                # batch, so scale it back up to make that average a sum.
                (loss * d.world_size).backward()
                sums.append({"loss": loss.detach(), **m})
            t1 = time.monotonic()
            grad_norm = clip_grad_norm(model, tcfg.optimizer.max_grad_norm)
            lr = sched.get_last_lr()[0]
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            t2 = time.monotonic()
            ready = publisher.publish(model, step)
            if ready is not None:
                policy.send(ready)
            t3 = time.monotonic()
            if tcfg.checkpoint.interval and (step + 1) % tcfg.checkpoint.interval == 0:
                ckpt.save(step, model, opt, sched, {"next_step": step + 1})
            keys = sorted(sums[0])
            totals = all_reduce_sum([sum(float(s[k]) for s in sums) for k in keys], d)
            total = dict(zip(keys, totals))
            loss_value = total.pop("loss")
            means = mean_metrics([total])
            tokens, flops = all_reduce_sum([
                float(sum(mb.num_tokens for mb in batch.micro_batches)),
                float(sum(train_flops(args, mb.seq_lens) for mb in batch.micro_batches)),
            ], d)
            step_s = t3 - t0 + data.wait_s
            metrics.log(step, {
                "loss": loss_value,
                **means,
                "grad_norm": grad_norm,
                "lr": lr,
                "tokens_per_s": tokens / max(t2 - t0, 1e-9),
                "mfu": flops / max(t2 - t0, 1e-9) / (peak * d.world_size) if peak else None,
                "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if d.device.type == "cuda" else None,
                "policy_lag_s": time.time() - batch.created_at,
                "batches_refused": source.num_refused,
                "time_data": data.wait_s,
                "time_fwd_bwd": t1 - t0,
                "time_optimizer": t2 - t1,
                "time_publish": t3 - t2,
                "time_step": step_s,
            })
            step += 1
        last = step - 1
        if last >= start_step and not (tcfg.checkpoint.interval and step % tcfg.checkpoint.interval == 0):
            ckpt.save(last, model, opt, sched, {"next_step": step})
    except TrainerError as err:
        log.error("%s", err)
        raise
    finally:
        metrics.close()
        source.close()
        if policy is not None:
            policy.close()
        shutdown()
