"""The SFT trainer: the same FSDP2 session as RL, fed by a local dataset instead of ZeroMQ.

    primerl sft @ sft.toml                                     # one process
    torchrun --nproc-per-node 8 -m primerl.sft_entry @ sft.toml

Each step takes the next `data.batch_size` samples (shuffled per epoch, seeded), packs them
into rows of seq_len tokens balanced over the ranks, and minimises the mean negative
log-likelihood of the assistants' tokens. Weights are published at every checkpoint and at the
end; the eval split is scored every `data.eval_interval` steps and at the end. The data
position is part of the checkpoint, so a restart continues with the next batch.
"""

from __future__ import annotations

import logging
import os
import time

import numpy as np
import torch
from primerl_algos.packing import build_micro_batch, plan_packing
from primerl_algos.types import Sample
from primerl_protocol.images import ImageSpec, ModelImages

from primerl_trainer.config import SFTRunConfig
from primerl_trainer.distributed import all_reduce_sum
from primerl_trainer.engine import Session, loss_in_forward_applies, token_logprobs, token_loss_in_forward
from primerl_trainer.sft_data import DataError, load_samples

log = logging.getLogger("primerl.trainer")


def nll_loss(
    num_tokens: int, device: torch.device, cp_group=None, images: ImageSpec | None = None, in_forward: bool = True
):
    """Summed NLL of the masked tokens over `num_tokens` (all ranks' loss tokens of the step).
    `images`: the model's ImageSpec (Session.image_spec), for rows with images. `in_forward`
    (trainer.loss_in_forward): on rows that allow it, the gradients computed inside the forward."""

    fused_loss = loss_in_forward_applies(in_forward, None, context_split=cp_group is not None)

    def loss_fn(model, mb):
        mask = torch.from_numpy(mb.loss_mask.copy()).to(device)
        count = {"loss_tokens": mask.sum().float()}
        if fused_loss:

            def terms(pi_C, a, b):
                return -torch.where(mask[a:b], pi_C, 0.0) / max(num_tokens, 1)

            loss, _, _ = token_loss_in_forward(model, mb, device, terms, images)
            return loss, count
        pi, _ = token_logprobs(model, mb, device, cp_group, images)
        return -torch.where(mask, pi, 0.0).sum() / max(num_tokens, 1), count

    return loss_fn


class Batches:
    """Batches of samples in a seeded order per epoch; `state` says where the next one starts."""

    def __init__(self, samples: list[Sample], batch_size: int, seed: int, shuffle: bool, state: dict):
        self.samples, self.batch_size, self.seed, self.shuffle = samples, batch_size, seed, shuffle
        self.epoch, self.index = state.get("epoch", 0), state.get("index", 0)

    def _order(self) -> np.ndarray:
        n = len(self.samples)
        return np.random.default_rng(self.seed + self.epoch).permutation(n) if self.shuffle else np.arange(n)

    def next(self) -> list[Sample]:
        out, order = [], self._order()
        while len(out) < self.batch_size:
            if self.index >= len(order):
                self.epoch, self.index = self.epoch + 1, 0
                order = self._order()
            take = order[self.index : self.index + self.batch_size - len(out)]
            out += [self.samples[i] for i in take]
            self.index += len(take)
        return out

    @property
    def state(self) -> dict:
        return {"epoch": self.epoch, "index": self.index}


def my_rows(samples: list[Sample], row_tokens: int, rank: int, world: int):
    """This rank's packed rows of `samples`, and the loss tokens of all of them."""
    plan = plan_packing([len(s) for s in samples], row_tokens, num_ranks=world)
    rows = [build_micro_batch([samples[i] for i in row]) for row in plan.ranks[rank]]
    return rows, sum(sum(s.loss_mask) for s in samples)


@torch.no_grad()
def evaluate(session: Session, samples: list[Sample], row_tokens: int) -> float:
    """Mean NLL per assistant token over the eval samples (all ranks share the work)."""
    d = session.d
    session.model.eval()
    rows, _ = my_rows(samples, row_tokens, d.rank, d.world_size)
    total = count = 0.0
    for mb in session.mesh.group_rows(rows):
        pi, _ = token_logprobs(session.model, mb, d.device, session.mesh.cp_group, session.image_spec)
        mask = torch.from_numpy(mb.loss_mask.copy()).to(d.device)
        total += float(-torch.where(mask, pi, 0.0).sum())
        count += float(mask.sum())
    share = session.mesh.row_share
    total, count = all_reduce_sum([share * total, share * count], d)
    return total / max(count, 1.0)


def train(cfg: SFTRunConfig) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    session = Session(cfg, job="sft")
    session.publisher.keep_every = cfg.trainer.weights.keep_every  # folders kept for evals after the run
    d = session.d
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # no Rust thread pool per rank
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(session.model_folder)
    row_tokens = cfg.trainer.micro_batch_tokens or cfg.seq_len
    vision = (  # a model with an image spec has a vision tower (args.vision)
        None
        if session.image_spec is None or session.args.vision is None
        else ModelImages(session.image_spec, session.args.vision.image_token_id)
    )
    samples, dropped = load_samples(cfg.data.path, tokenizer, row_tokens, vision)
    eval_samples = load_samples(cfg.data.eval_path, tokenizer, row_tokens, vision)[0] if cfg.data.eval_path else []
    if session.mesh.cp_group is not None and any(s.images for s in samples + eval_samples):
        raise DataError(
            f"{cfg.data.path}: rows with images under context parallelism are not supported: "
            "set trainer.parallel.cp = 1"
        )
    batches = Batches(samples, cfg.data.batch_size, cfg.seed, cfg.data.shuffle, session.data_state)
    max_steps = cfg.max_steps or max(1, len(samples) // cfg.data.batch_size)
    log.info("SFT on %d samples (%d dropped), %d steps", len(samples), sum(dropped.values()), max_steps)
    step, failed = session.start_step, True
    try:
        while step < max_steps:
            t0 = time.monotonic()
            rows, loss_tokens = my_rows(batches.next(), row_tokens, d.rank, d.world_size)
            t_data = time.monotonic() - t0
            stats = session.train_step(
                rows,
                nll_loss(loss_tokens, d.device, session.mesh.cp_group, session.image_spec, cfg.trainer.loss_in_forward),
            )
            last = step + 1 == max_steps
            publish_s = session.publish(step)[1] if (session.checkpoint_due(step) or last) else 0.0
            interval = cfg.data.eval_interval
            if eval_samples and (last or (interval and (step + 1) % interval == 0)):
                stats["eval_loss"] = evaluate(session, eval_samples, row_tokens)
            session.log(step, {**stats, "epoch": batches.epoch, "time/data": t_data, "time/publish": publish_s})
            session.maybe_checkpoint(step, batches.state, final=last)
            step += 1
        failed = False
    finally:
        session.close(failed=failed)
