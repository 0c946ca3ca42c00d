"""Publishing the trainer's weights for inference after each step.

`FolderPublisher` writes the full weights in Hugging Face layout (safetensors, sharded when
large, config and tokenizer files beside them) to `run_dir/weights/step_N`, atomically:
everything goes to a temporary folder, a checksum marker (`primerl.json`, xxh3-128 over the
weight files: several GB/s, where blake2b's ~1 GB/s alone would take seconds for a 2B model)
is written last, and the folder is renamed into place. Folders beyond `keep`
are removed, oldest first. The returned PolicyReady(step, location, checksum) is what the
orchestrator passes on to inference, which verifies the checksum before swapping weights.

Publishers are interchangeable (`WeightPublisher`): a later one can broadcast over NCCL to
GPU inference servers without the training loop changing.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Protocol

import torch
import xxhash

from primerl_models import save_hf
from primerl_protocol import PolicyReady
from primerl_trainer.distributed import Dist

MARKER = "primerl.json"
# Files of a HF model folder that travel with the weights (tokenizer, generation settings).
SIDE_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
    "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja",
)


class WeightPublisher(Protocol):
    def publish(self, model: torch.nn.Module, step: int) -> PolicyReady | None:
        """Make the weights of `step` available to inference; every rank calls it.
        Returns the message to send (on rank 0), else None."""


CHECKSUM = "xxh3_128"


def checksum(folder: Path, files: list[str]) -> str:
    """xxh3-128 over the files' names and bytes, in name order."""
    h = xxhash.xxh3_128()
    for name in sorted(files):
        h.update(name.encode())
        with (folder / name).open("rb") as f:
            while chunk := f.read(16 << 20):
                h.update(chunk)
    return h.hexdigest()


def verify(folder: str | Path) -> dict:
    """The marker of a published folder, after checking its checksum (ValueError if wrong)."""
    folder = Path(folder)
    marker = folder / MARKER
    if not marker.exists():
        raise ValueError(f"{folder}: no {MARKER}: not a complete published weights folder")
    meta = json.loads(marker.read_text())
    got = checksum(folder, meta["files"])
    if got != meta["checksum"]:
        raise ValueError(f"{folder}: checksum {got} does not match {meta['checksum']} (corrupt or modified)")
    return meta


class FolderPublisher:
    def __init__(self, run_dir: str | Path, source: Path, hf_config: dict, keep: int, dtype: torch.dtype, d: Dist):
        self.root = Path(run_dir) / "weights"
        self.source, self.hf_config, self.keep, self.dtype, self.d = source, hf_config, keep, dtype, d
        self.last_timing: dict[str, float] = {}
        if d.is_main:
            self.root.mkdir(parents=True, exist_ok=True)

    def gather(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """Full tensors on rank 0's CPU (empty elsewhere): each parameter is all-gathered on
        the device, cast there to the published dtype, then copied (half the bytes of fp32)."""
        out = {}
        for name, tensor in model.state_dict().items():
            full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
            if self.d.is_main:
                out[name] = full.detach().to(self.dtype).cpu()
            del full
        return out

    def publish(self, model: torch.nn.Module, step: int) -> PolicyReady | None:
        t0 = time.monotonic()
        state = self.gather(model)  # every rank takes part
        if not self.d.is_main:
            return None
        t1 = time.monotonic()
        final = self.root / f"step_{step}"
        tmp = self.root / f".step_{step}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        config = dict(self.hf_config, torch_dtype=str(self.dtype).removeprefix("torch."))
        files = [p.name for p in save_hf(state, config, tmp)]
        t2 = time.monotonic()
        for name in SIDE_FILES:
            if (self.source / name).exists():
                shutil.copy2(self.source / name, tmp / name)
        digest = checksum(tmp, files)
        t3 = time.monotonic()
        self.last_timing = {"gather": t1 - t0, "write": t2 - t1, "checksum": t3 - t2}
        marker = {"step": step, "files": files, "checksum": digest, "algorithm": CHECKSUM, "time": time.time()}
        (tmp / MARKER).write_text(json.dumps(marker))
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        self._prune()
        return PolicyReady(step=step, location=str(final.resolve()), checksum=digest)

    def _prune(self) -> None:
        steps = sorted(int(p.name.removeprefix("step_")) for p in self.root.glob("step_*") if p.name[5:].isdigit())
        for old in steps[: -self.keep]:
            shutil.rmtree(self.root / f"step_{old}", ignore_errors=True)
