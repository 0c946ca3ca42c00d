"""`primerl plan` and the check before a launch: Qwen3-30B-A3B's shape (its config.json in
examples/models, no weights needed) on a node of 80 GiB GPUs. Four trainer ranks cannot hold
its fp32 weights, gradients and AdamW states (16 B x 30.5B / 4 = 114 GiB a rank): the plan
refuses it naming the keys that make it fit, and one of them does; `primerl rl --slurm` refuses
it before writing the job, or writes it with a warning under plan.check = false. The
arithmetic is tested by hand in primerl-trainer's and primerl-inference's test_plan.py."""

from pathlib import Path

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
