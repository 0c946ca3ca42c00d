"""What the RL and SFT trainers share: the model under FSDP2, the optimizer and schedule,
checkpoints and resuming, weight publishing, metrics, and the step itself.

    session = Session(cfg, job="rl")
    for step in range(session.start_step, max_steps):
        stats = session.train_step(micro_batches, loss_fn)   # forward/backward, clip, AdamW
                                                             # (none if the loss/grad is not finite)
        ready = session.publish(step)                        # weights/step_N (rank 0 gets PolicyReady)
        session.log(step, stats)                             # before the checkpoint: a step
        session.maybe_checkpoint(step, data_state)           # checkpointed has its metrics row
"""

from __future__ import annotations

import functools
import logging
import math
import operator
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import numpy as np
import torch
from primerl_algos.losses import TOKEN_LOCAL, mean_metrics
from primerl_models.hf import fp8_weights
from primerl_models.packing import PackedSeqs
from primerl_protocol import MicroBatch, PolicyReady
from primerl_protocol.images import ImageSpec, patchify

from primerl_trainer.adapters import AdapterPublisher
from primerl_trainer.checkpoint import Checkpointer, SetupError
from primerl_trainer.config import SFTRunConfig, TrainerRunConfig
from primerl_trainer.context_parallel import row_logprobs
from primerl_trainer.distributed import all_reduce_sum, all_reduce_tensor_sum, init_distributed, shutdown
from primerl_trainer.metrics import MetricsLogger
from primerl_trainer.optim import apply_settings, build_optimizer, build_scheduler, clip_grad_norm
from primerl_trainer.placement import build_mesh, load_for_training
from primerl_trainer.precision import check_fp8_device
from primerl_trainer.publish import FolderPublisher

log = logging.getLogger("primerl.trainer")

# loss_fn(model, micro_batch) -> (loss: this micro-batch's share of the batch loss, metric sums)
LossFn = Callable[[torch.nn.Module, MicroBatch], tuple[torch.Tensor, dict[str, torch.Tensor]]]


def train_flops(args, seq_lens: np.ndarray) -> float:
    """FLOPs of forward + backward of one packed row: each layer by its own kind (ModelArgs.train_flops)."""
    return args.train_flops(seq_lens.tolist())


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return 989e12 if ("H100" in name or "H200" in name) else None


