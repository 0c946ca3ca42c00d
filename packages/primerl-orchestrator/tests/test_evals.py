"""Evals without servers: `evaluate` (online evals) and `primerl eval` (eval_run and the command)
on a scripted generator, whose rollouts error as a server that refuses the request makes them
error. What a real vLLM answers: test_orchestrator_on_vllm.py (slow)."""

import asyncio
import json
import logging
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from primerl.cli import main
from primerl_envs.config import EnvConfig, EnvsConfig
from primerl_orchestrator import evals
from primerl_orchestrator.config import EvalRunConfig, EvalSettings
from primerl_protocol import rundir
from primerl_protocol.config import ModelConfig
from primerl_protocol.rollouts import Rollout
from primerl_protocol.weights import FULL, write_marker

REFUSED = (
    "ProviderError: Error code: 400 - {'error': {'message': 'n must be 1 when using greedy sampling, got 4', "
    "'type': 'BadRequestError'}}"
)


class Tasks:
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def at(self, i: int) -> int:
        return i


class Env:
    """What `evaluate` reads of an environment: its name, whether it is single-turn, its tasks."""

    def __init__(self, name: str, num_tasks: int = 3) -> None:
        self.name, self.single_turn, self.tasks = name, object(), Tasks(num_tasks)


class Pool:
    def __init__(self) -> None:
        self.loaded: list[tuple[str, int]] = []

    async def load_weights(self, folder: str, policy: int, digest: str, fmt: str) -> None:
        self.loaded.append((Path(folder).name, policy))


class Generator:
    """Answers each group at once; `error(env, task, i)` is the error of rollout i of a task
    (None: it solved it)."""

    def __init__(self, error=lambda env, task, i: None) -> None:
        self.error, self.pool, self.requests = error, Pool(), []

    async def play_group(self, env, task, *, sample_ids, group_id, max_tokens, sampling):
        self.requests.append((env.name, len(sample_ids), sampling["temperature"]))
        out = []
        for i, sample_id in enumerate(sample_ids):
            error = self.error(env.name, task, i)
            out.append(
                Rollout(sample_id=sample_id, group_id=group_id, turns=[], error=error, reward=0.0 if error else 1.0)
            )
        return out


def settings(**kw) -> EvalSettings:
    return EvalSettings(**{"num_samples": 2, "temperature": 1.0, **kw})


def test_rollouts_that_error_are_logged_with_the_first_error(caplog):
    """Online evals (the training loop calls `evaluate`): how many rollouts errored and the first
    error go to the log, at ERROR when every rollout of the environment errored; the metrics
    are still returned (error_rate among them)."""
    gen = Generator(lambda env, task, i: REFUSED if env == "broken" or (task, i) == (1, 0) else None)
    with caplog.at_level(logging.WARNING, logger="primerl.orchestrator"):
        metrics = asyncio.run(
            evals.evaluate([Env("some"), Env("broken")], gen, settings(), max_tokens=8, concurrency=4)
        )
    assert metrics["eval/some/error_rate"] == pytest.approx(1 / 6) and metrics["eval/broken/error_rate"] == 1.0
    records = {r.getMessage().split(":")[0]: r for r in caplog.records}
    assert records["eval of some"].levelno == logging.WARNING
    assert "1 of 6 rollouts errored; the first: ProviderError" in records["eval of some"].getMessage()
    assert records["eval of broken"].levelno == logging.ERROR
    assert f"6 of 6 rollouts errored; the first: {REFUSED}" in records["eval of broken"].getMessage()


def test_evaluate_logs_nothing_when_no_rollout_errors(caplog):
    with caplog.at_level(logging.WARNING, logger="primerl.orchestrator"):
        metrics = asyncio.run(evals.evaluate([Env("fine")], Generator(), settings(), max_tokens=8, concurrency=4))
    assert metrics["eval/fine/error_rate"] == 0.0 and metrics["eval/fine/avg@2"] == 1.0
    assert not caplog.records


def test_several_greedy_samples_are_refused_where_the_settings_load():
    """num_samples > 1 at temperature 0: k copies of one greedy answer (and vLLM refuses a
    group's request with n > 1 when greedy: every rollout errored)."""
    with pytest.raises(ValueError, match=r"num_samples = 4 with temperature = 0 \(greedy\): .* set temperature > 0"):
        EvalSettings(num_samples=4)
    EvalSettings(num_samples=4, temperature=0.6)
    EvalSettings(num_samples=1, temperature=0.0)


