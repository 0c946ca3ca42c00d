"""Each package declares its own dependencies: installed alone into a fresh venv, with only
what its pyproject.toml declares (and the workspace packages it declares, themselves installed
the same way), every one of its modules imports and its main API runs. And every package its
code imports (outside an `except ImportError` guard) is declared in its own pyproject.toml,
not only reached through another package's dependencies.

The versions are the lock's: `uv export --frozen` of the default (CPU) groups is passed as a
constraint file, and torch comes from the same flat index of CPU wheels that
primerl-inference's `[tool.uv.sources]` names for it. uv hardlinks from its cache, so after
`uv sync` each venv takes a second or two and downloads nothing new."""

import ast
import importlib.metadata
import os
import shutil
import subprocess
import sys
import textwrap
import tomllib
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# distribution name -> folder, for every separately published package of the workspace.
FOLDERS = {
    "primerl-protocol": ROOT / "packages" / "primerl-protocol",
    "primerl-models": ROOT / "packages" / "primerl-models",
    "primerl-algos": ROOT / "packages" / "primerl-algos",
    "primerl-envs": ROOT / "packages" / "primerl-envs",
    "primerl-inference": ROOT / "packages" / "primerl-inference",
    "primerl-orchestrator": ROOT / "packages" / "primerl-orchestrator",
    "primerl-trainer": ROOT / "packages" / "primerl-trainer",
    "primerl": ROOT / "apps" / "primerl",
}


def _uv() -> str:
    found = shutil.which("uv") or str(Path(sys.executable).parent / "uv")
    if not Path(found).exists():
        pytest.fail("uv is not installed: it is in the workspace's dev group (uv sync)")
    return found


def _project(name: str) -> dict:
    return tomllib.loads((FOLDERS[name] / "pyproject.toml").read_text())


def _requirement_name(req: str) -> str:
    for stop in "[<>=!~;@ (":
        req = req.split(stop)[0]
    return req.strip().lower().replace("_", "-")


def _workspace_closure(name: str) -> list[str]:
    """`name` and the workspace packages it declares, transitively (not on PyPI: installed from
    their folders, each with only its own declared dependencies)."""
    seen: list[str] = []
    todo = [name]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.append(n)
        todo += [d for d in map(_requirement_name, _project(n)["project"]["dependencies"]) if d in FOLDERS]
    return seen


def _torch_index_args() -> list[str]:
    """The index the lock takes torch from on CPU, as primerl-inference's pyproject names it."""
    uv = tomllib.loads((FOLDERS["primerl-inference"] / "pyproject.toml").read_text())["tool"]["uv"]
    names = {s["index"] for s in uv["sources"]["torch"]}
    args = []
    for index in uv["index"]:
        if index["name"] in names:
            args += ["--find-links" if index.get("format") == "flat" else "--extra-index-url", index["url"]]
    assert args, f"no [[tool.uv.index]] named {names} in primerl-inference's pyproject.toml"
    return args


@pytest.fixture(scope="module")
def constraints(tmp_path_factory) -> Path:
    """The lock's versions of the default (CPU) resolution, workspace packages left out."""
    path = tmp_path_factory.mktemp("lock") / "constraints.txt"
    subprocess.run(
        [
            _uv(),
            "export",
            "--frozen",
            "--no-hashes",
            "--no-emit-workspace",
            "--no-header",
            "--no-annotate",
            "--quiet",
            "--output-file",
            str(path),
        ],
        cwd=ROOT,
        check=True,
        timeout=120,
    )
    assert "torch==" in path.read_text()
    return path


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "UV_PYTHON")}
    env["HF_HUB_OFFLINE"] = "1"
    return env