def model_inputs(mb: MicroBatch, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids, positions, next-token targets and their temperatures, each [1, T]."""
    ids = torch.from_numpy(mb.input_ids.astype(np.int64)).to(device)
    pos = torch.from_numpy(mb.position_ids().astype(np.int64)).to(device)
    temps = torch.from_numpy(mb.temperatures.copy()).to(device)
    return ids[None], pos[None], torch.roll(ids, -1)[None], torch.roll(temps, -1)[None]


def image_inputs(mb: MicroBatch, spec: ImageSpec | None, device: torch.device) -> dict[str, torch.Tensor]:
    """The vision tower's inputs of the row's images (none without images): pixel_values
    [patches, C * Tp * P * P], recomputed from the pixels as the server's processor made
    them (primerl_protocol.images.patchify), and image_grid_thw [images, 3]."""
    if not len(mb.image_sizes):
        return {}
    if spec is None:
        raise ValueError(f"the row holds {len(mb.image_sizes)} images but the model has no vision tower")
    patches, grids = zip(*(patchify(image, spec) for image in mb.images()))
    return {
        "pixel_values": torch.from_numpy(np.concatenate(patches)).to(device),
        "image_grid_thw": torch.tensor(grids, device=device),
    }


def token_logprobs(
    model, mb: MicroBatch, device: torch.device, cp_group=None, images: ImageSpec | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(pi, entropy) [T]: pi[t] = log p(token t | tokens < t) at token t's temperature; 0 for t = 0.

    Computed inside the model's forward by the chunked path (no full logits). With a
    context-parallel group, every rank of it runs its chunk of the row and gets the whole row's.
    `images`: the model's image settings (Session.image_spec), for rows with images."""
    pictures = image_inputs(mb, images, device)
    if mb.shares_prompts:
        if cp_group is not None:
            raise ValueError(
                "rows whose samples share a prompt are not split over context-parallel ranks: set "
                "orchestrator.share_prompts = false or trainer.parallel.cp = 1"
            )
        return shared_prompt_logprobs(model, mb, device, pictures)
    ids, pos, targets, temps = model_inputs(mb, device)
    if cp_group is None:
        logprobs, entropy = model(ids, pos, targets, temps, **pictures)
    elif pictures:
        raise ValueError("rows with images under context parallelism are not supported: set trainer.parallel.cp = 1")
    else:
        logprobs, entropy = row_logprobs(model, ids, pos, targets, temps, cp_group)
    zero = logprobs.new_zeros(1)
    return torch.cat([zero, logprobs[0, :-1]]), torch.cat([zero, entropy[0, :-1]])


def loss_in_forward_applies(in_forward: bool, loss_type: str | None, context_split: bool) -> bool:
    """Whether trainer.loss_in_forward (`in_forward`) computes the loss's gradients inside the
    forward: for a token-local loss (SFT's NLL, `loss_type` None; the RL losses in
    primerl_algos.losses.TOKEN_LOCAL) on rows not split by context parallelism (rows sharing
    prompts are never split). The trainer and `primerl plan` decide by this."""
    return in_forward and not context_split and (loss_type is None or loss_type in TOKEN_LOCAL)


def token_loss_in_forward(
    model, mb: MicroBatch, device: torch.device, terms, images: ImageSpec | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, pi, entropy) of a whole row, the loss's gradients computed inside the forward
    (trainer.loss_in_forward; primerl_models.chunked_token_loss). `terms(pi_C, a, b)` gives the
    loss's terms [b - a] of the row's tokens a..b-1 from their logprobs, indexed as
    token_logprobs' pi (pi[t] = log p(token t | tokens before it); token 0 has no context and gets
    no term). pi and entropy come back detached, the values token_logprobs would give."""
    if mb.shares_prompts:  # position j predicts token j itself, from its predecessor's hidden state
        ids, pos, temps, sources, seqs = shared_prompt_inputs(mb, device)
        inputs, offset, shared = (ids, pos, ids, temps), 0, {"seqs": seqs, "sources_BT": sources}
    else:  # position j predicts token j + 1
        inputs, offset, shared = model_inputs(mb, device), 1, {}
    lo, hi = 1 - offset, inputs[0].shape[1] - offset  # the positions predicting tokens 1..T-1

    def row_terms(logprobs_C: torch.Tensor, s: int, e: int) -> torch.Tensor:
        a = min(max(s, lo), e)
        b = max(min(e, hi), a)
        inner = terms(logprobs_C[a - s : b - s], a + offset, b + offset) if b > a else logprobs_C[:0]
        return torch.cat([logprobs_C.new_zeros(a - s), inner, logprobs_C.new_zeros(e - b)])

    loss, logprobs, entropy = model(*inputs, loss_terms=row_terms, **shared, **image_inputs(mb, images, device))
    zero = logprobs.new_zeros(1)
    return loss, torch.cat([zero, logprobs[0, lo:hi]]), torch.cat([zero, entropy[0, lo:hi]])


def shared_prompt_inputs(mb: MicroBatch, device: torch.device):
    """ids, positions, temperatures, sources [1, T] and the segments of a row whose samples share
    prompts (shared_prompt_logprobs)."""
    ids = torch.from_numpy(mb.input_ids.astype(np.int64)).to(device)[None]
    pos = torch.from_numpy(mb.position_ids().astype(np.int64)).to(device)[None]
    temps = torch.from_numpy(mb.temperatures.copy()).to(device)[None]
    sources = torch.from_numpy(mb.predecessors()).to(device)[None]
    seqs = PackedSeqs.from_segments(mb.seq_lens, mb.prefix_lens, mb.parents, device)
    return ids, pos, temps, sources, seqs


def shared_prompt_logprobs(
    model, mb: MicroBatch, device: torch.device, pictures=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """token_logprobs of a row whose samples share prompts (MicroBatch.prefix_lens): the same
    [T] of the same tokens as the unshared rows give for them. Each token is predicted from the
    hidden state of its predecessor (MicroBatch.predecessors: the shared prompt's last token for
    a completion's first), gathered before the output projection; its gradient sums the
    predictions it makes."""
    ids, pos, temps, sources, seqs = shared_prompt_inputs(mb, device)
    logprobs, entropy = model(ids, pos, ids, temps, seqs=seqs, sources_BT=sources, **(pictures or {}))
    zero = logprobs.new_zeros(1)  # the row's first token has no context
    return torch.cat([zero, logprobs[0, 1:]]), torch.cat([zero, entropy[0, 1:]])


def row_flops(args, mb: MicroBatch) -> float:
    """train_flops of one packed row: its samples' (each shared prompt once, and the attention of
    each completion that shares it to its keys)."""
    whole = mb.seq_lens + mb.prefix_lens  # each sample's tokens; a branch's prompt is counted ...
    return train_flops(args, whole) - train_flops(args, mb.prefix_lens[mb.prefix_lens > 0])  # ... and taken off


def expert_load(routed_LE: torch.Tensor) -> dict[str, float]:
    """Load balance of the step's routing, [MoE layers, E] tokens per expert summed over every
    rank's rows: the busiest expert's tokens over the mean (1 = perfectly balanced), the
    largest over the layers and its mean over them."""
    ratio_L = routed_LE.max(dim=1).values / routed_LE.mean(dim=1).clamp_min(1e-9)
    return {"moe/max_load": float(ratio_L.max()), "moe/mean_max_load": float(ratio_L.mean())}


def make_publisher(cfg: TrainerRunConfig | SFTRunConfig, model: torch.nn.Module, loaded, d):
    """The adapters alone with trainer.lora.publish = "adapter", else full weights (LoRA folded in),
    in folders, or in memory with folders now and then (trainer.weights.transport, RL only);
    SetupError when the adapters cannot be published in PEFT's layout."""
    tcfg = cfg.trainer
    dtype = torch.float32 if tcfg.weights.dtype == "float32" else torch.bfloat16
    if tcfg.lora is not None and tcfg.lora.publish == "adapter":
        try:
            return AdapterPublisher(cfg.run_dir, model, tcfg.lora, cfg.model.name, tcfg.weights.keep, dtype, d)
        except ValueError as err:
            raise SetupError(f'trainer.lora.publish = "adapter": {err}') from None
    # RL publishes for servers, whose layers read a block-FP8 source (MiniMax-M2, GLM-5-FP8) in
    # FP8: its weights go out in that format again; SFT's folders stay plain (trained further).
    fp8 = fp8_weights(loaded.folder, loaded.hf_config) if isinstance(cfg, TrainerRunConfig) else None
    if fp8 and d.is_main:
        log.info(
            "the model's checkpoint is block FP8 (%s): its %d FP8 weights are published quantised the same way, "
            "as the servers' layers read them",
            fp8[0],
            len(fp8[1]),
        )
    folders = FolderPublisher(cfg.run_dir, loaded.folder, loaded.hf_config, tcfg.weights.keep, dtype, d, fp8=fp8)
    if tcfg.weights.transport == "memory" and isinstance(cfg, TrainerRunConfig):  # SFT publishes folders only
        from primerl_trainer.transfer import MemoryPublisher

        try:
            return MemoryPublisher(folders, model, loaded.hf_config, tcfg.weights, dtype, d, cfg.max_steps)
        except ValueError as err:
            raise SetupError(str(err)) from None
    return folders


