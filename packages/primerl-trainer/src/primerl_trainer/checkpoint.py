"""Sharded checkpoints (DCP) for resuming: model, optimizer, scheduler, step, RNG, data position.

`run_dir/checkpoints/step_N/` holds the DCP shards of model and optimizer, one `rank{r}.pt`
per rank (RNG states and anything rank-specific) and `meta.json` (step, world size, scheduler
state, data position) written last. A checkpoint is written to `.step_N.tmp` and renamed when
complete, so the newest `step_N` folder is always whole; `latest` finds it on restart.
"""

from __future__ import annotations

import json
import logging
import random
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from primerl_protocol.checkpoints import CHECKPOINTS, checkpoint_dirs, durable_rename
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from primerl_trainer.distributed import Dist

log = logging.getLogger("primerl.trainer")


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


class Checkpointer:
    def __init__(self, run_dir: str | Path, keep: int, d: Dist):
        self.root = Path(run_dir) / CHECKPOINTS
        self.keep, self.d = keep, d

    def latest(self) -> Path | None:
        dirs = checkpoint_dirs(self.root.parent)
        return dirs[-1] if dirs else None

    def save(self, step: int, model, optimizer, scheduler, data: dict) -> Path:
        final, tmp = self.root / f"step_{step}", self.root / f".step_{step}.tmp"
        if self.d.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        self.d.barrier()
        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
        torch.save({"rng": _rng_state()}, tmp / f"rank{self.d.rank}.pt")
        self.d.barrier()
        if self.d.is_main:
            meta = {"step": step, "world_size": self.d.world_size, "scheduler": scheduler.state_dict(), "data": data}
            (tmp / "meta.json").write_text(json.dumps(meta))
            shutil.rmtree(final, ignore_errors=True)
            durable_rename(tmp, final)
            self._prune()
        self.d.barrier()
        return final

    def load(self, path: Path, model, optimizer, scheduler) -> dict:
        """Restore everything from `path`; returns meta.json (step, data position, ...)."""
        meta = json.loads((path / "meta.json").read_text())
        if meta["world_size"] != self.d.world_size:
            log.warning(
                "%s was written by %d ranks, resuming on %d: model and optimizer are resharded, "
                "per-rank RNG states are not restored", path, meta["world_size"], self.d.world_size,
            )
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=str(path))
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        scheduler.load_state_dict(meta["scheduler"])
        rank_file = path / f"rank{self.d.rank}.pt"
        if rank_file.exists():
            _set_rng_state(torch.load(rank_file, weights_only=False)["rng"])
        return meta

    def _prune(self) -> None:
        if not self.keep:
            return
        for old in checkpoint_dirs(self.root.parent)[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)
