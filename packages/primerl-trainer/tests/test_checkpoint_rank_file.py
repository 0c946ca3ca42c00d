"""A checkpoint's per-rank file (`rank{r}.pt`, the RNG states) is read as data, never as code:
resume restores every RNG stream bit for bit from it, and a rank file holding a pickle that
would run code (planted in the run directory, or written by an older primerl) is refused
without running anything: resume goes on without its RNG states and says so. Real DCP
checkpoints on a real one-rank gloo group in this process."""

import json
import logging
import random

import numpy as np
import pytest
import torch
from primerl_protocol import rundir
from primerl_trainer.checkpoint import Checkpointer, SetupError
from primerl_trainer.testing import one_rank_group


@pytest.fixture
def d(monkeypatch):
    """A one-rank gloo group in this process, torn down afterwards (environment restored)."""
    with one_rank_group(monkeypatch) as d:
        yield d


def parts(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
    model(torch.ones(2, 8)).square().sum().backward()
    opt.step()
    sched.step()
    return model, opt, sched


def draws() -> tuple:
    """The next numbers of every RNG stream a checkpoint restores (each draw advances it)."""
    return (
        torch.rand(5).tolist(),
        np.random.rand(5).tolist(),
        np.random.randn(3).tolist(),
        [random.random() for _ in range(5)],
    )


def checkpoint(run_dir, d):
    """A checkpoint at step 3 in `run_dir`: (its folder, the weights saved, the draws right after)."""
    model, opt, sched = parts()
    torch.manual_seed(11)
    np.random.seed(12)
    random.seed(13)
    np.random.randn()  # numpy's cached Gaussian is part of its state: hold one
    folder = Checkpointer(run_dir, 3, d).save(3, model, opt, sched, {"next_step": 4})
    return folder, model.weight.detach().clone(), draws()


def replace_rank_file(folder, content) -> None:
    """torch.save `content` as rank 0's file, and the manifest to match (as anyone who can write
    the run directory can): the checkpoint stays the one `latest` picks."""
    torch.save(content, folder / "rank0.pt")
    meta = json.loads((folder / rundir.META).read_text())
    rundir.write_meta(folder, {k: v for k, v in meta.items() if k != "files"})
    rundir.read_checkpoint(folder)  # usable again


def resume(run_dir, d):
    ckpt = Checkpointer(run_dir, 3, d)
    path = ckpt.latest()
    model, opt, sched = parts(seed=1)
    meta = ckpt.load(path, model, opt, sched)
    return path, meta, model


def test_resume_restores_every_rng_stream_bit_for_bit(tmp_path, d):
    folder, weights, after_save = checkpoint(tmp_path, d)
    assert torch.load(folder / "rank0.pt", weights_only=True)  # plain data: tensors, ints, floats, tuples
    torch.manual_seed(99)
    np.random.seed(99)
    random.seed(99)
    path, meta, model = resume(tmp_path, d)
    assert path == folder and meta["step"] == 3 and torch.equal(model.weight, weights)
    assert draws() == after_save


class RunsCode:
    """Unpickled, it writes `marker`: what a planted rank file could do with weights_only=False."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('ran')",)


def old_rank_file() -> dict:
    """The rank file as primerl wrote it before RNG states were plain tensors (numpy's state
    as a tuple holding an ndarray, which only a full unpickling reads)."""
    return {"rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}}


@pytest.mark.parametrize("planted", ["code", "old"])
def test_a_rank_file_that_is_not_plain_data_is_refused_and_resume_goes_on(tmp_path, d, caplog, planted):
    marker = tmp_path / "ran"
    folder, weights, after_save = checkpoint(tmp_path / "run", d)
    replace_rank_file(folder, {"rng": RunsCode(marker)} if planted == "code" else old_rank_file())
    np.random.seed(99)
    random.seed(99)  # (torch's: the fresh model's seed)
    error = None
    with caplog.at_level(logging.WARNING, logger="primerl.trainer"):
        try:
            path, meta, model = resume(tmp_path / "run", d)
        except SetupError as err:
            error = err
    assert not marker.exists(), "loading the checkpoint ran code from its rank file"
    assert error is None
    assert path == folder and meta["data"] == {"next_step": 4} and torch.equal(model.weight, weights)
    assert f"{folder / 'rank0.pt'} is not plain data" in caplog.text
    assert "resuming WITHOUT this rank's RNG states" in caplog.text
    assert ("exec" if planted == "code" else "multiarray") in caplog.text  # torch's reason, named
    assert all(now != then for now, then in zip(draws(), after_save))  # no stream restored