def _install_alone(name: str, tmp_path: Path, constraints: Path) -> Path:
    """A fresh venv holding `name` (not editable) and what it declares; returns its python."""
    uv, venv = _uv(), tmp_path / "venv"
    subprocess.run([uv, "venv", "-q", "--python", sys.executable, str(venv)], check=True, timeout=120, env=_env())
    py = venv / "bin" / "python"
    out = subprocess.run(
        [
            uv,
            "pip",
            "install",
            "-q",
            "--python",
            str(py),
            "--constraint",
            str(constraints),
            *_torch_index_args(),
            *(str(FOLDERS[n]) for n in _workspace_closure(name)),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=_env(),
    )
    assert out.returncode == 0, f"installing {name} alone failed:\n{out.stderr}"
    return py


def _run(py: Path, code: str, cwd: Path) -> str:
    out = subprocess.run([str(py), "-c", code], capture_output=True, text=True, timeout=300, cwd=cwd, env=_env())
    assert out.returncode == 0, f"stdout:\n{out.stdout}\nstderr:\n{out.stderr}"
    return out.stdout


# Every module of the package's top-level import names imports (a module-level import of an
# undeclared package fails here), and none of the listed absent modules is installed.
IMPORT_ALL = """
import importlib, importlib.util, pkgutil, sys
tops, absent = {tops!r}, {absent!r}
for top in tops:
    pkg = importlib.import_module(top)
    for info in pkgutil.walk_packages(pkg.__path__, top + "."):
        importlib.import_module(info.name)
present = sorted(m for m in absent if importlib.util.find_spec(m) is not None)
assert not present, f"installed though not declared: {{present}}"
"""

# name -> (top-level modules, modules that must not be installed, a run of the main API)
CASES = {
    "primerl-protocol": (
        ["primerl_protocol"],
        ["torch", "vllm", "primerl_models", "primerl_algos", "primerl_trainer"],
        """
        from primerl_protocol import BatchMessage, Decoder, Encoder
        from primerl_protocol.testing import assert_same_batch, train_batch
        from primerl_protocol.config import Config, load_config
        batch = train_batch(num_micro_batches=2)
        assert_same_batch(Decoder(BatchMessage, "batches").decode(Encoder().encode(batch)), batch)
        class Root(Config):
            lr: float = 1.0
            name: str = "x"
        open("c.toml", "w").write('lr = 0.5\\n')
        assert load_config(Root, ["@", "c.toml", "name=y"]) == Root(lr=0.5, name="y")
        import numpy as np
        from primerl_protocol.images import ImageSpec, patchify
        patches, grid = patchify(np.zeros((256, 256, 3), np.uint8), ImageSpec())  # numpy alone, no torch
        assert grid == (1, 16, 16) and patches.shape == (256, 3 * 2 * 16 * 16)
        """,
    ),
    "primerl-models": (
        ["primerl_models"],
        ["vllm", "transformers", "primerl_algos"],
        """
        import torch
        from primerl_models import chunked_logprobs, load_model
        from primerl_models.tiny import build_tiny_model
        for family in ("qwen3", "qwen3_moe", "llama"):
            model = load_model(build_tiny_model(family, family)).eval()
            ids = torch.tensor([[3, 4, 5, 6]])
            pos = torch.arange(4)[None]
            with torch.no_grad():
                logits = model.logits(ids, pos)
            assert logits.shape == (1, 4, model.args.vocab_size) and torch.isfinite(logits).all(), family
        """,
    ),
    "primerl-algos": (
        ["primerl_algos"],
        ["vllm", "primerl_models", "primerl_trainer"],
        """
        import numpy as np, torch
        from primerl_algos.advantages import grpo
        from primerl_algos.config import LossConfig
        from primerl_algos.losses import LossInputs, LossScale, compute_loss
        adv = grpo(np.array([1.0, 0.0, 1.0, 0.0], np.float32))
        assert np.allclose(adv.sum(), 0) and adv[0] > 0
        pi = torch.tensor([-1.0, -0.5, -2.0, -0.1, -0.3], requires_grad=True)
        x = LossInputs(logprobs=pi, inference_logprobs=pi.detach() - 0.1,
                       advantages=torch.tensor([1.0, 1.0, -1.0, -1.0, 0.5]),
                       loss_mask=torch.tensor([True, True, False, True, True]), seq_lens=torch.tensor([2, 3]))
        for kind in ("aipo", "cispo", "dppo", "gspo", "ppo"):
            loss, metrics = compute_loss(x, LossConfig(type=kind), LossScale(tokens=4, sequences=2))
            loss.backward()
            assert torch.isfinite(loss) and metrics["loss_tokens"] == 4, kind
        """,
    ),
    "primerl-envs": (
        [
            "primerl_envs",
            "primerl_chat",
            "primerl_reverse_text",
            "primerl_alphabet_sort",
            "primerl_math",
            "primerl_tool_use",
            "primerl_code",
            "primerl_shapes",
        ],
        ["torch", "vllm", "primerl_models", "primerl_trainer"],
        """
        import asyncio, types
        from primerl_envs.config import EnvConfig
        from primerl_envs.environment import Environment
        env = Environment(EnvConfig(id="reverse-text", args={"num_tasks": 3}))
        assert len(env.tasks) == 3
        task = env.tasks.next()
        assert task.data.answer == task.data.prompt_text[::-1]
        def score(reply):
            return asyncio.run(task.lcs(types.SimpleNamespace(last_reply=reply)))
        assert score(task.data.answer) == 1.0 and score("") == 0.0
        """,
    ),
    "primerl-inference": (
        ["primerl_inference"],
        ["torch", "vllm", "primerl_models", "primerl_trainer"],
        """
        from primerl_inference.config import InferenceConfig
        from primerl_inference.launcher import server_command
        spec = server_command(InferenceConfig(), "some/model", 512, 1, "run", device="cpu")
        assert spec.argv[1:3] == ["-m", "primerl_inference.serve"], spec.argv
        assert "--enforce-eager" in spec.argv and spec.env["PRIMERL_MODEL"] == "some/model"
        """,
    ),
    "primerl-orchestrator": (
        ["primerl_orchestrator"],
        ["vllm", "primerl_models", "primerl_trainer"],
        """
        from primerl_protocol.config import load_config
        from primerl_orchestrator.config import OrchRunConfig
        open("o.toml", "w").write(
            'seq_len = 512\\n[model]\\nname = "m"\\n[orchestrator]\\nbatch_size = 32\\ngroup_size = 8\\n'
            '[[envs.train]]\\nid = "reverse-text"\\n'
        )
        cfg = load_config(OrchRunConfig, ["@", "o.toml", "orchestrator.sampling.max_tokens=16"])
        assert (cfg.orchestrator.batch_size, cfg.orchestrator.sampling.max_tokens) == (32, 16)
        assert cfg.envs.train[0].id == "reverse-text"
        """,
    ),
    "primerl-trainer": (
        ["primerl_trainer"],
        ["vllm", "primerl_orchestrator", "primerl_envs", "primerl_inference"],
        """
        from primerl_protocol.config import load_config
        from primerl_trainer.config import TrainerRunConfig
        open("t.toml", "w").write(
            'seq_len = 256\\nmax_steps = 3\\n[model]\\nname = "m"\\n[trainer.optimizer]\\nlr = 3e-4\\n'
            '[trainer.loss]\\ntype = "gspo"\\n'
        )
        cfg = load_config(TrainerRunConfig, ["@", "t.toml", "trainer.scheduler.warmup_steps=2"])
        assert (cfg.trainer.optimizer.lr, cfg.trainer.loss.type, cfg.trainer.scheduler.warmup_steps) == (3e-4, "gspo", 2)
        """,
    ),
    "primerl": (
        ["primerl"],
        ["vllm"],
        """
        import subprocess, sys
        from pathlib import Path
        out = subprocess.run([str(Path(sys.executable).parent / "primerl"), "--help"], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        assert "rl" in out.stdout and "sft" in out.stdout, out.stdout
        """,
    ),
}


def test_every_package_has_a_case():
    assert sorted(CASES) == sorted(FOLDERS)
    members = {p.parent.name for p in ROOT.glob("packages/*/pyproject.toml")} | {"primerl"}
    assert members == set(FOLDERS)


@pytest.mark.slow  # installs: excluded by -m "not slow"
@pytest.mark.parametrize("name", list(CASES))
def test_package_installs_alone_and_runs(name, tmp_path, constraints):
    tops, absent, api = CASES[name]
    py = _install_alone(name, tmp_path, constraints)
    _run(py, IMPORT_ALL.format(tops=tops, absent=absent) + textwrap.dedent(api), tmp_path)  # one interpreter start


def _guarded(tree: ast.AST) -> set[int]:
    """ids of import nodes inside a `try` that catches ImportError (optional imports) or under
    `if TYPE_CHECKING:` (read by the type checker only, never run)."""
    guarded = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING":
            guarded |= {
                id(n) for stmt in node.body for n in ast.walk(stmt) if isinstance(n, (ast.Import, ast.ImportFrom))
            }
        if isinstance(node, ast.Try) and any(
            isinstance(h.type, ast.Name)
            and h.type.id in ("ImportError", "ModuleNotFoundError")
            or isinstance(h.type, ast.Tuple)
            and any(getattr(e, "id", "") in ("ImportError", "ModuleNotFoundError") for e in h.type.elts)
            for h in node.handlers
        ):
            guarded |= {
                id(n) for stmt in node.body for n in ast.walk(stmt) if isinstance(n, (ast.Import, ast.ImportFrom))
            }
    return guarded


def _imports(name: str) -> dict[str, str]:
    """Top-level modules the package's code imports unguarded -> a file that imports it."""
    src = FOLDERS[name] / "src"
    own = {p.name for p in src.iterdir()}
    found: dict[str, str] = {}
    for path in sorted(src.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        guarded = _guarded(tree)
        for node in ast.walk(tree):
            if id(node) in guarded:
                continue
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                mods = [node.module]
            else:
                continue
            for mod in mods:
                top = mod.split(".")[0]
                if top not in own and top not in sys.stdlib_module_names and top != "__future__":
                    found.setdefault(top, str(path.relative_to(ROOT)))
    return found


def _normal(dist: str) -> str:
    return dist.lower().replace("_", "-").replace(".", "-")


@cache
def _owners() -> dict[str, list[str]]:
    """Top-level module -> the distributions that provide it."""
    owners = {top: [_normal(d) for d in dists] for top, dists in importlib.metadata.packages_distributions().items()}
    for other in FOLDERS:  # workspace packages are editable here: map their modules by folder
        for top in (FOLDERS[other] / "src").iterdir():
            owners[top.name] = [other]
    return owners


# Modules that come with torch's CUDA wheels (torch depends on triton there) and are imported
# only on CUDA: the CPU install never has them.
WITH_CUDA_TORCH = {"triton"}
# Modules of GPU-only extras (optional-dependencies that the CPU install leaves out), by the
# distribution that provides them.
CUDA_EXTRAS = {"fla": ["fla-core"]}


@pytest.mark.parametrize("name", list(FOLDERS))
def test_package_declares_what_it_imports(name):
    """By the workspace venv's distributions (which hold the CPU install): every module the
    package imports belongs to a distribution its pyproject declares (dependencies or extras)."""
    project = _project(name)["project"]
    declared = {_requirement_name(r) for r in project.get("dependencies", [])}
    declared |= {_requirement_name(r) for reqs in project.get("optional-dependencies", {}).values() for r in reqs}
    owners = _owners()
    undeclared = {}
    for top, where in _imports(name).items():
        if top in WITH_CUDA_TORCH:
            continue
        dists = owners.get(top) or CUDA_EXTRAS.get(top)
        assert dists, f"{where} imports {top!r}, which no installed distribution provides"
        if not set(dists) & declared:
            undeclared[top] = f"{'/'.join(dists)} (imported in {where})"
    assert not undeclared, f"{name}'s pyproject.toml does not declare: {undeclared}"