@pytest.fixture
def scripted(monkeypatch):
    """eval_run's environments and generator replaced: returns the Generator to script."""
    gen = Generator()

    async def open_environments(stack, configs, seed):
        return [Env(c.name or c.id) for c in configs]

    async def start_generator(stack, model, urls, token):
        return gen

    monkeypatch.setattr(evals, "open_environments", open_environments)
    monkeypatch.setattr(evals, "start_generator", start_generator)
    return gen


def published_run(root: Path, steps: int) -> Path:
    for step in range(steps):
        folder = rundir.step_folder(root / rundir.WEIGHTS, step)
        folder.mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(b"")
        write_marker(folder, step, ["model.safetensors"], 0.0, format=FULL)
    return root


def eval_config(tmp_path: Path, **kw) -> EvalRunConfig:
    return EvalRunConfig(
        model=ModelConfig(name="tiny"),
        run_dir=str(tmp_path / "evals"),
        eval=settings(),
        envs=EnvsConfig(eval=[EnvConfig(id="reverse-text")]),
        **kw,
    )


def test_a_policy_where_every_rollout_errored_stops_the_eval_and_records_nothing(tmp_path, scripted):
    """The first error is the EvalError's message; policies before it are recorded, it is not
    (so that rerunning once the cause is fixed evaluates it)."""
    run = published_run(tmp_path / "run", 3)
    scripted.error = lambda env, task, i: REFUSED if len(scripted.pool.loaded) == 2 else None
    with pytest.raises(
        evals.EvalError,
        match=r"every rollout of eval environment 'reverse-text' errored on "
        r"weights/step_1 \(policy 2\), so nothing was recorded for it; the "
        r"first error: ProviderError: .*n must be 1 when using greedy",
    ):
        asyncio.run(evals.eval_run(eval_config(tmp_path, run=str(run)), ["http://unused"], None))
    records = [json.loads(line) for line in (tmp_path / "evals" / "evals.jsonl").read_text().splitlines()]
    assert [(r["policy"], r["step"]) for r in records] == [(1, 0)]


def test_each_published_step_is_labelled_by_its_folder_and_policy(tmp_path, scripted):
    """weights/step_N holds the weights after N + 1 optimizer steps: policy N + 1. Each record
    holds both (`step`, `policy`) and the folder; the console label names the folder."""
    run = published_run(tmp_path / "run", 3)
    records = asyncio.run(evals.eval_run(eval_config(tmp_path, run=str(run)), ["http://unused"], None))
    assert scripted.pool.loaded == [("step_0", 1), ("step_1", 2), ("step_2", 3)]
    assert [(r["policy"], r["step"], Path(r["model"]).name) for r in records] == [
        (1, 0, "step_0"),
        (2, 1, "step_1"),
        (3, 2, "step_2"),
    ]
    assert [evals.policy_label(r) for r in records] == [
        "weights/step_0 (policy 1)",
        "weights/step_1 (policy 2)",
        "weights/step_2 (policy 3)",
    ]
    base = asyncio.run(evals.eval_run(eval_config(tmp_path / "base"), ["http://unused"], None))
    assert evals.policy_label(base[0]) == "tiny (policy 0)" and base[0]["step"] is None


def write_eval_toml(tmp_path: Path, *lines: str) -> Path:
    path = tmp_path / "eval.toml"
    path.write_text("\n".join([f'run_dir = "{tmp_path / "evals"}"', *lines]) + "\n")
    return path


ENVS = '[[envs.eval]]\nid = "reverse-text"'


def test_primerl_eval_exits_1_with_the_first_error_when_every_rollout_errored(tmp_path, scripted):
    scripted.error = lambda env, task, i: REFUSED
    config = write_eval_toml(
        tmp_path,
        'inference.urls = ["http://127.0.0.1:9"]',
        "[model]",
        'name = "tiny"',
        "[eval]",
        "num_samples = 2",
        "temperature = 1.0",
        ENVS,
    )
    result = CliRunner().invoke(main, ["eval", "@", str(config)])
    assert result.exit_code == 1, result.output
    assert "primerl eval: every rollout of eval environment 'reverse-text' errored on tiny (policy 0)" in result.output
    assert "n must be 1 when using greedy sampling" in result.output
    assert not (tmp_path / "evals" / "evals.jsonl").exists()


