"""`primerl rl|sft|eval --slurm`: the rendered jobs, and the RL job run on a real Slurm.

The real cluster is Debian's Slurm on this host (infra/slurm/testing/cluster.sh: munged,
slurmctld and two slurmd "nodes"): the RL job puts inference on one node and the trainer and
orchestrator on the other, exactly as on a cluster, only both nodes are this machine.
"""

import json
import os
import re
import shutil
import string
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest
from click.testing import CliRunner
from primerl.cli import main
from primerl.configs import (
    EvalConfig,
    InferenceRunConfig,
    OrchRunConfig,
    PlanConfig,
    RLConfig,
    SFTConfig,
    TrainerRunConfig,
)
from primerl.slurm import SlurmError, fill, render_eval, render_rl, render_sft
from primerl.testing import leftovers
from primerl_inference.launcher import server_command
from primerl_models.tiny import build_tiny_model
from primerl_protocol.config import load_config
from primerl_trainer.testing import free_port_block

ROOT = Path(__file__).resolve().parents[3]
CLUSTER = ROOT / "infra" / "slurm" / "testing" / "cluster.sh"
PRIMERL = str(Path(sys.executable).parent / "primerl")


def rl_config(tmp_path, *overrides) -> RLConfig:
    path = tmp_path / "rl.toml"
    path.write_text('[model]\nname = "/shared/models/qwen3-8b"\n[[envs.train]]\nid = "reverse-text"\n')
    return load_config(RLConfig, ["@", str(path), f"run_dir={tmp_path / 'run'}", *overrides])


def bash_syntax_ok(script: Path) -> None:
    out = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_a_two_node_gpu_rl_job_is_laid_out_from_the_config(tmp_path):
    cfg = rl_config(
        tmp_path,
        "slurm.inference_nodes=1",
        "slurm.trainer_nodes=2",
        "slurm.gpus_per_node=8",
        "transport.trainer_ranks=16",
        "inference.num_replicas=4",
        "inference.tensor_parallel_size=2",
        "slurm.partition=gpu",
        "slurm.account=rl",
        "slurm.time=02:00:00",
        'slurm.sbatch_args=["--qos=high"]',
        'slurm.setup="module load cuda/12.8"',
    )
    script = render_rl(cfg)
    text = script.read_text()
    assert script == tmp_path / "run" / "slurm" / "rl.sbatch"
    for line in [
        "#SBATCH --nodes=3",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --partition=gpu",
        "#SBATCH --account=rl",
        "#SBATCH --time=02:00:00",
        "#SBATCH --qos=high",
        "#SBATCH --exclusive",
        f"#SBATCH --output={tmp_path / 'run' / 'slurm'}/job-%j.out",
    ]:
        assert line + "\n" in text, line
    # 4 servers of 2 GPUs on the inference node; 2 x 8 trainer ranks; the rendezvous on the first trainer node
    assert "i < 4; i++" in text and "--nnodes=2 --nproc-per-node=8" in text and "--gres=gpu:8" in text
    assert 'INFERENCE_NODES=("${NODES[@]:0:1}")' in text and 'TRAINER_NODES=("${NODES[@]:1:2}")' in text
    assert "{{" not in text
    bash_syntax_ok(script)
    configs = tmp_path / "run" / "configs"
    inference = (configs / "inference.toml").read_text()
    token = re.search(r'admin_token = "(\w+)"', inference).group(1)
    assert f'admin_token = "{token}"' in (configs / "orchestrator.toml").read_text()  # one token for the job
    for config in configs.glob("*.toml"):  # the token is readable by the run's owner only
        assert config.stat().st_mode & 0o777 == 0o600, config
    assert "trainer_ranks = 16" in (configs / "trainer.toml").read_text()
    # per-job CURVE keys: the same in the trainer's and the orchestrator's configs, new for each job
    roles = {"rl": RLConfig, "trainer": TrainerRunConfig, "orchestrator": OrchRunConfig}
    keys = [
        load_config(root, ["@", str(configs / f"{name}.toml")]).transport.sockets.curve for name, root in roles.items()
    ]
    assert keys[0] is not None and keys[0].server_secret and keys[0].client_secret and keys.count(keys[0]) == 3
    render_rl(cfg)
    assert load_config(RLConfig, ["@", str(configs / "rl.toml")]).transport.sockets.curve != keys[0]
    assert "module load cuda/12.8" in (tmp_path / "run" / "slurm" / "setup.sh").read_text()


