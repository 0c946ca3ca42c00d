"""The run directory's contract: step folders, publishing, pruning, and which checkpoint a
restart resumes from when the newest ones are damaged."""

import json
import logging

import pytest
from primerl_protocol import rundir
from primerl_protocol.rundir import CheckpointError, latest_checkpoint


def make_checkpoint(run_dir, step, manifest=True):
    """A checkpoint as the trainer writes it: shards and a rank file staged, meta.json last."""
    root = run_dir / rundir.CHECKPOINTS
    tmp = rundir.staging_folder(root, step)
    tmp.mkdir(parents=True)
    (tmp / "__0_0.distcp").write_bytes(bytes(range(256)) * (step + 1))
    (tmp / ".metadata").write_bytes(b"m" * 50)
    (tmp / "rank0.pt").write_bytes(b"r" * 10)
    meta = {"step": step, "world_size": 1, "scheduler": {}, "data": {"next_step": step + 1}}
    if manifest:
        rundir.write_meta(tmp, meta)
    else:  # as checkpoints were written before meta.json had a manifest
        (tmp / rundir.META).write_text(json.dumps(meta))
    final = rundir.step_folder(root, step)
    rundir.publish(tmp, final)
    return final


def test_step_folder_names_round_trip():
    root = rundir.step_folder("/r/checkpoints", 12).parent
    assert rundir.step_folder(root, 12).name == "step_12"
    assert rundir.staging_folder(root, 12).name == ".step_12.tmp"
    assert rundir.step_of(rundir.step_folder(root, 12)) == 12
    for name in (".step_12.tmp", "step_", "step_x1", "step_-1", "stepx_3", "12", "step_٣"):
        assert rundir.step_of(root / name) is None, name


def test_complete_steps_are_numeric_order_and_need_the_marker(tmp_path):
    for step in (10, 9, 100):
        (tmp_path / f"step_{step}").mkdir()
        (tmp_path / f"step_{step}" / "m").write_text("")
    (tmp_path / "step_11").mkdir()  # no marker
    (tmp_path / ".step_12.tmp").mkdir()
    (tmp_path / "step_abc").mkdir()
    assert [s for s, _ in rundir.complete_steps(tmp_path, "m")] == [9, 10, 100]
    assert [s for s, _ in rundir.complete_steps(tmp_path, None)] == [9, 10, 11, 100]
    assert rundir.complete_steps(tmp_path / "absent", "m") == []


