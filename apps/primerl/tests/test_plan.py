"""`primerl plan` and the check before a launch: Qwen3-30B-A3B's shape (its config.json in
examples/models, no weights needed) on a node of 80 GiB GPUs. Four trainer ranks cannot hold
its fp32 weights, gradients and AdamW states (16 B x 30.5B / 4 = 114 GiB a rank): the plan
refuses it naming the keys that make it fit, and one of them does; `primerl rl --slurm` refuses
it before writing the job, or writes it with a warning under plan.check = false. The
arithmetic is tested by hand in primerl-trainer's and primerl-inference's test_plan.py."""

from pathlib import Path

import pytest
from click.testing import CliRunner
from primerl.cli import main

ROOT = Path(__file__).resolve().parents[3]
MODEL = ROOT / "examples" / "models" / "qwen3-30b-a3b"


def config(tmp_path: Path) -> Path:
    path = tmp_path / "rl.toml"
    path.write_text(f"""
seq_len = 16384
run_dir = "{tmp_path / "run"}"
[model]
name = "{MODEL}"
[transport]
trainer_ranks = 4
[trainer]
activation_checkpointing = true
[trainer.parallel]
ep = 4
[inference]
num_replicas = 4
device = "cuda"
[plan]
gpu_memory_gib = 80
[[envs.train]]
id = "reverse-text"
""")
    return path


def test_a_layout_that_cannot_fit_is_refused_naming_the_keys_and_the_one_named_fits(tmp_path):
    cfg = str(config(tmp_path))
    out = CliRunner().invoke(main, ["plan", "@", cfg])
    assert out.exit_code == 2, out.output
    assert "DOES NOT FIT" in out.output and "30.53B parameters" in out.output
    assert "layouts that fit: trainer.optimizer.cpu_offload = true" in out.output
    ok = CliRunner().invoke(main, ["plan", "@", cfg, "trainer.optimizer.cpu_offload=true"])
    assert ok.exit_code == 0, ok.output
    assert "DOES NOT FIT" not in ok.output and ok.output.count(": fits") == 1 and "\n  fits" in ok.output
    # on a CPU run there is no GPU memory to plan
    cpu = CliRunner().invoke(main, ["plan", "@", cfg, "inference.device=cpu"])
    assert cpu.exit_code == 0 and "no GPU memory to plan" in cpu.output


def test_the_slurm_job_is_refused_before_it_is_written_unless_the_check_is_off(tmp_path):
    cfg = str(config(tmp_path))
    job = ["rl", "@", cfg, "--slurm", "slurm.gpus_per_node=4", "slurm.trainer_nodes=1", "slurm.inference_nodes=1"]
    script = tmp_path / "run" / "slurm" / "rl.sbatch"
    out = CliRunner().invoke(main, job)
    assert out.exit_code == 2 and "the run does not fit its GPUs" in out.output, out.output
    assert not script.exists()
    out = CliRunner().invoke(main, [*job, "plan.check=false"])
    assert out.exit_code == 0, out.output
    assert "warning: the run may not fit its GPUs" in out.output and script.exists()


def test_a_malformed_config_json_is_refused_naming_what_is_missing(tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text('{"model_type": "qwen3_moe", "hidden_size": 64}')
    out = CliRunner().invoke(main, ["plan", "@", str(config(tmp_path)), f"model.name={bad}"])
    assert out.exit_code == 2 and "config.json: KeyError: 'num_attention_heads'" in out.output, out.output


def one_machine(tmp_path: Path, *overrides: str):
    """`primerl rl`'s preparation on one machine of 8 80-GiB GPUs (no GPU needed: the plan's
    memory is plan.gpu_memory_gib, nothing starts), Qwen3-30B-A3B's 4 trainer ranks with their
    optimizer states on the host, 4 servers. Returns the prepared config."""
    from primerl.configs import RLConfig
    from primerl.launch import prepare
    from primerl_protocol.config import load_config

    args = [
        "@",
        str(config(tmp_path)),
        "seq_len=4096",
        "trainer.optimizer.cpu_offload=true",
        f"run_dir={tmp_path / 'one'}",
        *overrides,
    ]
    return prepare(load_config(RLConfig, args))[0]


def vllm_utilization(cfg) -> str:
    from primerl_inference.launcher import server_command

    argv = server_command(cfg.inference, cfg.model.name, cfg.seq_len, 0, cfg.run_dir, device="cuda").argv
    return argv[argv.index("--gpu-memory-utilization") + 1]


def test_vllms_share_beside_a_colocated_trainer_comes_from_the_plan(tmp_path):
    """inference.gpu_memory_utilization unset and colocate = true (the trainer on GPUs 0-3, the
    servers' own): the share the plan leaves, by hand from its figure of the trainer's peak
    (0.95 of the GPU less the peak and vLLM's ~1 GiB of CUDA graphs, rounded down to 0.01),
    written into configs/rl.toml and on the command line the servers start with. Servers on
    GPUs of their own: 0.9. Set: kept. A CPU run: untouched (vLLM's CPU server has no share)."""
    from primerl.plan import TRAINER_HEADROOM, model_args, trainer_layout
    from primerl_inference.plan import CUDA_GRAPHS_GIB, GIB
    from primerl_trainer.plan import trainer_memory

    cfg = one_machine(tmp_path, "colocate=true", "trainer_gpus=[0, 1, 2, 3]")
    peak = trainer_memory(model_args(str(MODEL))[0], trainer_layout(cfg, 4)).peak
    total = 80 * GIB
    expected = int((TRAINER_HEADROOM * total - peak - CUDA_GRAPHS_GIB * GIB) / total * 100) / 100
    assert 0.5 < expected < 0.9 and cfg.inference.gpu_memory_utilization == expected, (expected, peak / GIB)
    assert vllm_utilization(cfg) == str(expected)
    assert f"gpu_memory_utilization = {expected}\n" in (tmp_path / "one" / "configs" / "rl.toml").read_text()

    assert vllm_utilization(one_machine(tmp_path, "trainer_gpus=[4, 5, 6, 7]")) == "0.9"
    kept = one_machine(tmp_path, "colocate=true", "inference.gpu_memory_utilization=0.8")
    assert kept.inference.gpu_memory_utilization == 0.8 and vllm_utilization(kept) == "0.8"
    cpu = one_machine(tmp_path, "inference.device=cpu")
    assert cpu.inference.gpu_memory_utilization is None


def test_a_colocated_share_set_too_high_is_refused_by_the_plan(tmp_path):
    """A set share is the user's: the plan still refuses it when the trainer no longer fits
    beside it (0.9 of 80 GiB and vLLM's graphs leave a trainer rank 3 GiB)."""
    from primerl.errors import CheckError

    with pytest.raises(CheckError, match=r"a trainer rank needs \d+\.\d GiB at its peak and has 3\.0"):
        one_machine(tmp_path, "colocate=true", "inference.gpu_memory_utilization=0.9")
