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