def test_primerl_eval_prints_each_step_by_its_folder(tmp_path, scripted):
    run = published_run(tmp_path / "run", 2)
    config = write_eval_toml(
        tmp_path,
        'inference.urls = ["http://127.0.0.1:9"]',
        f'run = "{run}"',
        "[model]",
        'name = "tiny"',
        "[eval]",
        "num_samples = 2",
        "temperature = 1.0",
        ENVS,
    )
    result = CliRunner().invoke(main, ["eval", "@", str(config)])
    assert result.exit_code == 0, result.output
    assert "weights/step_0 (policy 1): reverse-text/avg@2 1.000" in result.output
    assert "weights/step_1 (policy 2): reverse-text/avg@2 1.000" in result.output


@pytest.mark.parametrize(
    "case, message",
    [
        ("greedy-samples", "config key `eval`: num_samples = 4 with temperature = 0 (greedy)"),
        ("no-envs", "envs.eval: no eval environments: add at least one [[envs.eval]] entry"),
        ("no-model", "model.name: no model to evaluate: set model.name, or run = RUN_DIR"),
        ("run-without-config", "has no run config with a [model] (rl.toml, trainer.toml, sft.toml in"),
        ("run-without-weights", "nothing to evaluate, no complete published weights"),
    ],
)
def test_primerl_eval_refuses_what_cannot_work_before_any_server_starts(tmp_path, monkeypatch, case, message):
    """Each exits 2 (the user's input is wrong) in a moment, no server started: `inference.urls`
    is empty, so `primerl eval` would start its own (85 s and more) after these checks."""
    import primerl_inference.launcher

    def launch(*args, **kwargs):
        raise AssertionError("a server was started")

    monkeypatch.setattr(primerl_inference.launcher, "launch", launch)
    run = tmp_path / "run"
    (run / rundir.WEIGHTS).mkdir(parents=True)
    (run / rundir.CONFIGS).mkdir()
    model = '[model]\nname = "tiny"'
    lines = {
        "greedy-samples": [model, "[eval]", "num_samples = 4", ENVS],
        "no-envs": [model],
        "no-model": [ENVS],
        "run-without-config": [f'run = "{tmp_path / "elsewhere"}"', ENVS],
        "run-without-weights": [f'run = "{run}"', model, ENVS],
    }[case]
    t0 = time.monotonic()
    result = CliRunner().invoke(main, ["eval", "@", str(write_eval_toml(tmp_path, *lines))])
    assert result.exit_code == 2, result.output
    assert message in result.output, result.output
    assert time.monotonic() - t0 < 10
    assert not (tmp_path / "evals" / "logs").exists()


def test_primerl_eval_of_a_run_takes_the_runs_model(tmp_path):
    """`run = DIR` without [model]: the model of DIR/configs/rl.toml (what `primerl rl` wrote)."""
    run = tmp_path / "run"
    (run / rundir.CONFIGS).mkdir(parents=True)
    (run / rundir.CONFIGS / "rl.toml").write_text(
        'seq_len = 2048\n[model]\nname = "org/the-runs-model"\nrevision = "abc"\n[trainer]\n'
    )
    result = CliRunner().invoke(
        main, ["eval", "@", str(write_eval_toml(tmp_path, f'run = "{run}"', ENVS)), "--dry-run"]
    )
    assert result.exit_code == 0, result.output
    assert 'name = "org/the-runs-model"' in result.output and 'revision = "abc"' in result.output
    # a model given wins
    result = CliRunner().invoke(
        main, ["eval", "@", str(write_eval_toml(tmp_path, f'run = "{run}"', ENVS)), "model.name=mine", "--dry-run"]
    )
    assert 'name = "mine"' in result.output


def test_primerl_eval_help_lists_only_the_keys_eval_reads():
    result = CliRunner().invoke(main, ["eval", "--help"])
    assert result.exit_code == 0, result.output
    listed, unused = result.output.split("Config sections and top-level keys:")[1].split("unused by this command:")
    names = [line.split()[0] for line in listed.splitlines() if line.startswith("    ") and line.split()]
    assert names == ["model", "seq_len", "run_dir", "seed", "inference", "envs", "eval", "run", "slurm"]
    assert unused.split() == ["max_steps,", "transport,", "wandb,", "envs.train,", "eval.interval"]
