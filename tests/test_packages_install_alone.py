"""Each package declares its own dependencies: primerl-protocol installs alone into a fresh
venv (with uv, from the same package index as the lock) and imports without the others."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # starts vLLM servers, torchrun trainers or installs: excluded by -m "not slow"

ROOT = Path(__file__).resolve().parents[1]


def _uv() -> str:
    found = shutil.which("uv") or str(Path(sys.executable).parent / "uv")
    if not Path(found).exists():
        pytest.fail("uv is not installed: it is in the workspace's dev group (uv sync)")
    return found


def test_protocol_installs_and_imports_alone(tmp_path):
    uv, venv = _uv(), tmp_path / "venv"
    subprocess.run([uv, "venv", "-q", "--python", sys.executable, str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    subprocess.run(
        [uv, "pip", "install", "-q", "--python", str(py), str(ROOT / "packages" / "primerl-protocol")],
        check=True,
        timeout=600,
    )
    code = (
        "import importlib.util, primerl_protocol, primerl_protocol.config;"
        "print(sorted(m for m in ('torch','vllm','primerl_models','primerl_trainer')"
        " if importlib.util.find_spec(m)))"
    )
    out = subprocess.run([py, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
