"""What `primerl rl` checks before anything starts: environments loaded (import, arguments, one
task), the run directory's path, the ports. Each mistake exits 2 (as a config error) within
seconds, naming the key, with nothing started and nothing written; unset ports are chosen free
and written into the run's configs. No vLLM but in one test: the checks run before any server
would start, except on CPU with a model vLLM can load (their stand-ins have no weights), where the
servers start while the slower checks run and a refusal stops them."""

import json
import socket
import tomllib
from pathlib import Path

import pytest
from click.testing import CliRunner
from primerl.cli import main
from primerl.configs import RLConfig
from primerl.testing import leftovers
from primerl_protocol.config import load_config
from primerl_trainer.testing import free_port_block

EXIT_CONFIG = 2


def write_config(tmp_path: Path, body: str = "", env: str = 'id = "reverse-text"\nargs = {num_tasks = 8}') -> Path:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps({"model_type": "qwen3", "max_position_embeddings": 4096}))
    path = tmp_path / "rl.toml"
    path.write_text(
        f'seq_len = 512\nrun_dir = "{tmp_path / "run"}"\n{body}\n[model]\nname = "{model}"\n[[envs.train]]\n{env}\n'
    )
    return path


def rl(*args):
    return CliRunner().invoke(main, ["rl", *map(str, args)])


def assert_nothing_started(tmp_path: Path) -> None:
    assert not (tmp_path / "run").exists()  # not even the run directory (or its lock) was left
    assert not leftovers(tmp_path / "run")


@pytest.mark.parametrize(
    "env, message",
    [
        (
            'id = "reverse_text"',
            "envs.train[0]: environment 'reverse_text' (id 'reverse_text'): not found (no module "
            "'reverse_text'). Did you mean 'reverse-text'?",
        ),
        (
            'id = "{dir}/needs_a_package.py"',
            "envs.train[0]: environment 'needs_a_package' (id '{dir}/needs_a_package.py'): "
            "its module 'needs_a_package' was found, but importing it failed: it imports "
            "'no_such_package_anywhere', which is not installed ({dir}/needs_a_package.py, "
            "line 2)",
        ),
        (
            'id = "{dir}/classic_env.py"',
            "envs.train[0]: environment 'classic_env' (id '{dir}/classic_env.py'): module "
            "'classic_env' ({dir}/classic_env.py) defines `load_environment()`: this is the "
            "classic verifiers API (0.3",
        ),
        (
            'id = "reverse-text"\nargs = {{num_taskz = 3}}',
            "envs.train[0]: environment 'reverse-text' (id 'reverse-text'): bad arguments (envs.*.args)",
        ),
        (
            'id = "reverse-text"\nargs = {{num_tasks = 0}}',
            "envs.train[0]: environment 'reverse-text' (id 'reverse-text'): its taskset has no tasks",
        ),
    ],
)
def test_environment_mistakes_are_named_before_anything_starts(tmp_path, env, message):
    """Each took 17-60 s here (the servers and the trainer started first) and some were misnamed:
    a missing import was "not found", `reverse_text` got no did-you-mean, a verifiers 0.3 module
    was told it "defines no `__all__`"."""
    envs = tmp_path / "envs"
    envs.mkdir()
    (envs / "needs_a_package.py").write_text("import verifiers.v1 as vf\nimport no_such_package_anywhere\n")
    (envs / "classic_env.py").write_text("import verifiers as vf\n\ndef load_environment(**kwargs):\n    return None\n")
    result = rl("@", write_config(tmp_path, env=env.format(dir=envs)))
    assert result.exit_code == EXIT_CONFIG, result.output
    assert message.format(dir=envs) in result.output, result.output
    assert_nothing_started(tmp_path)


@pytest.mark.slow  # a vLLM server starts (and is stopped within seconds)
def test_a_refusal_stops_the_servers_started_early_and_leaves_nothing(tmp_path):
    """On CPU, with a model vLLM can load, the servers start while the slower checks run
    (primerl.launch.start_early: ~5 s of imports before vLLM's own start on 2 cores); an
    environment mistake found after that stops them again: exit 2, the mistake named, no server
    process left, no run directory (their logs were kept out of it until the checks passed)."""
    from primerl.testing import processes
    from primerl_models.tiny import build_tiny_model

    model = build_tiny_model(tmp_path / "tiny", hidden_size=32, num_layers=1)
    path = tmp_path / "rl.toml"
    path.write_text(
        f'seq_len = 512\nrun_dir = "{tmp_path / "run"}"\n[model]\nname = "{model}"\n'
        '[[envs.train]]\nid = "reverse_text"\n'
    )
    result = rl("@", path)
    assert result.exit_code == EXIT_CONFIG, result.output
    assert "inference server(s) on cpu while the checks run" in result.output, result.output
    assert "envs.train[0]: environment 'reverse_text'" in result.output, result.output
    assert not processes("primerl_inference.serve", model)
    assert_nothing_started(tmp_path)