def test_weights_in_memory_reach_the_jobs_servers_with_their_workers(tmp_path):
    """transport = "memory" under --slurm: the servers' URLs exist only in the job (their nodes'
    addresses), so the trainer gets them on its command line; each server's workers (its TP)
    are in the trainer's config; a folder job's trainer line is unchanged."""
    cfg = rl_config(
        tmp_path,
        "slurm.inference_nodes=1",
        "slurm.trainer_nodes=1",
        "slurm.gpus_per_node=8",
        "transport.trainer_ranks=8",
        "inference.num_replicas=4",
        "inference.tensor_parallel_size=2",
        "trainer.weights.transport=memory",
    )
    script = render_rl(cfg)
    text = script.read_text()
    assert 'transport.host="$ORCH_ADDR" "trainer.weights.servers=[${URL_LIST%,}]"\n' in text
    bash_syntax_ok(script)
    trainer = load_config(TrainerRunConfig, ["@", str(tmp_path / "run" / "configs" / "trainer.toml")])
    assert trainer.trainer.weights.transport == "memory" and trainer.trainer.weights.workers_per_server == 2
    token = load_config(RLConfig, ["@", str(tmp_path / "run" / "configs" / "rl.toml")]).inference.admin_token
    assert token and trainer.trainer.weights.admin_token == token  # the servers' token, for the trainer's joins
    text = render_rl(rl_config(tmp_path, "slurm.gpus_per_node=8", "transport.trainer_ranks=8")).read_text()
    assert 'transport.host="$ORCH_ADDR"\n' in text and "trainer.weights.servers" not in text


def test_unset_trainer_ranks_are_the_jobs_gpus_and_reach_the_orchestrator(tmp_path):
    """transport.trainer_ranks left out: the trainer nodes' GPUs, written into every role's config
    (the orchestrator packs for them; a trainer under torchrun would take them anyway)."""
    cfg = rl_config(tmp_path, "slurm.trainer_nodes=2", "slurm.gpus_per_node=8")
    assert cfg.transport.trainer_ranks is None
    assert "--nnodes=2 --nproc-per-node=8" in render_rl(cfg).read_text()
    configs = tmp_path / "run" / "configs"
    for name, root in {"trainer": TrainerRunConfig, "orchestrator": OrchRunConfig}.items():
        assert load_config(root, ["@", str(configs / f"{name}.toml")]).transport.trainer_ranks == 16, name


def test_colocated_roles_share_nodes(tmp_path):
    cfg = rl_config(
        tmp_path,
        "colocate=true",
        "slurm.inference_nodes=2",
        "slurm.trainer_nodes=2",
        "slurm.gpus_per_node=8",
        "transport.trainer_ranks=16",
        "inference.gpu_memory_utilization=0.4",  # set: no memory plan (its model folder is not here)
    )
    text = render_rl(cfg).read_text()
    assert "#SBATCH --nodes=2\n" in text and 'TRAINER_NODES=("${NODES[@]:0:2}")' in text
    assert "--nproc-per-node=8 " in text and "CUDA_VISIBLE_DEVICES" not in text  # every GPU, as without trainer_gpus


MOE = ROOT / "examples" / "models" / "qwen3-30b-a3b"  # its config.json: the memory plan's shape, no weights


def role_config(tmp_path, root, name):
    return load_config(root, ["@", str(tmp_path / "run" / "configs" / f"{name}.toml")])


