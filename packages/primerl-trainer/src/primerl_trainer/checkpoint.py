"""Sharded checkpoints (DCP) for resuming: model, optimizer, scheduler, step, RNG, data position.

`run_dir/checkpoints/step_N/` holds the DCP shards of model and optimizer, one `rank{r}.pt`
per rank (RNG states and anything rank-specific, as tensors and plain Python values, read back
with `torch.load(weights_only=True)`, which refuses to run code from the file) and `meta.json`
(step, world size, scheduler state, data position, and the size of every other file) written
last. A checkpoint is written to `.step_N.tmp` and renamed when complete (the layout is
primerl_protocol.rundir's). On restart rank 0 picks the newest usable checkpoint with the same
function the orchestrator uses (`rundir.latest_checkpoint`: an unreadable newer one is skipped
with a warning) and tells the other ranks; if that one then fails to load, the trainer stops
naming it rather than quietly pick another one the orchestrator would not pick.
"""

from __future__ import annotations

import json
import logging
import pickle
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from primerl_protocol import rundir
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from primerl_trainer.distributed import Dist

log = logging.getLogger("primerl.trainer")


class SetupError(RuntimeError):
    """The trainer cannot start: the model or the run directory is not usable (says which)."""


def _rng_state() -> dict:
    """This process's RNG states, as what `torch.load(weights_only=True)` reads: tensors, ints,
    floats, strings, tuples (numpy's key array as an int64 tensor, not a pickled ndarray)."""
    state = np.random.get_state(legacy=True)
    assert isinstance(state, tuple), "numpy's global RandomState is MT19937: its legacy state is a tuple"
    name, keys, pos, has_gauss, gauss = state
    numpy_state = {
        "name": name,
        "keys": torch.from_numpy(keys.astype(np.int64)),
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "gauss": float(gauss),
    }
    out = {"torch": torch.get_rng_state(), "numpy": numpy_state, "python": random.getstate()}
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state()
    return out


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _refusal(err: pickle.UnpicklingError) -> str:
    """torch's reason for refusing a file under weights_only=True, in one line."""
    found = re.search(
        r"WeightsUnpickler error: (.*?)(?: was not an allowed global|\. Please|$)", str(err), re.MULTILINE
    )
    return found.group(1) if found else f"{type(err).__name__}: {str(err)[:200]}"


class Checkpointer:
    def __init__(self, run_dir: str | Path, keep: int, d: Dist, layout: dict[str, int] | None = None):
        self.run_dir = Path(run_dir)
        self.root = rundir.RunDir(self.run_dir).checkpoints
        self.keep, self.d = keep, d
        self.layout = layout or {}
        """The trainer's mesh sizes (dp, cp, ep), recorded in meta.json; any layout resumes any other."""

    def latest(self) -> Path | None:
        """The checkpoint to resume from (the orchestrator's choice too), the same on every
        rank; None for a fresh run. SetupError if there are checkpoints but none is usable."""
        choice: list = [None]
        if self.d.is_main:
            try:
                found = rundir.latest_checkpoint(self.run_dir)
                choice[0] = ("ok", None if found is None else str(found[0]))
            except rundir.CheckpointError as err:
                choice[0] = ("error", str(err))
        dist.broadcast_object_list(choice, src=0)
        kind, value = choice[0]
        if kind == "error":
            raise SetupError(value)
        return None if value is None else Path(value)

    def save(self, step: int, model, optimizer, scheduler, data: dict) -> Path:
        final, tmp = rundir.step_folder(self.root, step), rundir.staging_folder(self.root, step)
        if self.d.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        self.d.barrier()
        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp_save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
        torch.save({"rng": _rng_state()}, tmp / f"rank{self.d.rank}.pt")
        self.d.barrier()
        if self.d.is_main:
            meta = {
                "step": step,
                "world_size": self.d.world_size,
                "layout": self.layout,
                "scheduler": scheduler.state_dict(),
                "data": data,
            }
            rundir.write_meta(tmp, meta)
            rundir.publish(tmp, final)
            self._drop_newer(step)
            rundir.prune(self.root, self.keep, rundir.META)
        self.d.barrier()
        return final

    def load(self, path: Path, model, optimizer, scheduler) -> dict:
        """Restore everything from `path`; returns meta.json (step, data position, ...).
        SetupError naming the folder if anything in it cannot be loaded."""
        try:
            return self._load(path, model, optimizer, scheduler)
        except (Exception, CheckpointException) as err:  # the latter is a BaseException
            last = (str(err).strip().splitlines() or [""])[-1]  # DCP's errors carry each rank's traceback
            raise SetupError(
                f"cannot resume from checkpoint {path} ({type(err).__name__}: {last}); the orchestrator resumes "
                f"from the same one: to resume from the one before, move {path.name} out of {path.parent}"
            ) from err

    def _load(self, path: Path, model, optimizer, scheduler) -> dict:
        meta = json.loads((path / rundir.META).read_text())
        if meta["world_size"] != self.d.world_size:
            log.warning(
                "%s was written by %d ranks, resuming on %d: model and optimizer are resharded, "
                "per-rank RNG states are not restored",
                path,
                meta["world_size"],
                self.d.world_size,
            )
        if meta.get("layout", self.layout) != self.layout:
            log.info(
                "%s was written with the layout %s, resuming with %s: DCP reshards model and optimizer",
                path,
                meta.get("layout"),
                self.layout,
            )
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        dcp_load(state, checkpoint_id=str(path))
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        scheduler.load_state_dict(meta["scheduler"])
        rank_file = path / f"rank{self.d.rank}.pt"
        if rank_file.exists():
            try:
                rank_state = torch.load(rank_file, weights_only=True)
            except pickle.UnpicklingError as err:  # objects other than tensors and plain values
                log.warning(
                    "%s is not plain data (%s): it was written before RNG states were saved as plain tensors "
                    "(numpy's was a pickled array), or not by primerl, and reading it could run code from it; "
                    "resuming WITHOUT this rank's RNG states (model, optimizer, schedule and data position are "
                    "restored; the run goes on, but not bit for bit as an uninterrupted one would)",
                    rank_file,
                    _refusal(err),
                )
            else:
                _set_rng_state(rank_state["rng"])
        return meta

    def _drop_newer(self, step: int) -> None:
        """Checkpoints newer than the one just written were skipped at resume as unusable and
        belong to a history this run left; kept, they would count against `keep` (and push
        out the good ones) and could be picked on a later restart."""
        for n, folder in rundir.complete_steps(self.root, rundir.META):
            if n > step:
                log.warning("removing %s: newer than the resumed run's step %d, skipped when it resumed", folder, step)
                shutil.rmtree(folder, ignore_errors=True)