@pytest.mark.slow  # a vLLM server starts and serves
def test_servers_started_early_log_into_the_run_once_the_checks_pass(tmp_path):
    """The same early start when the checks pass: `prepare` returns the running servers, their
    logs moved into run_dir/logs (the server goes on writing there) and run_dir/.starting gone,
    including what a killed `primerl rl` had left in it."""
    from primerl.launch import STARTING, prepare
    from primerl_models.tiny import build_tiny_model

    model = build_tiny_model(tmp_path / "tiny", hidden_size=32, num_layers=1)
    stale = tmp_path / "run" / STARTING
    stale.mkdir(parents=True)
    (stale / "inference-1.log").write_text("a killed run's log\n")
    cfg = load_config(RLConfig, ["@", str(write_config(tmp_path)), f"model.name={model}"])
    _, device, _, servers = prepare(cfg)
    try:
        assert device == "cpu" and servers is not None
        assert servers.logs == [tmp_path / "run" / "logs" / "inference-0.log"]
        assert not stale.exists()
        servers.wait_healthy()  # it serves, and its start-up was logged where the run keeps logs
        assert "Starting vLLM" in servers.logs[0].read_text()
    finally:
        if servers is not None:
            servers.stop()


def test_eval_environments_are_checked_too(tmp_path):
    path = write_config(tmp_path)
    path.write_text(path.read_text() + '[[envs.eval]]\nid = "alphabet_sort"\n')
    result = rl("@", path)
    assert result.exit_code == EXIT_CONFIG
    assert (
        "envs.eval[0]: environment 'alphabet_sort'" in result.output
        and "Did you mean 'alphabet-sort'?" in result.output
    )
    assert_nothing_started(tmp_path)


def test_a_run_dir_that_is_a_file_is_named(tmp_path):
    """It gave NotADirectoryError's traceback."""
    path = write_config(tmp_path)
    (tmp_path / "run").write_text("not a folder")
    result = rl("@", path)
    assert result.exit_code == EXIT_CONFIG
    assert f"run_dir = '{tmp_path / 'run'}': {tmp_path / 'run'} is a file, not a folder" in result.output
    assert (tmp_path / "run").read_text() == "not a folder"


@pytest.mark.parametrize(
    "key, ports",
    [
        ("inference.port", 1),
        ("transport.policy_port", 1),
        ("transport.batch_port", 2),
    ],
)
def test_a_busy_port_is_refused_naming_its_key(tmp_path, key, ports):
    """A busy inference.port failed after 48 s with vLLM's traceback, a busy transport port after
    78 s. Held here by a listening socket, as a server holds it; with two replicas or two trainer
    ranks the second port of the block is the busy one."""
    base = free_port_block(2)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", base + ports - 1))
        holder.listen()
        result = rl(
            "@", write_config(tmp_path), f"{key}={base}", "inference.num_replicas=2", "transport.trainer_ranks=2"
        )
    assert result.exit_code == EXIT_CONFIG, result.output
    assert f"{key} = {base}: port {base + ports - 1}" in result.output and "is taken" in result.output, result.output
    assert f"leave {key} unset to have a free one chosen" in result.output
    assert_nothing_started(tmp_path)


def test_unset_ports_are_chosen_free_and_two_runs_get_their_own(tmp_path):
    """Two runs on one machine with the default config: each gets free ports of its own, written
    into its resolved config (what its processes read), none of them the busy one."""
    from primerl.launch import prepare

    chosen = []
    for name in ("a", "b"):
        cfg = load_config(
            RLConfig,
            [
                "@",
                str(write_config(tmp_path)),
                f"run_dir={tmp_path / name}",
                "inference.num_replicas=2",
                "transport.trainer_ranks=2",
            ],
        )
        assert cfg.inference.port is None and cfg.transport.batch_port is None
        prepare(cfg)
        written = tomllib.loads((tmp_path / name / "configs" / "rl.toml").read_text())
        inf, t = written["inference"]["port"], written["transport"]
        ports = [inf, inf + 1, t["policy_port"], t["batch_port"], t["batch_port"] + 1]
        assert len(set(ports)) == 5
        chosen += ports
    assert len(set(chosen)) == 10


def test_eval_checks_its_environments_and_ports_before_its_servers_start(tmp_path):
    """`primerl eval` loaded its environments only after its servers served (85 s here)."""
    from primerl.cli import inference_main

    model = tmp_path / "model"
    write_config(tmp_path)
    result = CliRunner().invoke(
        main, ["eval", f"model.name={model}", f"run_dir={tmp_path / 'run'}", 'envs.eval=[{id = "reverse_text"}]']
    )
    assert result.exit_code == EXIT_CONFIG, result.output
    assert "primerl eval: envs.eval[0]: environment 'reverse_text'" in result.output
    assert "Did you mean 'reverse-text'?" in result.output
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", free_port_block(1)))
        holder.listen()
        port = holder.getsockname()[1]
        result = CliRunner().invoke(
            main,
            [
                "eval",
                f"model.name={model}",
                f"run_dir={tmp_path / 'run'}",
                f"inference.port={port}",
                'envs.eval=[{id = "reverse-text"}]',
            ],
        )
        assert result.exit_code == EXIT_CONFIG, result.output
        assert f"primerl eval: inference.port = {port}: port {port} on 127.0.0.1 is taken" in result.output
        result = CliRunner().invoke(
            inference_main, [f"model.name={model}", f"run_dir={tmp_path / 'run'}", f"inference.port={port}"]
        )
        assert result.exit_code == EXIT_CONFIG, result.output
        assert f"primerl-inference: inference.port = {port}: port {port} on 127.0.0.1 is taken" in result.output
        assert "set inference.port to a free one" in result.output
    assert_nothing_started(tmp_path)
