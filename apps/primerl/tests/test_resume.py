"""Resume, made explicit and guarded: one `primerl rl` per run directory (a lock naming its
holder; a dead holder's lock taken over, saying so), a resume that changes what it cannot
refused naming each key (old -> new) with the old run's configs untouched, other changes
printed, and "resuming from step N (checkpoint ...)" on the console. No vLLM: every refusal
comes before anything starts, and `prepare` (the checks and the configs, nothing started)
stands in for a run that gets past them."""

import json
import os
import socket
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
from click.testing import CliRunner
from primerl.cli import main
from primerl.configs import RLConfig
from primerl.errors import CheckError
from primerl.launch import prepare
from primerl.resume import LOCK, RunLock, _start_ticks
from primerl.testing import leftovers
from primerl_protocol import rundir
from primerl_protocol.config import load_config
from primerl_trainer.testing import free_port_block

EXIT_CONFIG = 2


def model_folder(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"model_type": "qwen3", "max_position_embeddings": 4096}))
    return path


def write_config(tmp_path: Path) -> Path:
    path = tmp_path / "rl.toml"
    path.write_text(
        f'seq_len = 512\nrun_dir = "{tmp_path / "run"}"\n[model]\nname = "{model_folder(tmp_path / "model")}"\n'
        "[orchestrator]\nbatch_size = 16\ngroup_size = 8\n"
        '[[envs.train]]\nid = "reverse-text"\nargs = {num_tasks = 8}\n'
    )
    return path


def started_run(tmp_path: Path, checkpoint_step: int | None = 3) -> tuple[Path, bytes]:
    """A run directory as a run leaves it: its resolved config, and a complete checkpoint."""
    prepare(load_config(RLConfig, ["@", str(write_config(tmp_path))]))
    run = tmp_path / "run"
    if checkpoint_step is not None:
        folder = rundir.step_folder(run / rundir.CHECKPOINTS, checkpoint_step)
        folder.mkdir(parents=True)
        (folder / "shard.distcp").write_bytes(b"x" * 10)
        rundir.write_meta(folder, {"step": checkpoint_step, "world_size": 1, "data": {}})
    return run, (run / "configs" / "rl.toml").read_bytes()


def rl(*args):
    return CliRunner().invoke(main, ["rl", *map(str, args)])


def busy_port():
    """A port held by a listening socket: a run given it stops at the port check, before starting anything."""
    holder = socket.socket()
    holder.bind(("127.0.0.1", free_port_block(1)))
    holder.listen()
    return holder


def test_a_second_run_on_a_live_run_dir_is_refused_naming_it_and_a_dead_ones_lock_is_taken_over(tmp_path):
    """A second `primerl rl` on a live run's directory rewrote its configs, reported the other
    run's server and steps as its own, then died. The live run here holds the lock as `primerl
    rl` does (RunLock, in a process of its own)."""
    run, before = started_run(tmp_path)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import os, time; from primerl.resume import RunLock; "
            "RunLock(os.environ['RUN']).acquire(); print('held', flush=True); time.sleep(300)",
        ],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "RUN": str(run)},
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        mtime = (run / "configs" / "rl.toml").stat().st_mtime_ns
        result = rl("@", write_config(tmp_path), "trainer.optimizer.lr=1e-4")
        assert result.exit_code == EXIT_CONFIG, result.output
        assert (
            f"run_dir = '{run}': another `primerl rl` runs on it: pid {holder.pid} on host {socket.gethostname()}"
            in result.output
        ), result.output
        assert (run / "configs" / "rl.toml").read_bytes() == before  # nothing rewritten
        assert (run / "configs" / "rl.toml").stat().st_mtime_ns == mtime
        assert not (run / "configs" / "rl.prev.toml").exists() and not leftovers(run)
        assert "resuming" not in result.output
    finally:
        holder.kill()
        holder.wait()
    # its holder died without a word (SIGKILL): the next run takes the lock over and says so
    with busy_port() as port:
        result = rl("@", write_config(tmp_path), f"inference.port={port.getsockname()[1]}")
    assert f"taking over the lock of pid {holder.pid} on host {socket.gethostname()}" in result.output, result.output
    assert "that process is no longer running" in result.output
    assert result.exit_code == EXIT_CONFIG and "inference.port" in result.output  # then stopped at the busy port
    assert (run / LOCK).read_text() == ""  # released: no holder
    assert (run / "configs" / "rl.toml").read_bytes() == before