def vllm_commands(tmp_path) -> list:
    """The vLLM servers the job's inference role starts on each node, from its rendered config."""
    cfg = role_config(tmp_path, InferenceRunConfig, "inference")
    return [
        server_command(cfg.inference, "m", 4096, i, tmp_path / "run", device="cuda")
        for i in range(cfg.inference.num_replicas)
    ]


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_one_node_split_between_trainer_and_inference(tmp_path):
    """Qwen3-30B-A3B on one 8-GPU node as 4 + 4: trainer_gpus = [4, 5, 6, 7] puts torchrun's 4
    ranks on those GPUs and the 4 servers on GPUs 0-3 of the same node; one node in the job, the
    servers at vLLM's 0.9 (they own their GPUs)."""
    cfg = rl_config(
        tmp_path,
        "trainer_gpus=[4, 5, 6, 7]",
        "slurm.inference_nodes=1",
        "slurm.trainer_nodes=1",
        "slurm.gpus_per_node=8",
        "inference.num_replicas=4",
    )
    script = render_rl(cfg)
    text = script.read_text()
    assert "#SBATCH --nodes=1\n" in text and "#SBATCH --gpus-per-node=8\n" in text
    assert 'INFERENCE_NODES=("${NODES[@]:0:1}")' in text and 'TRAINER_NODES=("${NODES[@]:0:1}")' in text
    assert (
        "-- \\\n    env CUDA_VISIBLE_DEVICES=4,5,6,7 python -m torch.distributed.run --nnodes=1 --nproc-per-node=4 "
        in text
    )
    assert text.count("--gres=gpu:8") == 2  # each step sees the node's 8 GPUs: the indices are the node's
    assert "inference on GPUs 0,1,2,3, trainer on GPUs 4,5,6,7" in text and "{{" not in text
    bash_syntax_ok(script)
    assert role_config(tmp_path, TrainerRunConfig, "trainer").transport.trainer_ranks == 4
    assert role_config(tmp_path, OrchRunConfig, "orchestrator").transport.trainer_ranks == 4
    servers = vllm_commands(tmp_path)
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in servers] == ["0", "1", "2", "3"]
    assert all(flag(s.argv, "--gpu-memory-utilization") == "0.9" for s in servers)
    # two servers of tensor parallelism 2 on the same GPUs; without trainer_gpus, nodes of their own as before
    render_rl(
        rl_config(tmp_path, "trainer_gpus=[4, 5, 6, 7]", "inference.num_replicas=2", "inference.tensor_parallel_size=2")
    )
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in vllm_commands(tmp_path)] == ["0,1", "2,3"]
    # the trainer first, or every other GPU: the servers get the rest, whichever they are
    text = render_rl(rl_config(tmp_path, "trainer_gpus=[0, 2, 4, 6]", "inference.num_replicas=4")).read_text()
    assert "env CUDA_VISIBLE_DEVICES=0,2,4,6 python" in text
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in vllm_commands(tmp_path)] == ["1", "3", "5", "7"]
    text = render_rl(rl_config(tmp_path, "transport.trainer_ranks=8")).read_text()
    assert "#SBATCH --nodes=2\n" in text and 'TRAINER_NODES=("${NODES[@]:1:1}")' in text
    assert "-- \\\n    python -m torch.distributed.run --nnodes=1 --nproc-per-node=8 " in text
    assert role_config(tmp_path, InferenceRunConfig, "inference").inference.gpus is None


