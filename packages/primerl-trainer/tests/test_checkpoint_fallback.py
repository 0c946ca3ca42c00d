"""Resuming when the newest checkpoint is damaged: the trainer falls back to the previous
usable one, the same one the orchestrator's `rundir.latest_checkpoint` picks; it stops naming
the folder when the chosen one still fails to load, and refuses to start from scratch when
checkpoints exist but none is usable. Real DCP checkpoints on a real gloo process group (one
rank in-process; the end-to-end SFT resume on two ranks is in test_sft.py)."""

import pytest
import torch
from primerl_protocol import rundir
from primerl_trainer.checkpoint import Checkpointer
from primerl_trainer.engine import SetupError
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
    return model, opt, sched


def train(model, opt, sched):
    model(torch.ones(2, 8)).square().sum().backward()
    opt.step()
    sched.step()
    opt.zero_grad()


def run_with_checkpoints(run_dir, d, steps=(3, 7), keep=3):
    """Checkpoints at `steps`; returns {step: the weights saved then}."""
    ckpt, (model, opt, sched), saved = Checkpointer(run_dir, keep, d), parts(), {}
    for step in range(max(steps) + 1):
        train(model, opt, sched)
        if step in steps:
            ckpt.save(step, model, opt, sched, {"next_step": step + 1})
            saved[step] = model.weight.detach().clone()
    return saved


def resume(run_dir, d, keep=3):
    """What a restarted trainer does: pick, then load into fresh parts."""
    ckpt = Checkpointer(run_dir, keep, d)
    path = ckpt.latest()
    model, opt, sched = parts(seed=1)
    meta = ckpt.load(path, model, opt, sched)
    return ckpt, path, meta, (model, opt, sched)


def orchestrators_choice(run_dir):
    return rundir.latest_checkpoint(run_dir)[0]


def test_a_garbage_newest_meta_resumes_from_the_previous_one(tmp_path, d, caplog):
    saved = run_with_checkpoints(tmp_path, d)
    newest = tmp_path / "checkpoints" / "step_7"
    (newest / "meta.json").write_text('{"step": 7, "world_')  # cut short while being written
    _, path, meta, (model, _, sched) = resume(tmp_path, d)
    assert path.name == "step_3" and meta["step"] == 3 and meta["data"] == {"next_step": 4}
    assert path == orchestrators_choice(tmp_path)
    assert torch.equal(model.weight, saved[3])
    assert sched.last_epoch == 4  # the schedule of step 3 (4 scheduler steps), not of step 7
    assert f"checkpoint {newest} is not usable" in caplog.text and "is not JSON" in caplog.text


def test_a_truncated_shard_resumes_from_the_previous_one(tmp_path, d, caplog):
    saved = run_with_checkpoints(tmp_path, d)
    newest = tmp_path / "checkpoints" / "step_7"
    shard = next(newest.glob("*.distcp"))
    with shard.open("r+b") as f:
        f.truncate(shard.stat().st_size // 2)
    _, path, meta, (model, _, _) = resume(tmp_path, d)
    assert path.name == "step_3" and path == orchestrators_choice(tmp_path)
    assert torch.equal(model.weight, saved[3])
    assert f"{shard.name} has {shard.stat().st_size} bytes" in caplog.text


def test_a_chosen_checkpoint_that_fails_to_load_stops_the_trainer_naming_it(tmp_path, d):
    """Same sizes, damaged bytes: the manifest cannot tell, so both sides pick step 7; the
    trainer must then stop, not quietly load step 3 while the orchestrator resumes at 8."""
    run_with_checkpoints(tmp_path, d)
    metadata = tmp_path / "checkpoints" / "step_7" / ".metadata"
    metadata.write_bytes(b"\0" * metadata.stat().st_size)
    ckpt = Checkpointer(tmp_path, 3, d)
    assert ckpt.latest().name == "step_7" == orchestrators_choice(tmp_path).name
    with pytest.raises(
        SetupError,
        match=r"cannot resume from checkpoint \S*checkpoints/step_7 \(CheckpointException: "
        r".*invalid load key.*move step_7 out of",
    ):
        ckpt.load(ckpt.latest(), *parts())


def test_checkpoints_that_are_all_unusable_refuse_a_fresh_start(tmp_path, d):
    run_with_checkpoints(tmp_path, d)
    for step in (3, 7):
        (tmp_path / "checkpoints" / f"step_{step}" / "meta.json").write_text("not json")
    with pytest.raises(
        SetupError,
        match=r"no checkpoint in \S*checkpoints can be resumed from \(step_7: .*step_3: .*refusing to start again from scratch",
    ):
        Checkpointer(tmp_path, 3, d).latest()
    assert Checkpointer(tmp_path / "fresh", 3, d).latest() is None  # no checkpoints at all: a fresh run


def test_the_first_save_after_falling_back_removes_the_skipped_newer_ones(tmp_path, d):
    """keep = 1: without this the skipped step_7 would count as the newest and the good
    step_4 would be pruned, leaving nothing usable."""
    run_with_checkpoints(tmp_path, d)
    (tmp_path / "checkpoints" / "step_7" / "meta.json").write_text("not json")
    ckpt, path, _, (model, opt, sched) = resume(tmp_path, d, keep=1)
    assert path.name == "step_3"
    train(model, opt, sched)
    ckpt.save(4, model, opt, sched, {"next_step": 5})
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_4"]
    assert orchestrators_choice(tmp_path).name == "step_4"
