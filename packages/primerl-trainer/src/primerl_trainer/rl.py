"""The RL trainer: `train(config)` on every torchrun rank.

    torchrun --nproc-per-node 8 -m primerl.trainer_entry @ run.toml

Each step: receive this rank's TrainBatch over ZeroMQ (all ranks agree to drop a batch that
fails validation and wait for the step's next one), compute the trainer's logprobs of every
token at its sampling temperature, the configured loss normalised over the global batch,
backward, clip, AdamW; publish the weights (PolicyReady to the orchestrator); checkpoint every
K steps and at the end, with the orchestrator's resume state that came with the step's batch.
Metrics the orchestrator sent with the batch are logged with the trainer's own, on one step
axis. A restart on the same run directory resumes from the newest checkpoint and first
publishes the restored weights, so inference serves them again. If no batch arrives within `transport.sockets.recv_timeout_s` (the orchestrator is
gone), the trainer stops with a clear error and keeps its checkpoints.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch
from primerl_algos.losses import LossInputs, LossScale, compute_loss
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

from primerl_trainer.distributed import Dist, all_reduce_max
from primerl_trainer.engine import Session, token_logprobs

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
            t = _first_bad(bad)
            return (
                f"micro-batch {i}, sample {_sample_at(mb, t)}: token id {int(mb.input_ids[t])} "
                f"is outside the vocabulary [0, {vocab_size})"
            )
        starts = mb.cu_seqlens()[:-1]
        trained_start = np.flatnonzero(mb.loss_mask[starts])
        if len(trained_start):
            seq = int(trained_start[0])
            return f"micro-batch {i}, sample {int(mb.sample_ids[seq])}: its first token is marked for training but has no context"
        # Non-finite numbers here would reach the weights through the loss (NaN > 0 is False).
        for name, bad in (("temperatures", ~(mb.temperatures > 0) | ~np.isfinite(mb.temperatures)),
                          ("advantages", ~np.isfinite(mb.advantages)),
                          ("inference_logprobs", ~np.isfinite(mb.inference_logprobs))):
            if bad.any():
                t = _first_bad(bad)
                what = "a positive finite number" if name == "temperatures" else "a finite number"
                return (f"micro-batch {i}, sample {_sample_at(mb, t)}: {name} holds {getattr(mb, name)[t]} "
                        f"at token {t}, not {what}")
    return None


def _first_bad(bad: np.ndarray) -> int:
    return int(np.argmax(bad))


def _sample_at(mb: MicroBatch, t: int) -> int:
    """The sample id of the row's token `t`."""
    return int(mb.sample_ids[int(np.searchsorted(np.cumsum(mb.seq_lens), t, side="right"))])


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


def rl_loss(loss_cfg, scale: LossScale, device: torch.device):
    """The configured RL loss of one micro-batch (its share of the global batch's loss)."""

    def loss_fn(model, mb: MicroBatch):
        pi, entropy = token_logprobs(model, mb, device)
        x = LossInputs(
            logprobs=pi,
            inference_logprobs=torch.from_numpy(mb.inference_logprobs.copy()).to(device),
            advantages=torch.from_numpy(mb.advantages.copy()).to(device),
            loss_mask=torch.from_numpy(mb.loss_mask.copy()).to(device),
            seq_lens=torch.from_numpy(mb.seq_lens.astype(np.int64)).to(device),
            entropy=entropy,
        )
        return compute_loss(x, loss_cfg, scale)

    return loss_fn


def tell(policy: Sender, ready) -> None:
    """Send PolicyReady; an orchestrator that does not take it is logged, not fatal (the
    weights are on disk, and the next step's wait for data says whether it is gone)."""
    try:
        policy.send(ready)
    except TransportTimeout as err:
        log.error("the orchestrator did not take PolicyReady(step %d): %s", ready.step, err)


def train(cfg) -> None:
    """Run the RL trainer with a root config (shared values + `trainer`)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    session = Session(cfg, job="rl")
    d = session.d
    row_tokens = cfg.trainer.micro_batch_tokens or cfg.seq_len
    source = BatchSource(cfg, d, session.args.vocab_size, row_tokens)
    policy = (
        Sender(cfg.transport.policy_endpoint(), PolicyMessage, channel="policy", settings=cfg.transport.sockets)
        if d.is_main else None
    )
    step = session.start_step
    try:
        if step > 0:
            # Resumed: inference may serve anything (a fresh server, or weights of steps this
            # run lost), so publish the restored weights first; the orchestrator waits for them.
            ready, _ = session.publish(step - 1)
            if ready is not None:
                tell(policy, ready)
        while cfg.max_steps is None or step < cfg.max_steps:
            data = source.next(step)
            if data is None:
                break
            batch = data.batch
            scale = LossScale(tokens=batch.num_loss_tokens, sequences=batch.num_sequences)
            stats = session.train_step(batch.micro_batches, rl_loss(cfg.trainer.loss, scale, d.device),
                                       empty=batch.num_loss_tokens == 0)
            ready, publish_s = session.publish(step, unchanged=bool(stats["step_skipped"] or stats["step_empty"]))
            if ready is not None:
                tell(policy, ready)
            checkpointed = session.maybe_checkpoint(step, {"next_step": step + 1, "orchestrator": batch.state})
            session.log(step, {
                **batch.metrics,
                **stats,
                "policy_lag_s": time.time() - batch.created_at,
                "batches_refused": source.num_refused,
                "time_data": data.wait_s,
                "time_publish": publish_s,
            })
            step += 1
        if step > session.start_step and not checkpointed:
            session.maybe_checkpoint(step - 1, {"next_step": step, "orchestrator": batch.state}, final=True)
    except TrainerError as err:
        log.error("%s", err)
        raise
    finally:
        source.close()
        if policy is not None:
            policy.close()
        session.close()