def test_the_servers_may_take_exactly_the_gpus_the_trainer_leaves(tmp_path):
    """Boundaries of a split node: servers needing every GPU left, the trainer on the node's last
    GPU and transport.trainer_ranks equal to the job's: rendered; one GPU more, refused (exit 2
    through the CLI, naming the keys)."""
    exact = ["trainer_gpus=[6, 7]", "inference.num_replicas=3", "inference.tensor_parallel_size=2"]
    render_rl(rl_config(tmp_path, *exact, "transport.trainer_ranks=2"))
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in vllm_commands(tmp_path)] == ["0,1", "2,3", "4,5"]
    over = ["trainer_gpus=[5, 6, 7]", "inference.num_replicas=3", "inference.tensor_parallel_size=2"]
    message = (
        "inference.num_replicas x GPUs per replica = 3 x 2 = 6 GPUs per node, but trainer_gpus = [5, 6, 7] leaves 5 "
        "of slurm.gpus_per_node = 8 to the servers"
    )
    with pytest.raises(SlurmError, match=re.escape(message)):
        render_rl(rl_config(tmp_path, *over))
    (tmp_path / "rl.toml").write_text(f'[model]\nname = "{MOE}"\n[[envs.train]]\nid = "reverse-text"\n')
    out = CliRunner().invoke(  # plan.check = false: where a GPU is visible the memory plan would speak first
        main,
        ["rl", "@", str(tmp_path / "rl.toml"), f"run_dir={tmp_path / 'cli'}", *over, "plan.check=false", "--slurm"],
    )
    assert out.exit_code == 2 and message in out.output, out.output
    assert not (tmp_path / "cli" / "slurm" / "rl.sbatch").exists()


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["trainer_gpus=[4, 8]"],
            "trainer_gpus = [4, 8] names GPU 8, but slurm.gpus_per_node = 8: a node's GPUs are 0 to 7",
        ),
        (["trainer_gpus=[-1]"], "trainer_gpus = [-1] names GPU -1"),
        (["trainer_gpus=[4, 5, 4]"], "trainer_gpus = [4, 5, 4] names GPU 4 more than once"),
        (["trainer_gpus=[]"], "trainer_gpus = []: list the GPUs"),
        (
            ["trainer_gpus=[4, 5, 6, 7]", "transport.trainer_ranks=8"],
            "transport.trainer_ranks = 8, but slurm.trainer_nodes x len(trainer_gpus) = 1 x 4 = 4",
        ),
        (
            ["trainer_gpus=[4, 5, 6, 7]", "slurm.trainer_nodes=2", "transport.trainer_ranks=4"],
            "transport.trainer_ranks = 4, but slurm.trainer_nodes x len(trainer_gpus) = 2 x 4 = 8",
        ),
        (
            ["trainer_gpus=[4, 5, 6, 7]", "colocate=true", "transport.trainer_ranks=8"],
            "transport.trainer_ranks = 8, but slurm.trainer_nodes x len(trainer_gpus) = 1 x 4 = 4",
        ),
        (
            ["trainer_gpus=[4, 5, 6, 7]", "inference.gpus=[3, 4]"],
            "inference.gpus = [3, 4] and trainer_gpus = [4, 5, 6, 7] both name GPU 4",
        ),
        (["inference.gpus=[8]", "transport.trainer_ranks=8"], "inference.gpus = [8] names GPU 8"),
    ],
)
def test_trainer_gpus_that_do_not_fit_a_node_are_named(tmp_path, overrides, message):
    with pytest.raises(SlurmError, match=re.escape(message)):
        render_rl(rl_config(tmp_path, "slurm.gpus_per_node=8", *overrides))


def moe_config(tmp_path, *overrides) -> RLConfig:
    """Qwen3-30B-A3B on 80 GiB GPUs, 4 trainer ranks a node (GPUs 4-7) with their optimizer
    states on the host: a trainer peak of a few GiB a rank, beside vLLM on the same GPUs."""
    return rl_config(
        tmp_path,
        f"model.name={MOE}",
        "seq_len=4096",
        "trainer.parallel.ep=4",
        "trainer.activation_checkpointing=true",
        "trainer.optimizer.cpu_offload=true",
        "transport.trainer_ranks=4",
        "trainer_gpus=[4, 5, 6, 7]",
        "plan.gpu_memory_gib=80",
        *overrides,
    )


