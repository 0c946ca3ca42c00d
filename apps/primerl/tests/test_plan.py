"""`primerl plan` and the check before a launch: Qwen3-30B-A3B's shape (its config.json in
examples/models, no weights needed) on a node of 80 GiB GPUs and 2 TiB of host memory. Four trainer ranks cannot hold
its fp32 weights, gradients and AdamW states (16 B x 30.5B / 4 = 114 GiB a rank): the plan
refuses it naming the keys that make it fit, and one of them does; `primerl rl --slurm` refuses
it before writing the job, or writes it with a warning under plan.check = false. The
arithmetic is tested by hand in primerl-trainer's and primerl-inference's test_plan.py."""

from pathlib import Path

import pytest
from click.testing import CliRunner
from primerl.cli import main
from primerl_models.args import Attention, DenseMLP, Layer, ModelArgs, Rope

ROOT = Path(__file__).resolve().parents[3]
MODEL = ROOT / "examples" / "models" / "qwen3-30b-a3b"


def config(tmp_path: Path, host_memory_gib: float | None = 2048) -> Path:
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
{"" if host_memory_gib is None else f"host_memory_gib = {host_memory_gib}"}
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
    assert "DOES NOT FIT" not in ok.output and ok.output.count(": fits") == 2 and "\n  fits" in ok.output
    assert (
        "host: 4 rank(s) a node x 113.7 GiB = 455.0 GiB of 1843.2 (0.9 of 2048.0 GiB" in ok.output
    )  # its GPU and host lines
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


def tiny_dense() -> ModelArgs:
    """primerl-trainer's test_plan.py's Qwen3-like: q/k norms, tied embeddings, 2 layers."""
    attn = Attention(num_heads=4, num_kv_heads=2, head_dim=16, rope=Rope(rotary_dim=16), qk_norm="head")
    return ModelArgs(
        "qwen3", vocab_size=1000, hidden_size=64, layers=[Layer(attn, DenseMLP(128))] * 2, tie_embeddings=True
    )


def test_the_host_memory_of_a_nodes_offloading_ranks_fits_exactly_at_the_boundary(tmp_path):
    """4 trainer ranks, 2 a node, trainer.optimizer.cpu_offload: each rank keeps 16 B x N / 4 on
    the host (fp32 weights 4, gradients 4, AdamW's moments 8), a node 2 x 4 N = 8 N bytes. A node
    whose HOST_HEADROOM is exactly that fits; a little less memory is refused, naming the keys
    to change, and the layout that fits GPU and host (no offload: these GPUs hold the states)."""
    from primerl.configs import RLConfig
    from primerl.plan import GIB, HOST_HEADROOM, plan_rl
    from primerl_protocol.config import load_config

    args = tiny_dense()
    d, v, h, g, k, f = 64, 1000, 4, 2, 16, 128
    n = 2 * (d * h * k * 2 + d * g * k * 2 + 2 * k + 3 * d * f + 2 * d) + v * d + d
    assert args.num_params() == n == 138_112
    overrides = ["transport.trainer_ranks=4", "trainer.parallel.ep=1", "trainer.optimizer.cpu_offload=true"]
    cfg = load_config(RLConfig, ["@", str(config(tmp_path)), "seq_len=4096", *overrides])
    need = 2 * 16 * n / 4
    exact = need / GIB / HOST_HEADROOM
    assert exact * GIB * HOST_HEADROOM == need  # the boundary itself, not a rounding of it

    def plan(host_gib: float):
        return plan_rl(cfg, args, 80, host_gib=host_gib, host_source="plan.host_memory_gib", node_ranks=2)

    fits = plan(exact)
    assert fits.host is not None and fits.host.need == need and fits.host.fits and fits.refusal() is None
    assert "host: 2 rank(s) a node x " in fits.render() and "GiB, plan.host_memory_gib): fits" in fits.render()
    short = plan(exact * (1 - 1e-9))
    assert short.host is not None and not short.host.fits and short.trainer is not None and short.trainer.fits
    why = short.refusal() or ""
    assert "the trainer's 2 rank(s) on a node keep 0.0 GiB in host memory" in why, why
    for key in ("plan.host_memory_gib", "trainer.optimizer.cpu_offload = false", "slurm.trainer_nodes"):
        assert key in why, (key, why)
    assert "layouts that fit GPU and host: trainer.optimizer.cpu_offload = false" in why, why
    assert short.trainer_options and not any(o.layout.cpu_offload for _, o in short.trainer_options)  # none offload
    assert "DOES NOT FIT" in short.render()


def test_a_launch_whose_offloaded_states_exceed_the_nodes_memory_is_refused(tmp_path):
    """One machine of 400 GiB: Qwen3-30B-A3B's 4 offloading ranks keep 16 B x 30.53B = 455 GiB
    there, more than 0.9 x 400: `primerl rl` refuses it before anything starts."""
    from primerl.errors import CheckError

    with pytest.raises(CheckError, match=r"does not fit its GPUs or host memory .* keep 455\.0 GiB in host memory"):
        one_machine(tmp_path, "plan.host_memory_gib=400")


def test_the_nodes_memory_is_this_machines_here_and_unchecked_under_slurm_without_the_key(tmp_path, monkeypatch):
    """Without plan.host_memory_gib: a run here is checked against /proc/meminfo's MemTotal (a
    machine of 400 GiB: refused; of 600: fits), a Slurm job's nodes are not (the plan says so)."""
    import primerl.plan

    cfg = str(config(tmp_path, host_memory_gib=None))
    offload = ["trainer.optimizer.cpu_offload=true", "seq_len=4096"]
    meminfo = Path("/proc/meminfo").read_text().split("MemTotal:")[1].split()[0]
    assert primerl.plan.machine_memory_gib() == int(meminfo) / 1024**2
    for gib, code in ((400.0, 2), (600.0, 0)):
        monkeypatch.setattr(primerl.plan, "machine_memory_gib", lambda gib=gib: gib)
        out = CliRunner().invoke(main, ["plan", "@", cfg, *offload])
        assert out.exit_code == code and f"(0.9 of {gib:.1f} GiB, this machine's MemTotal)" in out.output, out.output
    job = ["slurm.gpus_per_node=8", "slurm.trainer_nodes=1", "slurm.inference_nodes=1"]
    out = CliRunner().invoke(main, ["plan", "@", cfg, *offload, *job, "--slurm"])
    assert out.exit_code == 0, out.output
    assert "the node's memory unknown (--slurm without plan.host_memory_gib): not checked" in out.output


def test_the_plan_counts_kept_logits_only_where_the_loss_is_not_computed_in_the_forward(tmp_path):
    """trainer.keep_logits holds every token's logits (2 T V bytes) only on the logprobs'
    backward: with trainer.loss_in_forward (the default) a token-local loss (aipo) on rows not
    split by CP keeps none, so the plan must not count them; GSPO, CP = 2 or loss_in_forward
    off keep them."""
    from primerl.configs import RLConfig
    from primerl.plan import trainer_layout
    from primerl_protocol.config import load_config

    def kept(*overrides: str) -> bool:
        args = ["@", str(config(tmp_path)), "trainer.keep_logits=true", *overrides]
        return trainer_layout(load_config(RLConfig, args), 4).keep_logits

    assert not kept()
    assert kept("trainer.loss_in_forward=false")
    assert kept("trainer.loss.type=gspo")
    assert kept("trainer.parallel.cp=2", "trainer.parallel.ep=2")
    assert not kept("trainer.keep_logits=false", "trainer.loss_in_forward=false")
