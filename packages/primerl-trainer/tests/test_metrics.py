"""The trainer's W&B run (real wandb, offline): one run per run directory, continued by a
resume, whose config is the whole run's and holds no secret."""

from primerl_protocol.config import WandbConfig
from primerl_protocol.rundir import WANDB_ID
from primerl_trainer.metrics import MetricsLogger

OWN = {
    "trainer": {"optimizer": {"lr": 1e-5}},
    "transport": {"sockets": {"curve": {"server_secret": "S3CRET-SERVER", "client_secret": "S3CRET-CLIENT"}}},
}


def open_run(run_dir, config=OWN):
    return MetricsLogger(run_dir, WandbConfig(mode="offline"), config, is_main=True, job="rl")


def test_every_metric_is_logged_under_a_namespace(tmp_path, caplog):
    """The trainer computes its own metrics without a namespace: they are logged as
    `trainer/<name>`; what has one (the step's time split, the orchestrator's) is kept; None
    (no GPU: no MFU) is left out. The console line reads the namespaced keys."""
    import json
    import logging

    logger = MetricsLogger(tmp_path, WandbConfig(mode="disabled"), OWN, is_main=True)
    with caplog.at_level(logging.INFO, logger="primerl.trainer"):
        logger.log(
            3,
            {
                "loss": 0.25,
                "grad_norm": 1.5,
                "mfu": None,
                "time/fwd_bwd": 0.5,
                "time/wait_rollouts": 2.0,
                "reward/mean": 0.75,
                "moe/max_load": 1.25,
            },
        )
    row = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert row == {
        "step": 3,
        "trainer/loss": 0.25,
        "trainer/grad_norm": 1.5,
        "time/fwd_bwd": 0.5,
        "time/wait_rollouts": 2.0,
        "reward/mean": 0.75,
        "moe/max_load": 1.25,
    }
    assert "step 3 | loss 0.2500 | grad 1.500 | fwd_bwd 0.50s" in caplog.text


def test_a_resumed_run_continues_its_wandb_run(tmp_path):
    first = open_run(tmp_path)
    first.log(0, {"loss": 1.0})
    first_id = first.run.id
    first.close()
    again = open_run(tmp_path)  # the trainer restarted on the same run directory
    assert again.run.id == first_id
    again.close()
    assert (tmp_path / WANDB_ID).read_text().strip() == first_id
    other = open_run(tmp_path / "other")  # another run directory, another run
    assert other.run.id != first_id
    other.close()


def test_the_wandb_config_is_the_whole_runs_and_holds_no_secret(tmp_path):
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "rl.toml").write_text(
        '[orchestrator]\ngroup_size = 8\n[inference]\nadmin_token = "T0KEN-VALUE"\n'
        '[transport.sockets.curve]\nserver_secret = "S3CRET-SERVER"\n'
    )
    logger = open_run(tmp_path)
    config = dict(logger.run.config)
    logger.close()
    assert config["orchestrator"] == {"group_size": 8}  # the orchestrator's section reaches W&B
    assert config["inference"]["admin_token"] == "<redacted>"
    assert config["transport"]["sockets"]["curve"] == "<redacted>"
    alone = open_run(tmp_path / "trainer-alone")  # no rl.toml: the trainer's own config, redacted
    config = dict(alone.run.config)
    alone.close()
    assert config["trainer"] == {"optimizer": {"lr": 1e-5}}
    assert "S3CRET" not in repr(config) and config["transport"]["sockets"]["curve"] == "<redacted>"


def test_the_orchestrators_samples_become_the_steps_wandb_table(tmp_path):
    import json

    from primerl_protocol.rollouts import RolloutSample

    rows = [
        RolloutSample(
            step=10,
            policy_step=9,
            env="toy",
            group_id=3,
            sample_id=24 + i,
            prompt="say 1",
            completion=reply,
            reward=float(i == 0),
            rewards={"reward/exact": float(i == 0)},
            advantage=[1.0, -1.0][i],
            completion_tokens=2,
        )
        for i, reply in enumerate(["1", "2"])
    ]
    logger = open_run(tmp_path)
    logger.log(9, {"loss": 1.0})
    logger.log(10, {"loss": 0.5}, rows)
    logger.close()
    (table,) = tmp_path.glob("wandb/offline-run-*/files/media/table/samples_*.table.json")  # step 10 alone had samples
    data = json.loads(table.read_text())
    assert data["columns"][:8] == [
        "step",
        "policy_step",
        "env",
        "group_id",
        "sample_id",
        "prompt",
        "completion",
        "reward",
    ]
    got = [dict(zip(data["columns"], row)) for row in data["data"]]
    assert [(r["sample_id"], r["completion"], r["advantage"], json.loads(r["rewards"])) for r in got] == [
        (24, "1", 1.0, {"reward/exact": 1.0}),
        (25, "2", -1.0, {"reward/exact": 0.0}),
    ]