def test_colocated_trainer_gets_trainer_gpus_and_vllm_the_share_the_plan_leaves(tmp_path):
    """colocate = true with trainer_gpus: 8 servers on the node's 8 GPUs, torchrun's 4 ranks on
    GPUs 4-7 of them, one node; vLLM's gpu_memory_utilization unset comes from the memory plan
    (0.95 of the GPU less the trainer's peak and vLLM's CUDA graphs, rounded down to 0.01), and
    every server's command carries it; a set value is kept."""
    from primerl.plan import TRAINER_HEADROOM, plan_for_launch, trainer_layout
    from primerl_inference.plan import CUDA_GRAPHS_GIB, GIB
    from primerl_trainer.plan import trainer_memory

    cfg = moe_config(tmp_path, "colocate=true", "inference.num_replicas=8")
    text = render_rl(cfg).read_text()
    assert "#SBATCH --nodes=1\n" in text and 'TRAINER_NODES=("${NODES[@]:0:1}")' in text
    assert "env CUDA_VISIBLE_DEVICES=4,5,6,7 python -m torch.distributed.run --nnodes=1 --nproc-per-node=4 " in text
    servers = vllm_commands(tmp_path)
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in servers] == [str(g) for g in range(8)]
    # by hand, from the plan's figure: the trainer's predicted peak per rank
    plan = plan_for_launch(cfg, slurm=True)
    peak = trainer_memory(plan_args(), trainer_layout(cfg, 4)).peak
    assert plan is not None and plan.trainer is not None and plan.trainer.memory.peak == peak
    total = 80 * GIB
    expected = int((TRAINER_HEADROOM * total - peak - CUDA_GRAPHS_GIB * GIB) / total * 100) / 100
    assert 0.5 < expected < 0.9, expected
    written = role_config(tmp_path, InferenceRunConfig, "inference").inference.gpu_memory_utilization
    assert written == expected and f"gpu_memory_utilization {expected}" in text
    assert all(flag(s.argv, "--gpu-memory-utilization") == str(expected) for s in servers)
    assert plan.trainer.fits and plan.trainer.share >= peak  # the trainer's share holds its peak
    render_rl(moe_config(tmp_path, "colocate=true", "inference.gpu_memory_utilization=0.8"))
    assert all(flag(s.argv, "--gpu-memory-utilization") == "0.8" for s in vllm_commands(tmp_path))
    assert "--nproc-per-node=4 " in (tmp_path / "run" / "slurm" / "rl.sbatch").read_text()


def plan_args():
    from primerl.plan import model_args

    return model_args(str(MOE))[0]


def test_a_colocated_share_that_cannot_be_computed_is_refused_naming_the_keys(tmp_path):
    """Colocated, vLLM's share needs the GPU's memory and a trainer that leaves some of it: a
    trainer whose peak (its AdamW states on the GPU) exceeds the GPU leaves vLLM nothing; a
    login node without a GPU and no plan.gpu_memory_gib knows no memory. Both name the keys."""
    from primerl.errors import CheckError

    with pytest.raises(CheckError, match=r"leaves vLLM no share of its GPU; .* inference.gpu_memory_utilization"):
        render_rl(moe_config(tmp_path, "colocate=true", "trainer.optimizer.cpu_offload=false"))
    if shutil.which("nvidia-smi"):
        return  # the GPU here gives the memory
    unknown = msgspec.structs.replace(moe_config(tmp_path, "colocate=true"), plan=PlanConfig(gpu_memory_gib=None))
    with pytest.raises(CheckError, match=r"set plan.gpu_memory_gib .*, or inference.gpu_memory_utilization"):
        render_rl(unknown)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["slurm.trainer_nodes=2", "slurm.gpus_per_node=8", "transport.trainer_ranks=12"],
            "transport.trainer_ranks = 12, but slurm.trainer_nodes x slurm.gpus_per_node = 2 x 8 = 16",
        ),
        (
            [
                "slurm.gpus_per_node=8",
                "transport.trainer_ranks=8",
                "inference.num_replicas=8",
                "inference.tensor_parallel_size=2",
            ],
            "inference.num_replicas x GPUs per replica = 8 x 2",
        ),
        (
            ["slurm.gpus_per_node=0", "slurm.trainer_nodes=2", "transport.trainer_ranks=3"],
            "transport.trainer_ranks = 3 does not split evenly over slurm.trainer_nodes = 2",
        ),
        (["slurm.inference_nodes=0"], "slurm.inference_nodes must be at least 1"),
    ],
)
def test_layouts_that_do_not_fit_are_named(tmp_path, overrides, message):
    with pytest.raises(SlurmError, match=re.escape(message)):
        render_rl(rl_config(tmp_path, *overrides))