def test_a_lock_record_is_stale_only_when_its_process_is_gone(tmp_path):
    """Without the flock (a file system that ignores it), the record decides: a live process of
    that PID and start time holds the run; another process that got the PID since does not."""
    run = tmp_path / "run"
    run.mkdir()
    me = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(), "command": "primerl rl"}
    (run / LOCK).write_text(json.dumps({**me, "ticks": _start_ticks(os.getpid())}))
    with pytest.raises(CheckError, match=f"another `primerl rl` runs on it: pid {os.getpid()} on host"):
        RunLock(run).acquire()
    (run / LOCK).write_text(json.dumps({**me, "ticks": 1}))  # the PID's process started at another time
    with RunLock(run) as lock:
        assert lock.took_over.startswith(f"pid {os.getpid()} on host")
    (run / LOCK).write_text(json.dumps({**me, "host": "elsewhere"}))
    with pytest.raises(
        CheckError,
        match=f"names pid {os.getpid()} on host elsewhere .*another host.*if it has ended, delete {run / LOCK}",
    ):
        RunLock(run).acquire()


def test_a_resume_that_changes_what_it_cannot_is_refused_naming_each_key(tmp_path):
    """Rerunning on a run dir with another environment, lr and group size resumed the old
    checkpoint and overwrote its configs. Now: the breaking keys are named, old -> new; the
    allowed change (lr) is not among them; nothing in the run directory changes."""
    run, before = started_run(tmp_path)
    other = model_folder(tmp_path / "other-model")
    result = rl(
        "@",
        write_config(tmp_path),
        f"model.name={other}",
        "orchestrator.group_size=4",
        "seed=1",
        'envs.train=[{id = "reverse-text", args = {num_tasks = 16}}]',
        "trainer.optimizer.lr=1e-4",
    )
    assert result.exit_code == EXIT_CONFIG, result.output
    assert f"holds a run to resume (checkpoint {run}/checkpoints/step_3, step 3)" in result.output, result.output
    for line in [
        f"model.name: '{tmp_path / 'model'}' -> '{other}'",
        "orchestrator.group_size: 8 -> 4",
        "seed: 0 -> 1",
        "envs.train[0].args.num_tasks: 8 -> 16",
    ]:
        assert f"\n  {line}  (" in result.output, line
    assert "trainer.optimizer.lr" not in result.output
    assert (run / "configs" / "rl.toml").read_bytes() == before
    assert not (run / "configs" / "rl.prev.toml").exists() and not leftovers(run)
    # another environment in place of the old one, and one more
    result = rl("@", write_config(tmp_path), 'envs.train=[{id = "math"}, {id = "reverse-text"}]')
    assert result.exit_code == EXIT_CONFIG
    assert (
        "envs.train: '1 entries' -> '2 entries'" in result.output
        and "envs.train[0].id: 'reverse-text' -> 'math'" in result.output
    ), result.output


def test_a_resume_with_allowed_changes_says_from_which_step_and_what_changed(tmp_path, capsys):
    run, before = started_run(tmp_path)
    capsys.readouterr()
    prepare(
        load_config(
            RLConfig,
            [
                "@",
                str(write_config(tmp_path)),
                "trainer.optimizer.lr=5e-5",
                "max_steps=20",
                "orchestrator.batch_size=32",
                "seq_len=1024",
                'envs.train=[{id = "reverse-text", args = {num_tasks = 8}, weight = 2.0}]',
            ],
        )
    )
    out = capsys.readouterr().out
    assert f"resuming from step 3 (checkpoint {run}/checkpoints/step_3): the trainer continues at step 4" in out, out
    for line in [
        "trainer.optimizer.lr: 1e-06 -> 5e-05",
        "max_steps: (unset) -> 20",
        "orchestrator.batch_size: 16 -> 32",
        "seq_len: 512 -> 1024",
        "envs.train[0].weight: 1.0 -> 2.0",
    ]:
        assert f"  {line}\n" in out, line
    assert "admin_token" not in out and "port" not in out  # secrets and ports chosen at launch are not settings
    assert (run / "configs" / "rl.prev.toml").read_bytes() == before  # the old run's config kept
    assert tomllib.loads((run / "configs" / "rl.toml").read_text())["trainer"]["optimizer"]["lr"] == 5e-5


def test_without_a_checkpoint_any_change_is_a_fresh_start(tmp_path, capsys):
    run, _ = started_run(tmp_path, checkpoint_step=None)
    capsys.readouterr()
    prepare(load_config(RLConfig, ["@", str(write_config(tmp_path)), "orchestrator.group_size=4"]))
    out = capsys.readouterr().out
    assert f"no checkpoint in {run}/checkpoints: the run starts at step 0" in out and "resuming" not in out


def test_a_rerun_of_a_complete_run_says_so(tmp_path, capsys):
    started_run(tmp_path)  # checkpoint of step 3
    capsys.readouterr()
    prepare(load_config(RLConfig, ["@", str(write_config(tmp_path)), "max_steps=4"]))
    assert "the run is complete (max_steps = 4): nothing will be trained; raise max_steps" in capsys.readouterr().out
