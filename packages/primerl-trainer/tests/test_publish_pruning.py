"""Which published weight folders survive: the newest `trainer.weights.keep`, and with
`trainer.weights.keep_every = k` the folder of every step N with N + 1 a multiple of k (the
weights after k, 2k, ... optimizer steps), kept for `primerl eval run=RUN_DIR` after the run.
The trainer sets it on its publisher (rl.py, sft.py): test_rl_trainer.py's run keeps them."""

from pathlib import Path

import torch
from primerl_protocol import rundir
from primerl_protocol.weights import verify
from primerl_trainer.distributed import Dist
from primerl_trainer.publish import StepFolders


class OneFile(StepFolders):
    """A publisher of one small file per step (pruning does not care what the folders hold)."""

    def gather(self, model):
        return {}

    def write(self, state, tmp: Path) -> list[str]:
        (tmp / "w.bin").write_bytes(b"weights")
        return ["w.bin"]


def publish_steps(run_dir: Path, steps, **kw) -> list[int]:
    publisher = OneFile(run_dir, d=Dist(rank=0, world_size=1, local_rank=0, device=torch.device("cpu")), **kw)
    for step in steps:
        publisher.publish(torch.nn.Linear(1, 1), step)
    return [n for n, _ in rundir.complete_steps(run_dir / rundir.WEIGHTS, None)]


def test_every_kth_steps_weights_survive_the_pruning(tmp_path):
    assert publish_steps(tmp_path / "every3", range(10), keep=2, keep_every=3) == [2, 5, 8, 9]
    for n, folder in rundir.complete_steps(tmp_path / "every3" / rundir.WEIGHTS, None):
        assert verify(folder)["step"] == n  # whole, as published
    assert publish_steps(tmp_path / "plain", range(10), keep=2) == [8, 9]
    assert publish_steps(tmp_path / "every1", range(5), keep=2, keep_every=1) == [0, 1, 2, 3, 4]


def test_a_resumed_run_drops_the_kept_folders_of_the_history_it_left(tmp_path):
    """Resumed at step 6 (its last checkpoint) after publishing up to step 9: step 8's folder was
    kept for evals, but belongs to weights this run no longer has; the kept ones before stay."""
    publish_steps(tmp_path, range(10), keep=2, keep_every=3)
    assert publish_steps(tmp_path, [6, 7], keep=2, keep_every=3) == [2, 5, 6, 7]
