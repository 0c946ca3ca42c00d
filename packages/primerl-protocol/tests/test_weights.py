"""The published-weights contract: complete folders verify, anything else is refused by name."""

import pytest
from primerl_protocol.weights import MARKER, verify, write_marker


@pytest.fixture
def folder(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(bytes(range(256)) * 100)
    (tmp_path / "config.json").write_text("{}")
    write_marker(tmp_path, 7, ["model.safetensors"], 0.0)
    return tmp_path


def test_a_complete_folder_verifies(folder):
    meta = verify(folder)
    assert meta["step"] == 7 and meta["files"] == ["model.safetensors"]
    assert verify(folder, expected=meta["checksum"]) == meta


def test_a_changed_byte_is_caught(folder):
    data = bytearray((folder / "model.safetensors").read_bytes())
    data[1234] ^= 1
    (folder / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(ValueError, match="does not match"):
        verify(folder)


def test_a_half_written_folder_is_refused(folder):
    (folder / MARKER).unlink()
    with pytest.raises(ValueError, match="not a complete published weights folder"):
        verify(folder)


def test_a_missing_file_and_a_wrong_expected_checksum(folder):
    with pytest.raises(ValueError, match="is not the expected"):
        verify(folder, expected="0" * 32)
    (folder / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="files listed in primerl.json are missing: model.safetensors"):
        verify(folder)
    with pytest.raises(ValueError, match="no such folder"):
        verify(folder / "nope")


def test_durable_rename_syncs_every_file_before_the_rename(tmp_path, monkeypatch):
    """What reaches the disk cannot be observed without a power cut, so this records the order
    of fsyncs (of real descriptors) and the rename."""
    import os

    from primerl_protocol.rundir import durable_rename

    tmp = tmp_path / ".step_3.tmp"
    (tmp / "sub").mkdir(parents=True)
    for name in ["a.safetensors", "primerl.json", "sub/rank0.pt"]:
        (tmp / name).write_bytes(b"x" * 10)
    events, fsync, rename = [], os.fsync, type(tmp).rename
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(os.readlink(f"/proc/self/fd/{fd}")), fsync(fd)))
    monkeypatch.setattr(type(tmp), "rename", lambda self, to: (events.append("rename"), rename(self, to))[1])
    durable_rename(tmp, tmp_path / "step_3")
    cut = events.index("rename")
    synced = {os.path.relpath(p, tmp) for p in events[:cut]}
    assert synced == {"a.safetensors", "primerl.json", "sub/rank0.pt", "sub", "."}
    assert events[cut + 1 :] == [str(tmp_path)]  # the parent, after the rename
    assert (tmp_path / "step_3" / "sub" / "rank0.pt").read_bytes() == b"x" * 10


def test_the_marker_says_what_the_folder_holds(folder, tmp_path):
    """Full weights or a LoRA adapter (what the loader does with it differs); markers written
    before formats existed read as full weights; an unknown format is refused when written."""
    from primerl_protocol.weights import ADAPTER, FULL, format_of

    assert format_of(verify(folder)) == FULL
    write_marker(folder, 7, ["model.safetensors"], 0.0, format=ADAPTER)
    assert format_of(verify(folder)) == ADAPTER
    assert format_of({"step": 1, "files": [], "checksum": ""}) == FULL
    with pytest.raises(ValueError, match="unknown published-folder format 'gguf'"):
        write_marker(folder, 7, ["model.safetensors"], 0.0, format="gguf")