class Session:
    def __init__(self, cfg: TrainerRunConfig | SFTRunConfig, job: str):
        self.cfg, self.tcfg = cfg, cfg.trainer
        self.d = d = init_distributed()
        self.run_dir = Path(cfg.run_dir)
        torch.manual_seed(cfg.seed)
        try:
            self.mesh = build_mesh(self.tcfg.parallel, d)
        except ValueError as err:
            raise SetupError(f"cannot lay out the trainer's {d.world_size} ranks: {err}") from None
        if self.tcfg.precision == "fp8":
            try:
                check_fp8_device(d.device)
            except ValueError as err:
                raise SetupError(str(err)) from None
        try:
            self.model, loaded = load_for_training(cfg, d, self.mesh)
        except (FileNotFoundError, ValueError) as err:
            raise SetupError(f"cannot load model {cfg.model.name!r}: {err}") from None
        self.args = self.model.args
        self.opt = build_optimizer(self.model, self.tcfg.optimizer, d.device)
        self.sched = build_scheduler(self.opt, self.tcfg.scheduler, cfg.max_steps)
        self.ckpt = Checkpointer(self.run_dir, self.tcfg.checkpoint.keep, d, self.mesh.layout)
        self.start_step, self.data_state = 0, {}
        if (latest := self.ckpt.latest()) is not None:
            meta = self.ckpt.load(latest, self.model, self.opt, self.sched)
            self.start_step, self.data_state = meta["step"] + 1, meta["data"]
            log.info("resumed from %s; continuing at step %d", latest, self.start_step)
            if changed := apply_settings(self.opt, self.sched, self.tcfg.optimizer):
                log.info("the optimizer's settings from the config replace the checkpoint's: %s", ", ".join(changed))
        self.publisher = make_publisher(cfg, self.model, loaded, d)
        self.model_folder = loaded.folder
        self.image_spec = (
            ImageSpec.from_folder(loaded.folder) if getattr(self.model, "visual", None) is not None else None
        )
        """The model's image settings (its preprocessor_config.json); None for a text model."""
        self.metrics = MetricsLogger(self.run_dir, cfg.wandb, msgspec.to_builtins(cfg), d.is_main, job=job)
        self.peak = peak_flops(d.device)
        self.steps_skipped = 0
        """Steps of this process whose loss or gradient norm was not finite (no optimizer step)."""

    def train_step(
        self, micro_batches: list[MicroBatch], loss_fn: LossFn, empty: bool = False
    ) -> dict[str, float | None]:
        """Forward/backward over this rank's micro-batches, clip, AdamW, schedule.

        `empty` (the same on every rank): the step has no token to learn from (the filters left
        nothing), so it takes no optimizer step: AdamW's weight decay and momentum would move
        the weights on zero gradients."""
        d = self.d
        t0 = time.monotonic()
        if d.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        self.model.train()
        rows = self.mesh.group_rows(micro_batches)
        sums: list[dict[str, torch.Tensor]] = []
        routed = None
        for mb in rows:
            loss, m = loss_fn(self.model, mb)
            # Each loss is already its share of the global batch's loss; FSDP2 sums the
            # gradients over ranks (placement.py): no scaling by the world size.
            loss.backward()
            sums.append({"loss": loss.detach(), **m})
            if (stats := self.model.moe_stats()) is not None:
                routed = stats if routed is None else routed + stats
        t1 = time.monotonic()
        grad_norm = clip_grad_norm(self.model, self.tcfg.optimizer.max_grad_norm)
        keys = sorted(sums[0])
        count = self.mesh.row_share  # a row's loss, metrics, tokens and FLOPs count once per CP group
        # Summed on the device, copied to the host once (not one sync per metric and micro-batch).
        local = (
            torch.stack([functools.reduce(operator.add, [s[k] for s in sums]).float() for k in keys]) * count
        ).tolist()
        local += [
            count * sum(mb.num_tokens for mb in rows),
            count * sum(int(mb.seq_lens.sum()) + int(mb.prefix_lens.sum()) for mb in rows),
            count * sum(row_flops(self.args, mb) for mb in rows),
        ]
        *totals, tokens, sample_tokens, flops = all_reduce_sum(local, d)  # every rank sees the same sums
        total = dict(zip(keys, totals))
        loss_value = total.pop("loss")
        lr = float(self.sched.get_last_lr()[0])  # a float (build_optimizer's lr); torch's type allows a tensor
        # The grad norm is global (every rank's shards) and the loss summed over ranks, so every
        # rank takes the same decision. A non-finite one would put NaN into the weights (and
        # AdamW's moments, for good): no optimizer step, no schedule step, nothing learnt.
        skipped = not (math.isfinite(loss_value) and math.isfinite(grad_norm))
        if skipped:
            self.steps_skipped += 1
            log.error(
                "step skipped: the %s is not finite (loss %s, grad norm %s); the weights are unchanged "
                "(%d steps skipped so far)",
                "loss" if not math.isfinite(loss_value) else "gradient norm",
                loss_value,
                grad_norm,
                self.steps_skipped,
            )
        elif empty:
            log.info("nothing to train on this step (no loss tokens): no optimizer step, the weights are unchanged")
        else:
            self.opt.step()
            self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        t2 = time.monotonic()
        return {
            "loss": loss_value,
            **mean_metrics([{**total}]),  # a copy: mean_metrics takes dict[str, Tensor | float] (invariant)
            "grad_norm": grad_norm,
            "lr": lr,
            "step_skipped": float(skipped),
            "step_empty": float(empty),
            "steps_skipped": float(self.steps_skipped),
            **({} if routed is None else expert_load(all_reduce_tensor_sum(routed, d))),
            "row_tokens": tokens,
            "sample_tokens": sample_tokens,
            "tokens_per_s": tokens / max(t2 - t0, 1e-9),
            "sample_tokens_per_s": sample_tokens / max(t2 - t0, 1e-9),
            "mfu": flops / max(t2 - t0, 1e-9) / (self.peak * d.world_size) if self.peak else None,
            "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if d.device.type == "cuda" else None,
            "time/fwd_bwd": t1 - t0,
            "time/optimizer": t2 - t1,
        }

    def publish(self, step: int, unchanged: bool = False) -> tuple[PolicyReady | None, float]:
        """Publish the weights after `step`. `unchanged` (the step was skipped): nothing new is
        written; the last folder is announced again as `step`'s, so the orchestrator and the
        servers move on to the next policy version without new weights."""
        t0 = time.monotonic()
        if unchanged and self.publisher.published:
            ready = self.publisher.announce_again(step)
        else:
            ready = self.publisher.publish(self.model, step)
        return ready, time.monotonic() - t0

    def checkpoint_due(self, step: int) -> bool:
        interval = self.tcfg.checkpoint.interval
        return bool(interval) and (step + 1) % interval == 0

    def maybe_checkpoint(self, step: int, data_state: dict, final: bool = False) -> bool:
        """Saves step `step` if one is due (or `final`); call it after the step's `log`, so that
        a process killed between the two leaves a metrics row without a checkpoint (the resume
        trains the step again) rather than a checkpoint whose step has no row (lost for good)."""
        due = self.checkpoint_due(step)
        if due or final:
            self.ckpt.save(step, self.model, self.opt, self.sched, data_state)
        return due

    def log(self, step: int, metrics: dict, samples: list | None = None) -> None:
        self.metrics.log(step, metrics, samples)

    def close(self, failed: bool) -> None:
        """Close the metrics and leave the process group: together after success, at once after
        a failure (no barrier: the other ranks may wait in another collective, or be gone)."""
        if not failed:
            self.publisher.close()
        self.metrics.close()
        shutdown(wait=not failed)