def test_sft_and_eval_jobs(tmp_path):
    (tmp_path / "d.jsonl").write_text("")
    sft = load_config(
        SFTConfig,
        [
            "data.path=d.jsonl",
            "model.name=m",
            f"run_dir={tmp_path / 'sft'}",
            "slurm.trainer_nodes=4",
            "slurm.gpus_per_node=8",
            "transport.trainer_ranks=32",
        ],
    )
    text = render_sft(sft).read_text()
    assert "#SBATCH --nodes=4\n" in text and "--nnodes=4 --nproc-per-node=8" in text and "primerl.sft_entry" in text
    bash_syntax_ok(tmp_path / "sft" / "slurm" / "sft.sbatch")
    ev = load_config(
        EvalConfig,
        [
            "model.name=m",
            f"run_dir={tmp_path / 'ev'}",
            "slurm.inference_nodes=2",
            "inference.num_replicas=8",
            'envs.eval=[{id = "reverse-text"}]',
        ],
    )
    text = render_eval(ev).read_text()
    assert "#SBATCH --nodes=2\n" in text and "i < 8; i++" in text and "primerl eval @" in text
    bash_syntax_ok(tmp_path / "ev" / "slurm" / "eval.sbatch")


def test_a_placeholder_without_a_value_is_an_error():
    with pytest.raises(SlurmError, match=r"\['nodes'\]"):
        fill("#SBATCH --nodes={{nodes}}", {})


