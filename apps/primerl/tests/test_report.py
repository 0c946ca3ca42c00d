"""`primerl report`: plots and summary from a run's metrics files (written here by hand)."""

import json

import numpy as np
import pytest
from click.testing import CliRunner
from primerl.cli import main
from primerl.report import moving_average


def write_run(run_dir, steps=40, resumed_from=None):
    run_dir.mkdir(parents=True, exist_ok=True)
    rows = [
        {
            "step": s,
            "reward/mean": s / 100,
            "trainer/loss": 1.0 - s / 100,
            "trainer/mismatch_kl": 1e-3 * (1 + s % 3),
            "trainer/entropy": 2.0,
            "trainer/grad_norm": 0.5,
            "trainer/lr": 1e-5,
            "trainer/tokens_per_s": 1000.0,
            "rollouts/tokens_per_s": 500.0,
            "off_policy/level": float(s % 2),
            "rollouts/completion_tokens/mean": 10.0 + s,
            "rollouts/completion_tokens/max": 20.0 + s,
            "rollouts/error_rate": 0.0,
            "rollouts/truncated_rate": 0.25,
            "rollouts/count": 16.0,
            "rollouts/filtered": float(4 * (s % 2)),
            "time/fwd_bwd": 1.0,
            "time/wait_rollouts": 3.0,
        }
        for s in range(steps)
    ]
    if resumed_from is not None:  # a resumed run logs its last steps again: the later rows win
        rows += [r | {"trainer/loss": 0.0} for r in rows[resumed_from:]]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run_dir / "orchestrator").mkdir(exist_ok=True)
    (run_dir / "orchestrator" / "evals.jsonl").write_text(
        json.dumps({"policy": 20, "eval/rt/avg@4": 0.25, "eval/rt/pass@4": 0.5})
        + "\n"
        + json.dumps({"policy": 40, "eval/rt/avg@4": 0.5, "eval/rt/pass@4": 0.75})
        + "\n"
    )
    return run_dir


def test_moving_average_by_hand():
    np.testing.assert_allclose(moving_average(np.array([1.0, 2.0, 3.0, 4.0]), 2), [1.0, 1.5, 2.5, 3.5])


def test_report_writes_plots_and_summary(tmp_path):
    run = write_run(tmp_path / "run", resumed_from=30)
    result = CliRunner().invoke(main, ["report", str(run)])
    assert result.exit_code == 0, result.output
    # rewards 0.00..0.19 then 0.20..0.39: means 0.095 and 0.295
    assert "reward: first 20 steps 0.0950, last 20 steps 0.2950 (change +0.2000)" in result.output
    assert (
        "mismatch KL: mean 0.001975, max 0.003, last 0.001" in result.output
    )  # 1e-3 x (1, 2, 3, 1, ...) over 40 steps
    assert "loss: mean" in result.output and "last 0\n" in result.output  # the resumed rows won
    assert "eval of policy 40: rt/avg@4 0.500, rt/pass@4 0.750" in result.output
    assert "completion tokens: mean 29.5, max 49, last 49\n" in result.output  # 10 + s for s in 0..39
    assert "filtered rate: mean 0.125, max 0.25, last 0.25\n" in result.output  # 4 of 16 on odd steps
    assert "time per step (mean s): fwd_bwd 1, wait_rollouts 3\n" in result.output
    for name in (
        "reward",
        "loss",
        "mismatch_kl",
        "entropy",
        "completion_length",
        "rollout_rates",
        "grad_norm",
        "lr",
        "tokens_per_s",
        "off_policy",
        "time",
        "evals",
    ):
        png = (run / "report" / f"{name}.png").read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 1000, name


@pytest.mark.parametrize(
    "steps, line",
    [
        (5, "reward: first 2 steps 0.0050, last 2 steps 0.0350 (change +0.0300)"),  # 0, .01 and .03, .04: no overlap
        (2, "reward: first 1 steps 0.0000, last 1 steps 0.0100 (change +0.0100)"),
        (1, "reward: 0.0000 (one step)"),
    ],
)
def test_a_short_runs_first_and_last_steps_do_not_overlap(tmp_path, steps, line):
    result = CliRunner().invoke(main, ["report", str(write_run(tmp_path / "run", steps=steps))])
    assert result.exit_code == 0 and line in result.output, result.output


def test_a_run_logged_before_the_metric_namespaces_reads_as_a_new_one(tmp_path):
    """Flat trainer keys and `time_x` (primerl before docs/metrics.md) are trainer/ and time/."""
    run = tmp_path / "old"
    run.mkdir()
    (run / "metrics.jsonl").write_text(
        "".join(
            json.dumps({"step": s, "loss": 1.0 / (s + 1), "grad_norm": 2.0, "time_fwd_bwd": 0.5, "reward/mean": 0.5})
            + "\n"
            for s in range(4)
        )
    )
    result = CliRunner().invoke(main, ["report", str(run)])
    assert result.exit_code == 0, result.output
    assert "grad norm: mean 2, max 2, last 2\n" in result.output and "fwd_bwd 0.5" in result.output
    assert {"loss.png", "grad_norm.png", "time.png", "reward.png"} <= {p.name for p in (run / "report").iterdir()}


def test_an_sft_run_gets_the_plots_it_has(tmp_path):
    run = tmp_path / "sft"
    run.mkdir()
    (run / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "trainer/loss": 1.0 / (s + 1)}) + "\n" for s in range(5))
    )
    result = CliRunner().invoke(main, ["report", str(run)])
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in (run / "report").glob("*.png")) == ["loss.png"]


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "has no metrics.jsonl: is it a primerl run directory?"),
        ('{"step": 0, "loss": 1}\n{"step": 1, "loss": \n', "metrics.jsonl, line 2: not JSON"),
        ('{"loss": 1}\n', "metrics.jsonl, line 1: expected an object with an integer `step`"),
    ],
)
def test_bad_runs_are_named(tmp_path, content, message):
    run = tmp_path / "run"
    run.mkdir()
    if content is not None:
        (run / "metrics.jsonl").write_text(content)
    result = CliRunner().invoke(main, ["report", str(run)])
    assert result.exit_code == 1 and message in result.output, result.output
