"""Generated task data on disk: default folders are per user and settings, concurrent writes of
the same data leave one whole folder and never delete files in use, other generated data is
replaced and foreign folders are refused."""

from __future__ import annotations

import os
import tempfile
import threading
from pathlib import Path

import pytest
from primerl_envs.folders import MARKER, digest, write_folder
from primerl_search.generated import write_corpus
from primerl_swe.synthetic import write_instances
from primerl_terminal.generated import write_tasks


def tree(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): p.read_text() for p in sorted(root.rglob("*")) if p.is_file()}


def test_the_default_folders_are_per_user_and_settings(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    uid = os.getuid()
    assert Path(write_corpus(None, 4, seed=5)[0]["corpus"]) == tmp_path / f"primerl-search-5-4-uid{uid}"
    assert Path(write_instances(None, 2, seed=5)[0]["repo"]).parent == tmp_path / f"primerl-swe-5-2-uid{uid}"
    assert Path(write_tasks(None, 3, seed=5)[0]["workspace"]).parent == tmp_path / f"primerl-terminal-5-3-uid{uid}"


@pytest.mark.parametrize("write", [write_corpus, write_instances, write_tasks])
def test_concurrent_writes_of_the_same_data_leave_one_whole_folder_and_keep_files_in_use(tmp_path, write):
    root = tmp_path / "data"
    results = []
    threads = [threading.Thread(target=lambda: results.append(write(str(root), 6, seed=1))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 4 and all(r == results[0] for r in results)
    before = tree(root)
    assert before.pop(MARKER) == digest(before) and len(before) >= 6
    assert sorted(p.name for p in tmp_path.iterdir()) == [".data.lock", "data"]  # no half-written sibling left
    used = next(root / rel for rel in sorted(before))
    held = used.open()  # a run reading its data while another starts
    inode = used.stat().st_ino
    assert write(str(root), 6, seed=1) == results[0]
    assert used.stat().st_ino == inode and held.read() == before[str(used.relative_to(root))]  # not rewritten
    held.close()


def test_other_generated_data_is_replaced_and_foreign_folders_are_refused(tmp_path):
    root = tmp_path / "data"
    write_folder(root, {"a.txt": "1"})
    write_folder(root, {"b/c.txt": "2"})  # other settings: replaced
    assert tree(root) == {"b/c.txt": "2", MARKER: digest({"b/c.txt": "2"})}
    (tmp_path / "empty").mkdir()
    write_folder(tmp_path / "empty", {"a.txt": "1"})  # an empty folder is taken
    assert tree(tmp_path / "empty") == {"a.txt": "1", MARKER: digest({"a.txt": "1"})}
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    with pytest.raises(ValueError, match="mine: not a folder of generated data"):
        write_folder(mine, {"a.txt": "1"})
    assert tree(mine) == {"notes.txt": "keep"}


def test_a_failed_write_leaves_the_folder_as_it_was(tmp_path):
    root = tmp_path / "data"
    write_folder(root, {"a.txt": "1"})
    with pytest.raises(OSError):
        write_folder(root, {"b": "x", "b/c.txt": "2"})  # "b" is a file: "b/c.txt" cannot be written
    assert tree(root) == {"a.txt": "1", MARKER: digest({"a.txt": "1"})}
    assert sorted(p.name for p in tmp_path.iterdir()) == [".data.lock", "data"]
