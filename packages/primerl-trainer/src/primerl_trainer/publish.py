"""Publishing the trainer's weights for inference after each step.

`FolderPublisher` writes the full weights in Hugging Face layout (safetensors, sharded when
large, config and tokenizer files beside them) to `run_dir/weights/step_N`, atomically:
everything goes to a temporary folder, a checksum marker (`primerl.json`, xxh3-128 over the
weight files: several GB/s, where blake2b's ~1 GB/s alone would take seconds for a 2B model)
is written last, and the folder is renamed into place. Folders beyond `keep`
are removed, oldest first, but for every `keep_every`-th (trainer.weights.keep_every), kept
for evals after the run. The returned PolicyReady(step, location, checksum, format) is what
the orchestrator passes on to inference, which verifies the checksum before swapping weights.
A LoRA trainer publishes its adapters alone the same way (adapters.py, `AdapterPublisher`),
unless trainer.lora.publish = "merged": then this one folds them into full weights.

Publishers are interchangeable (`WeightPublisher`): a later one can broadcast over NCCL to
GPU inference servers without the training loop changing.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Protocol

import torch
from primerl_models import carried_tensors, published_config, save_hf
from primerl_models.hf import FP8Layout
from primerl_protocol import PolicyReady, rundir
from primerl_protocol.weights import FULL, write_marker

from primerl_trainer.distributed import Dist
from primerl_trainer.lora import adapted_weights, fold

# Files of a HF model folder that travel with the weights (tokenizer, generation settings).
SIDE_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
)


class WeightPublisher(Protocol):
    counts: dict[str, float]
    """Running figures for the step's metrics (rank 0)."""

    def publish(self, model: torch.nn.Module, step: int) -> PolicyReady | None:
        """Make the weights of `step` available to inference; every rank calls it.
        Returns the message to send (on rank 0), else None."""

    def close(self) -> None:
        """Finish what is still in flight (every rank calls it, at the end of the run)."""


def gathered(state: dict, names: list[str], kept: set[str], dtype: torch.dtype, d: Dist):
    """(name, full tensor on the device) of each of `names` in `state` on rank 0 (nothing
    elsewhere), cast to `dtype` unless in `kept`. Every rank must iterate it to its end: each
    tensor's all-gather (FSDP shards, EP-sharded experts) is a collective, one at a time."""
    for name in names:
        tensor = state[name]
        full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
        if d.is_main:
            yield name, full.detach().to(full.dtype if name in kept else dtype)
        del full