def test_prune_keeps_the_newest_and_zero_keeps_all(tmp_path):
    for step in range(5):
        (tmp_path / f"step_{step}").mkdir()
    assert rundir.prune(tmp_path, 0) == []
    removed = rundir.prune(tmp_path, 2)
    assert [p.name for p in removed] == ["step_0", "step_1", "step_2"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_3", "step_4"]


def test_publish_replaces_an_existing_folder(tmp_path):
    (tmp_path / "step_1").mkdir()
    (tmp_path / "step_1" / "old").write_text("old")
    tmp = rundir.staging_folder(tmp_path, 1)
    tmp.mkdir()
    (tmp / "new").write_text("new")
    rundir.publish(tmp, rundir.step_folder(tmp_path, 1))
    assert [p.name for p in (tmp_path / "step_1").iterdir()] == ["new"] and not tmp.exists()


def test_meta_records_every_other_file_and_its_size(tmp_path):
    folder = make_checkpoint(tmp_path, 3)
    meta = json.loads((folder / rundir.META).read_text())
    assert meta["files"] == {".metadata": 50, "__0_0.distcp": 1024, "rank0.pt": 10}
    assert rundir.read_checkpoint(folder) == meta


def test_the_newest_usable_checkpoint_is_chosen(tmp_path):
    assert latest_checkpoint(tmp_path) is None
    for step in (1, 2, 10):
        make_checkpoint(tmp_path, step)
    path, meta = latest_checkpoint(tmp_path)
    assert path.name == "step_10" and meta["step"] == 10 and meta["data"] == {"next_step": 11}


def test_garbage_meta_json_falls_back_to_the_previous_with_a_warning(tmp_path, caplog):
    make_checkpoint(tmp_path, 1)
    newest = make_checkpoint(tmp_path, 2)
    (newest / rundir.META).write_bytes(b"\x00\xff{not json")
    with caplog.at_level(logging.WARNING, logger="primerl.protocol"):
        path, meta = latest_checkpoint(tmp_path)
    assert path.name == "step_1" and meta["step"] == 1
    skipped = [r.getMessage() for r in caplog.records if str(newest) in r.getMessage()]
    assert len(skipped) == 1 and "is not JSON" in skipped[0]


def test_a_truncated_shard_falls_back_to_the_previous(tmp_path, caplog):
    make_checkpoint(tmp_path, 1)
    newest = make_checkpoint(tmp_path, 2)
    with (newest / "__0_0.distcp").open("r+b") as f:
        f.truncate(100)
    with caplog.at_level(logging.WARNING, logger="primerl.protocol"):
        path, _ = latest_checkpoint(tmp_path)
    assert path.name == "step_1"
    assert "__0_0.distcp has 100 bytes, not 768" in caplog.text and str(newest) in caplog.text


def test_a_missing_file_or_key_or_wrong_step_falls_back(tmp_path, caplog):
    make_checkpoint(tmp_path, 1)
    missing_file = make_checkpoint(tmp_path, 2)
    (missing_file / "rank0.pt").unlink()
    missing_key = make_checkpoint(tmp_path, 3)
    meta = json.loads((missing_key / rundir.META).read_text())
    (missing_key / rundir.META).write_text(json.dumps({k: v for k, v in meta.items() if k != "data"}))
    wrong_step = make_checkpoint(tmp_path, 4)
    (wrong_step / rundir.META).write_text(json.dumps({**meta, "step": 7}))
    not_object = make_checkpoint(tmp_path, 5)
    (not_object / rundir.META).write_text("[1, 2]")
    with caplog.at_level(logging.WARNING, logger="primerl.protocol"):
        path, _ = latest_checkpoint(tmp_path)
    assert path.name == "step_1"
    for expected in ("rank0.pt is missing", "lacks data", "says step 7", "not a JSON object"):
        assert expected in caplog.text, expected


def test_checkpoints_without_a_manifest_are_accepted_as_before(tmp_path):
    make_checkpoint(tmp_path, 1)
    old = make_checkpoint(tmp_path, 2, manifest=False)
    (old / "__0_0.distcp").write_bytes(b"")  # unknowable without a manifest
    assert latest_checkpoint(tmp_path)[0].name == "step_2"


def test_incomplete_folders_are_not_candidates(tmp_path):
    make_checkpoint(tmp_path, 1)
    (tmp_path / rundir.CHECKPOINTS / "step_5").mkdir()  # no meta.json: not complete
    (tmp_path / rundir.CHECKPOINTS / ".step_6.tmp").mkdir()
    assert latest_checkpoint(tmp_path)[0].name == "step_1"


def test_checkpoints_that_are_all_unusable_are_refused_not_ignored(tmp_path):
    for step in (1, 2):
        (make_checkpoint(tmp_path, step) / rundir.META).write_text("{")
    with pytest.raises(
        CheckpointError,
        match=r"no checkpoint in \S*checkpoints can be resumed from \(step_2: meta.json is "
        r"not JSON.*; step_1: meta.json is not JSON.*refusing to start again",
    ):
        latest_checkpoint(tmp_path)


def test_prune_counts_only_complete_checkpoints_and_leaves_half_written_ones(tmp_path):
    """keep = 2 of step 1..4: steps 3 and 4 stay. A checkpoint being written (its staging
    folder, newer than all) and a half-written `step_6` (no meta.json: a crash) are neither
    counted against `keep` nor removed, and the newest complete one is still what resumes."""
    for step in range(1, 5):
        make_checkpoint(tmp_path, step)
    root = tmp_path / rundir.CHECKPOINTS
    writing = rundir.staging_folder(root, 5)
    writing.mkdir()
    (writing / "__0_0.distcp").write_bytes(b"x" * 100)  # shards so far, no meta.json yet
    crashed = rundir.step_folder(root, 6)
    crashed.mkdir()
    (crashed / "__0_0.distcp").write_bytes(b"y" * 10)
    removed = rundir.prune(root, 2, rundir.META)
    assert [p.name for p in removed] == ["step_1", "step_2"]
    assert sorted(p.name for p in root.iterdir()) == [".step_5.tmp", "step_3", "step_4", "step_6"]
    assert (writing / "__0_0.distcp").read_bytes() == b"x" * 100 and (crashed / "__0_0.distcp").exists()
    assert latest_checkpoint(tmp_path)[0].name == "step_4"
    assert rundir.prune(root, 2, rundir.META) == []  # pruning again changes nothing


def test_prune_never_removes_the_newest_complete_checkpoint(tmp_path):
    """Whatever `keep` (1 and up), the newest complete checkpoint by step number (step_10 is
    newer than step_9, though it sorts first as a name) survives; `keep` at or above the
    count removes nothing; keep = 1 leaves exactly the newest."""
    root = tmp_path / rundir.CHECKPOINTS
    steps = (8, 9, 10)
    for keep in (5, 3, 2, 1):
        for step in steps:
            if not rundir.step_folder(root, step).exists():
                make_checkpoint(tmp_path, step)
        removed = rundir.prune(root, keep, rundir.META)
        left = sorted(rundir.step_of(p) for p in root.iterdir())
        assert left == list(steps[-keep:]), (keep, left)
        assert len(removed) == max(0, len(steps) - keep)
        assert latest_checkpoint(tmp_path)[0].name == "step_10"