# --- on a real Slurm -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A two-node Slurm cluster on this host; yields the environment its clients need."""
    if not shutil.which("slurmd") or not shutil.which("sbatch"):
        pytest.skip("Slurm is not installed: infra/slurm/testing/cluster.sh install (CI's .ci/run does)")
    folder = tmp_path_factory.mktemp("slurm")
    out = subprocess.run(["bash", str(CLUSTER), "up", "2", str(folder)], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    env = {**os.environ, "SLURM_CONF": str(folder / "slurm.conf")}
    yield env
    subprocess.run(["bash", str(CLUSTER), "down", str(folder)], capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_model(
        tmp_path_factory.mktemp("model"),
        "qwen3",
        alphabet=string.ascii_lowercase,
        hidden_size=128,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=64,
    )


def render_tiny_rl_job(model: Path, run_dir: Path, env: dict, submit: bool, *extra: str) -> subprocess.CompletedProcess:
    port = free_port_block(3)
    args = [
        PRIMERL,
        "rl",
        "@",
        str(ROOT / "examples" / "reverse_text" / "rl.toml"),
        f"model.name={model}",
        f"run_dir={run_dir}",
        "max_steps=3",
        "orchestrator.batch_size=32",
        "slurm.gpus_per_node=0",
        "slurm.exclusive=false",
        "slurm.time=00:20:00",
        f"inference.port={free_port_block(1)}",
        f"transport.policy_port={port}",
        f"transport.batch_port={port + 1}",
        f"slurm.rendezvous_port={port + 2}",
        *extra,
        "--slurm",
        *(["--submit"] if submit else []),
    ]
    out = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    return out


def wait_for_job(job: str, env: dict, timeout_s: float = 900) -> tuple[str, str]:
    """(JobState, ExitCode) once the job has ended."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        info = subprocess.run(["scontrol", "-o", "show", "job", job], capture_output=True, text=True, env=env).stdout
        state = re.search(r"JobState=(\w+)", info).group(1)
        if state not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING"):
            return state, re.search(r"ExitCode=(\S+)", info).group(1)
        time.sleep(2)
    subprocess.run(["scancel", job], env=env)
    raise AssertionError(f"job {job} still {state} after {timeout_s}s")


def settled(*paths: Path, timeout_s: float = 30) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while (left := leftovers(*paths)) and time.monotonic() < deadline:
        time.sleep(1)
    return left


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["folder", "memory"])
def test_the_rl_job_runs_on_a_real_slurm_cluster(slurm, model, tmp_path, transport):
    """With weights in memory, the trainer's rank 0 (on the trainer node) streams each step to
    the server on the inference node, which joined its group through the job's admin token;
    the one folder is the last step's. Without the stream the orchestrator would have no
    server serving steps 1 and 2 (no folder for them) and the job would not finish."""
    run_dir = tmp_path / "run"
    out = render_tiny_rl_job(model, run_dir, slurm, True, f"trainer.weights.transport={transport}")
    job = re.search(r"submitted job (\d+)", out.stdout).group(1)
    state, code = wait_for_job(job, slurm)
    output = (run_dir / "slurm" / f"job-{job}.out").read_text()
    assert (state, code) == ("COMPLETED", "0:0"), output
    assert "inference on n1, trainer on n2, orchestrator on n2" in output and "run finished" in output
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(0 <= r["reward/mean"] <= 1 and r["rollouts/count"] == 32 for r in rows)
    assert (run_dir / "weights" / "step_2").is_dir()
    if transport == "memory":
        assert not (run_dir / "weights" / "step_1").exists()  # steps 0 and 1 went in memory only
        assert all(r["weights/failed"] == 0 and r["weights/strangers"] == 0 for r in rows), rows
    assert not settled(run_dir, model)


@pytest.mark.slow
def test_a_failing_role_fails_the_job_naming_it_and_leaves_nothing_running(slurm, model, tmp_path):
    run_dir = tmp_path / "run"
    render_tiny_rl_job(model, run_dir, slurm, submit=False)
    # the trainer alone gets a model that does not exist: it fails once the servers are up
    trainer_cfg = run_dir / "configs" / "trainer.toml"
    trainer_cfg.write_text(trainer_cfg.read_text().replace(f'name = "{model}"', f'name = "{tmp_path / "gone"}"'))
    job = subprocess.run(
        ["sbatch", "--parsable", str(run_dir / "slurm" / "rl.sbatch")],
        capture_output=True,
        text=True,
        env=slurm,
        check=True,
    ).stdout.strip()
    state, code = wait_for_job(job, slurm)
    output = (run_dir / "slurm" / f"job-{job}.out").read_text()
    assert (state, code) == ("FAILED", "1:0"), output
    assert f"role trainer failed with exit code 1; log: {run_dir}/slurm/trainer.log" in output
    assert f"cannot load model '{tmp_path / 'gone'}'" in output  # its last log lines, in the job's output
    assert "stopping every other role" in output
    assert not settled(run_dir, model)  # the inference server and the orchestrator were stopped too


@pytest.mark.slow
def test_the_sft_job_trains_over_two_nodes(slurm, model, tmp_path):
    """torchrun's c10d rendezvous across the two nodes: one gloo rank on each."""
    data = tmp_path / "data.jsonl"
    data.write_text(
        "".join(
            json.dumps({"prompt": w, "completion": w[::-1]}) + "\n"
            for w in ["abc", "hello", "slurm", "primerl", "zyx", "queue"] * 8
        )
    )
    run_dir = tmp_path / "sft"
    out = subprocess.run(
        [
            PRIMERL,
            "sft",
            "@",
            str(ROOT / "examples" / "reverse_text" / "sft.toml"),
            f"model.name={model}",
            f"run_dir={run_dir}",
            f"data.path={data}",
            "max_steps=3",
            "data.batch_size=16",
            "transport.trainer_ranks=2",
            "slurm.trainer_nodes=2",
            "slurm.gpus_per_node=0",
            "slurm.exclusive=false",
            "slurm.time=00:10:00",
            f"slurm.rendezvous_port={free_port_block(1)}",
            "--slurm",
            "--submit",
        ],
        capture_output=True,
        text=True,
        env=slurm,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    job = re.search(r"submitted job (\d+)", out.stdout).group(1)
    state, code = wait_for_job(job, slurm, timeout_s=600)
    output = (run_dir / "slurm" / f"job-{job}.out").read_text()
    assert (state, code) == ("COMPLETED", "0:0"), output + (run_dir / "slurm" / "sft.log").read_text()[-3000:]
    assert [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2]
    meta = json.loads((run_dir / "checkpoints" / "step_2" / "meta.json").read_text())
    assert meta["world_size"] == 2  # a rank on each node
    assert not settled(run_dir)