class StepFolders:
    """What every folder publisher shares: `run_dir/weights/step_N` folders written in a staging
    folder, checksummed (the marker, last), renamed into place, the oldest pruned."""

    format = FULL
    """The folders' format (primerl_protocol.weights), in their marker and in PolicyReady."""
    counts: dict[str, float] = {}

    def __init__(self, run_dir: str | Path, keep: int, d: Dist, keep_every: int = 0):
        self.root = rundir.RunDir(run_dir).weights
        self.keep, self.d = keep, d
        self.keep_every = keep_every
        """Folders of steps N with N + 1 a multiple of this survive the pruning (0: none):
        trainer.weights.keep_every."""
        self.last_timing: dict[str, float] = {}
        self.last: PolicyReady | None = None
        """The last weights this publisher wrote (on rank 0; None on the others)."""
        self.published = False
        """Whether any weights were published yet (the same on every rank)."""
        if d.is_main:
            self.root.mkdir(parents=True, exist_ok=True)

    def gather(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The tensors to publish, on rank 0's CPU (every rank takes part; empty elsewhere)."""
        raise NotImplementedError

    def write(self, state: dict[str, torch.Tensor], tmp: Path) -> list[str]:
        """Write the gathered tensors (and what goes beside them) into the staging folder `tmp`;
        the names of the files the checksum covers."""
        raise NotImplementedError

    def publish(self, model: torch.nn.Module, step: int) -> PolicyReady | None:
        t0 = time.monotonic()
        state = self.gather(model)  # every rank takes part
        self.published = True
        if not self.d.is_main:
            return None
        t1 = time.monotonic()
        tmp = rundir.staging_folder(self.root, step)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        files = self.write(state, tmp)
        return self.commit(tmp, step, files, {"gather": t1 - t0}, t1)

    def commit(
        self, tmp: Path, step: int, files: list[str], timing: dict[str, float], written_from: float
    ) -> PolicyReady:
        """Mark the staging folder `tmp` of `step` complete and put it in place (rank 0)."""
        t2 = time.monotonic()
        digest = write_marker(tmp, step, files, time.time(), format=self.format)
        t3 = time.monotonic()
        self.last_timing = {**timing, "write": t2 - written_from, "checksum": t3 - t2}
        final = rundir.step_folder(self.root, step)
        rundir.publish(tmp, final)
        # Folders newer than this step are from a history a resumed run left (published after
        # its last checkpoint): kept, they would count against `keep` and push out the folder
        # just announced (as Checkpointer._drop_newer does for checkpoints).
        for n, folder in rundir.complete_steps(self.root, None):
            if n > step:
                shutil.rmtree(folder, ignore_errors=True)
        self.prune()
        self.last = PolicyReady(step=step, location=str(final.resolve()), checksum=digest, format=self.format)
        return self.last

    def close(self) -> None:
        """Nothing in flight: every folder is in place when publish returns."""

    def prune(self) -> None:
        """Remove all but the newest `keep` folders and those `keep_every` keeps."""
        for n, folder in rundir.complete_steps(self.root, None)[: -self.keep]:
            if not (self.keep_every and (n + 1) % self.keep_every == 0):
                shutil.rmtree(folder, ignore_errors=True)

    def announce_again(self, step: int) -> PolicyReady | None:
        """The last published weights, announced as those of `step` (which changed nothing)."""
        if not self.d.is_main or self.last is None:
            return None
        return PolicyReady(step=step, location=self.last.location, checksum=self.last.checksum, format=self.format)


class FolderPublisher(StepFolders):
    def __init__(
        self,
        run_dir: str | Path,
        source: Path,
        hf_config: dict,
        keep: int,
        dtype: torch.dtype,
        d: Dist,
        fp8: FP8Layout | None = None,
    ):
        super().__init__(run_dir, keep, d)
        # hf_config: the source folder's config.json (published as published_config of it)
        self.source, self.hf_config, self.dtype = source, hf_config, dtype
        self.fp8 = fp8
        """For servers whose layers read the source's block FP8: its layout (the weights it
        names published quantised again from the trainer's, in `dtype` first); None: plain."""

    def gather(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """Full tensors on rank 0's CPU (empty elsewhere): each parameter is all-gathered on
        the device, cast there to the published dtype, then copied (half the bytes of fp32).
        Buffers keep their dtype (router correction biases stay fp32 in bf16 weights)."""
        buffers = {name for name, _ in model.named_buffers()}
        adapted = adapted_weights(model)
        state = model.state_dict()
        # LoRA layers' weights and adapters stay in their dtype until folded (below)
        kept = {name for name in state if name in buffers or name in adapted or ".lora_" in name}
        out = {name: full.cpu() for name, full in gathered(state, list(state), kept, self.dtype, self.d)}
        # adapters folded in fp32, then cast: what vLLM loads as an ordinary weight update
        return fold(out, model, self.dtype) if self.d.is_main else out

    def write(self, state: dict[str, torch.Tensor], tmp: Path) -> list[str]:
        # what was dequantised at load is published plain (no quantization_config)
        config = dict(published_config(self.hf_config, self.fp8), torch_dtype=str(self.dtype).removeprefix("torch."))
        # tensors the family carries untrained (GLM-4.5's MTP layer) come from the source folder
        carried = carried_tensors(self.source, self.hf_config, self.dtype)
        files = [p.name for p in save_hf(state, config, tmp, carried=carried, fp8=self.fp8)]
        del carried
        for name in SIDE_FILES:
            if (self.source / name).exists():
                shutil.copy2(self.source / name, tmp / name)
        return files
