"""The RL trainer: `train(config)` on every torchrun rank.

    torchrun --nproc-per-node 8 -m primerl.trainer_entry @ run.toml

Each step: receive this rank's TrainBatch over ZeroMQ, compute the trainer's logprobs of every
token at its sampling temperature, the configured loss normalised over the global batch,
backward, clip, AdamW; publish the weights (PolicyReady to the orchestrator); checkpoint every
K steps and at the end, with the orchestrator's resume state that came with the step's batch.
Metrics the orchestrator sent with the batch are logged with the trainer's own, on one step
axis. A restart on the same run directory resumes from the newest checkpoint and first
publishes the restored weights, so inference serves them again.

Stopping, always together (one collective after each receive decides for every rank):
- a `Shutdown` from the orchestrator, to any rank, ends training cleanly on all of them (with a
  final checkpoint); a rank still waiting for its batch learns of it from a note in the
  process group's store, which it reads between one-second polls;
- a batch that fails validation on any rank (or comes for a later step: one was lost) is
  refused: nothing is trained, rank 0 sends `Shutdown(sender="trainer")` naming the step, the
  rank and the problem, and every rank raises TrainerError with that reason. The orchestrator
  sends nothing twice, so waiting for another batch would wait for ever;
- any other failure of a rank (a full disk while writing weights, say) is noted in the store for
  the others, rank 0 tells the orchestrator (best effort, 1 s), and the rank exits without a
  barrier; torchrun ends the rest;
- no batch within `transport.sockets.recv_timeout_s` (the orchestrator is gone): a clear error.
Checkpoints already written are always kept; a rerun resumes from the newest.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch
from primerl_algos.losses import LossInputs, LossScale, compute_loss, token_loss_terms
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
from primerl_protocol.images import ModelImages, placeholder_runs, tokens_problem

from primerl_trainer.config import TrainerRunConfig
from primerl_trainer.distributed import Dist, all_gather_objects, all_reduce_maxes, post_note, read_note
from primerl_trainer.engine import Session, loss_in_forward_applies, token_logprobs, token_loss_in_forward
from primerl_trainer.transfer import MemoryPublisher

log = logging.getLogger("primerl.trainer")


class TrainerError(RuntimeError):
    """The trainer cannot go on (no data, bad state); the message says why and what is kept."""


def validate_batch(
    batch: TrainBatch,
    step: int,
    d: Dist,
    vocab_size: int,
    max_row_tokens: int,
    vision: ModelImages | None = None,
    cp: int = 1,
    sharing: str | None = None,
) -> str | None:
    """Why this rank's batch cannot be trained on (naming the sample), or None. `vision`: the
    model's image settings and image token id (None: a text model, whose rows hold no images);
    `cp`: the context-parallel degree (rows with images are not split); `sharing`: why this
    trainer cannot train rows whose samples share a prompt (None: it can)."""
    if batch.step != step:
        return f"got a batch for step {batch.step} while expecting step {step}: a step was skipped"
    if batch.rank != d.rank or batch.num_ranks != d.world_size:
        why = f"batch for rank {batch.rank} of {batch.num_ranks} arrived at rank {d.rank} of {d.world_size}"
        if batch.num_ranks != d.world_size:
            why += (
                f": the orchestrator packs for its transport.trainer_ranks ({batch.num_ranks}); give it the "
                f"trainer's {d.world_size}"
            )
        return why
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
        if mb.shares_prompts and (problem := _sharing_problem(mb, sharing)) is not None:
            return f"micro-batch {i}, {problem}"
        starts = mb.cu_seqlens()[:-1]
        trained_start = np.flatnonzero(mb.loss_mask[starts] & (mb.prefix_lens == 0))  # a shared prompt is context
        if len(trained_start):
            seq = int(trained_start[0])
            return f"micro-batch {i}, sample {int(mb.sample_ids[seq])}: its first token is marked for training but has no context"
        # Non-finite numbers here would reach the weights through the loss (NaN > 0 is False).
        for name, bad in (
            ("temperatures", ~(mb.temperatures > 0) | ~np.isfinite(mb.temperatures)),
            ("advantages", ~np.isfinite(mb.advantages)),
            ("inference_logprobs", ~np.isfinite(mb.inference_logprobs)),
        ):
            if bad.any():
                t = _first_bad(bad)
                what = "a positive finite number" if name == "temperatures" else "a finite number"
                return (
                    f"micro-batch {i}, sample {_sample_at(mb, t)}: {name} holds {getattr(mb, name)[t]} "
                    f"at token {t}, not {what}"
                )
        if (problem := _images_problem(mb, vision)) is not None:
            return f"micro-batch {i}, {problem}"
        if cp > 1 and len(mb.image_sizes):
            return (
                f"micro-batch {i} holds images, and rows with images are not split over context-parallel "
                f"ranks yet: set trainer.parallel.cp = 1 (it is {cp})"
            )
    return None


def _sharing_problem(mb: MicroBatch, sharing: str | None) -> str | None:
    """Why the row's shared prompts cannot be trained (naming the sample), or None. A shared
    prompt is never trained: each sample that shares it would otherwise train its tokens once
    for all of them."""
    if sharing is not None:
        return f"its samples share a prompt (orchestrator.share_prompts), but {sharing}: set orchestrator.share_prompts = false"
    if len(mb.image_sizes):
        return "its samples share a prompt and it holds images: rows with images are never packed with shared prompts"
    starts = mb.cu_seqlens()
    for s in np.flatnonzero(mb.prefix_lens).tolist():
        p, n = int(mb.parents[s]), int(mb.prefix_lens[s])
        if mb.loss_mask[starts[p] : starts[p] + n].any():
            return (
                f"sample {int(mb.sample_ids[s])} shares the first {n} tokens of sample {int(mb.sample_ids[p])}, "
                "and some of them are trained: a shared prompt must not be"
            )
    return None


def _images_problem(mb: MicroBatch, vision: ModelImages | None) -> str | None:
    """Why the row's images do not fit its samples' image tokens (sample by sample), or None."""
    sizes = [tuple(hw) for hw in mb.image_sizes.tolist()]
    if vision is None:
        return f"the row holds {len(sizes)} images but the model has no vision tower" if sizes else None
    spec, token = vision
    bounds, taken = mb.cu_seqlens(), 0
    for s in range(len(mb.seq_lens)):
        ids = mb.input_ids[bounds[s] : bounds[s + 1]]
        mine = len(placeholder_runs(ids, token))
        if (problem := tokens_problem(ids, sizes[taken : taken + mine], spec, token)) is not None:
            return f"sample {int(mb.sample_ids[s])}: {problem}"
        taken += mine
    if taken != len(sizes):
        return f"the row holds {len(sizes)} images but its samples have {taken} runs of image tokens"
    return None


def _first_bad(bad: np.ndarray) -> int:
    return int(np.argmax(bad))


def _sample_at(mb: MicroBatch, t: int) -> int:
    """The sample id of the row's token `t`."""
    return int(mb.sample_ids[int(np.searchsorted(np.cumsum(mb.seq_lens), t, side="right"))])


POLL_S = 1.0
"""How long a rank waiting for its batch listens before it looks at the other ranks' notes."""

# Votes after a receive, agreed by their maximum over ranks.
_TRAIN, _STOP, _REFUSE = 0.0, 1.0, 2.0


@dataclass
class StepData:
    batch: TrainBatch
    wait_s: float


class BatchSource:
    """This rank's batches, validated in agreement with the other ranks."""

    def __init__(
        self,
        cfg: TrainerRunConfig,
        d: Dist,
        vocab_size: int,
        max_row_tokens: int,
        vision: ModelImages | None = None,
        sharing: str | None = None,
    ):
        t = cfg.transport
        self.vision, self.cp, self.sharing = vision, cfg.trainer.parallel.cp, sharing
        self.receiver = Receiver(
            t.batch_endpoint(d.rank), BatchMessage, channel=f"batches/rank{d.rank}", settings=t.sockets
        )
        self.timeout_s = t.sockets.recv_timeout_s
        self.d, self.vocab_size, self.max_row_tokens = d, vocab_size, max_row_tokens

    def next(self, step: int) -> StepData | None:
        """The batch of `step`, or None when the orchestrator told any rank it is shutting down.

        Every rank decides the same in one collective (or the ones that train would wait for
        ever in the next): stop if any rank was told to, else refuse if any rank's batch is bad
        or the ranks' micro-batch counts differ (TrainerError naming the step, the ranks and
        their problems), else train."""
        start = time.monotonic()
        msg = self._receive(step)
        problem = (
            None
            if msg is None
            else validate_batch(
                msg, step, self.d, self.vocab_size, self.max_row_tokens, self.vision, self.cp, self.sharing
            )
        )
        if self.agree(step, msg, problem) == _STOP:
            log.info("stopping: %s", read_note("stopping"))
            return None
        assert msg is not None, "a rank without a batch votes _STOP, so the verdict would have been to stop"
        return StepData(msg, time.monotonic() - start)

    def agree(self, step: int, msg: TrainBatch | None, problem: str | None) -> float:
        """The ranks' common verdict on this step's batches (_STOP or _TRAIN); TrainerError on
        every rank when any rank's batch is bad, or when the ranks got different numbers of
        micro-batches: each micro-batch is a forward and a backward whose collectives every
        rank must join, so a rank with fewer would leave the others waiting for ever."""
        rows = len(msg.micro_batches) if msg is not None and problem is None else 0
        vote = _STOP if msg is None else _REFUSE if problem else _TRAIN
        verdict, most, minus_fewest = all_reduce_maxes([vote, rows, -rows], self.d)
        if verdict == _TRAIN and most != -minus_fewest:
            counts = all_gather_objects(rows, self.d)
            reason = (
                "the ranks got different numbers of micro-batches ("
                + ", ".join(f"rank {r}: {n}" for r, n in enumerate(counts))
                + "), which must be equal"
            )
        elif verdict == _REFUSE:
            problems = all_gather_objects(problem, self.d)
            reason = "; ".join(f"rank {r}: {p}" for r, p in enumerate(problems) if p)
        else:
            return verdict
        raise TrainerError(
            f"refused the batch for step {step}: {reason}. The orchestrator sent data the trainer "
            "cannot train on; the trainer stops (checkpoints in the run directory are kept)."
        )

    def _receive(self, step: int) -> TrainBatch | None:
        """This rank's batch for `step` (not validated yet), or None when told to stop: by a
        Shutdown, or by another rank's note that it got one. Raises TrainerError when another
        rank failed or nothing came within recv_timeout_s."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            if (failure := read_note("failed")) is not None:
                raise TrainerError(f"rank {self.d.rank} stopped waiting for the batch of step {step}: {failure}")
            if read_note("stopping") is not None:
                return None
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TrainerError(
                    f"rank {self.d.rank}: no batch for step {step} from the orchestrator within "
                    f"{self.timeout_s:.0f}s (transport.sockets.recv_timeout_s, socket '{self.receiver.channel}'); "
                    "is it still running? The checkpoints in the run directory are kept; rerun to resume."
                )
            try:
                msg = self.receiver.recv(timeout_s=min(POLL_S, remaining))
            except TransportTimeout:
                continue
            match msg:
                case Heartbeat():
                    continue
                case Shutdown(reason=reason):
                    post_note(
                        "stopping",
                        f"the orchestrator is shutting down ({reason or 'no reason given'}; told rank {self.d.rank})",
                    )
                    return None
                case TrainBatch() if msg.step < step:
                    log.warning("dropped a batch for step %d (stale: expecting step %d)", msg.step, step)
                    continue
            return msg

    def close(self) -> None:
        self.receiver.close(linger_ms=0)


def sharing_problem(cfg: TrainerRunConfig, args) -> str | None:
    """Why this trainer cannot train rows whose samples share a prompt exactly (the model's
    mixers, context parallelism, the varlen back-end), or None."""
    if (problem := args.prompt_sharing_problem()) is not None:
        return problem
    if cfg.trainer.parallel.cp > 1:
        return f"such rows are not split over context-parallel ranks (trainer.parallel.cp = {cfg.trainer.parallel.cp})"
    if cfg.trainer.attention == "varlen":
        return "trainer.attention = 'varlen' cannot attend to a shared prompt (use 'auto' or 'flex')"
    return None


def rl_loss(loss_cfg, scale: LossScale, device: torch.device, cp_group=None, images=None, in_forward: bool = True):
    """The configured RL loss of one micro-batch (its share of the global batch's loss), on
    whole rows (with context parallelism too: token_logprobs gathers them). `images`: the
    model's ImageSpec (Session.image_spec). `in_forward` (trainer.loss_in_forward): a
    token-local loss on a row that allows it has its gradients computed inside the forward; its
    value and metrics are compute_loss's of the same logprobs."""
    fused_loss = loss_in_forward_applies(in_forward, loss_cfg.type, context_split=cp_group is not None)

    def loss_fn(model, mb: MicroBatch):
        x = LossInputs(
            logprobs=torch.empty(0),
            inference_logprobs=torch.from_numpy(mb.inference_logprobs.copy()).to(device),
            advantages=torch.from_numpy(mb.advantages.copy()).to(device),
            loss_mask=torch.from_numpy(mb.loss_mask.copy()).to(device),
            seq_lens=torch.from_numpy(mb.seq_lens.astype(np.int64)).to(device),
        )
        if fused_loss:
            x.logprobs = x.inference_logprobs.new_zeros(mb.num_tokens, dtype=torch.float64)  # shape and dtype only
            terms = token_loss_terms(x, loss_cfg, scale)
            fused, x.logprobs, x.entropy = token_loss_in_forward(model, mb, device, terms, images)
            value, metrics = compute_loss(x, loss_cfg, scale)  # of the same logprobs, detached
            return fused + (value - fused).detach(), metrics
        x.logprobs, x.entropy = token_logprobs(model, mb, device, cp_group, images)
        return compute_loss(x, loss_cfg, scale)

    return loss_fn


def tell(policy: Sender, ready) -> None:
    """Send PolicyReady; an orchestrator that does not take it is logged, not fatal (the
    weights are on disk, and the next step's wait for data says whether it is gone)."""
    try:
        policy.send(ready)
    except TransportTimeout as err:
        log.error("the orchestrator did not take PolicyReady(step %d): %s", ready.step, err)


def tell_stopped(policy: Sender, reason: str) -> None:
    """Best effort: tell the orchestrator the trainer stops, so it does not wait for a policy
    that will never come (it stops with `reason`). Closes `policy`."""
    try:
        policy.send(Shutdown(sender="trainer", reason=reason), timeout_s=1.0)
    except Exception as err:  # no orchestrator, or its socket is gone: nothing more to do
        log.error("could not tell the orchestrator that the trainer stops: %s", err)
    # ZeroMQ sends from its own thread, and the trainer command leaves with os._exit, which
    # would drop a message still queued: terminating the context waits until it is out (up to
    # the 1 s linger). Bounded, in case another socket of this process is still open.
    policy.close(linger_ms=1000)
    flush = threading.Thread(target=policy.socket.context.term, daemon=True)
    flush.start()
    flush.join(timeout=2.0)


def train(cfg: TrainerRunConfig) -> None:
    """Run the RL trainer with a root config (shared values + `trainer`)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    session = Session(cfg, job="rl")
    session.publisher.keep_every = cfg.trainer.weights.keep_every  # folders kept for evals after the run
    d = session.d
    row_tokens = cfg.trainer.micro_batch_tokens or cfg.seq_len
    vision = (  # a model with an image spec has a vision tower (args.vision)
        ModelImages(session.image_spec, session.args.vision.image_token_id)
        if session.image_spec and session.args.vision is not None
        else None
    )
    source = BatchSource(cfg, d, session.args.vocab_size, row_tokens, vision, sharing_problem(cfg, session.args))
    policy = (
        Sender(cfg.transport.policy_endpoint(), PolicyMessage, channel="policy", settings=cfg.transport.sockets)
        if d.is_main
        else None
    )
    if policy is not None and isinstance(session.publisher, MemoryPublisher):
        # weights in memory: the publisher announces each policy before it streams it
        session.publisher.announce = lambda ready: tell(policy, ready)
    step, failed = session.start_step, True
    try:
        if cfg.max_steps is not None and step >= cfg.max_steps:
            # Resumed from the last step's checkpoint: nothing left, and nothing to publish (the
            # orchestrator finishes at once too, instead of waiting for these weights).
            log.info("the run is complete: resumed at step %d of max_steps %d; nothing to train", step, cfg.max_steps)
            failed = False
            return
        if step > 0:
            # Resumed: inference may serve anything (a fresh server, or weights of steps this
            # run lost), so publish the restored weights first; the orchestrator waits for them.
            ready, _ = session.publish(step - 1)
            if ready is not None:
                assert policy is not None, "only rank 0 gets PolicyReady, and it holds the policy socket"
                tell(policy, ready)
        while cfg.max_steps is None or step < cfg.max_steps:
            data = source.next(step)
            if data is None:
                break
            batch = data.batch
            scale = LossScale(tokens=batch.num_loss_tokens, sequences=batch.num_sequences)
            stats = session.train_step(
                batch.micro_batches,
                rl_loss(
                    cfg.trainer.loss,
                    scale,
                    d.device,
                    session.mesh.cp_group,
                    session.image_spec,
                    cfg.trainer.loss_in_forward,
                ),
                empty=batch.num_loss_tokens == 0,
            )
            ready, publish_s = session.publish(step, unchanged=bool(stats["step_skipped"] or stats["step_empty"]))
            if ready is not None:
                assert policy is not None, "only rank 0 gets PolicyReady, and it holds the policy socket"
                tell(policy, ready)
            session.log(
                step,
                {
                    **batch.metrics,
                    **stats,
                    "policy_lag_s": time.time() - batch.created_at,
                    "time/data": data.wait_s,
                    "time/publish": publish_s,
                    **session.publisher.counts,
                },
                batch.samples,
            )
            checkpointed = session.maybe_checkpoint(step, {"next_step": step + 1, "orchestrator": batch.state})
            step += 1
        if step > session.start_step and not checkpointed:
            session.maybe_checkpoint(step - 1, {"next_step": step, "orchestrator": batch.state}, final=True)
        failed = False
    except BaseException as err:
        if isinstance(err, TrainerError):  # its message names the rank and step
            log.error("%s", err)
            own = str(err)
        else:  # the traceback follows on its way out
            own = f"rank {d.rank} failed at step {step}: {type(err).__name__}: {err}"
        reason = post_note("failed", own)  # the first failure of any rank: the cause, not an echo
        if policy is not None:
            source.close()
            tell_stopped(policy, reason)
        raise
    finally:
        source.close()
        if policy is not None:
            policy.close()
        session.close(failed=failed)
