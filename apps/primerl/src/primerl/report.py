"""`primerl report RUN_DIR`: PNG plots and a short text summary of a run, without W&B.

Reads `RUN_DIR/metrics.jsonl` (the trainer's metrics with the orchestrator's of each step;
for SFT runs only the trainer's) and `RUN_DIR/orchestrator/evals.jsonl` when there is one,
and writes `RUN_DIR/report/`: one PNG per plot whose metrics the run logged (PLOTS, the step's
time split and the evals) and `summary.txt`. Metric names are docs/metrics.md's; a run logged
by a primerl before that scheme (flat trainer keys, `time_x`) is read as if it were new.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
from primerl_protocol.rundir import RunDir

# (file name, title, [(metric key, label)], log scale)
PLOTS = [
    ("reward", "Reward", [("reward/mean", "mean reward")], False),
    ("loss", "Loss", [("trainer/loss", "loss"), ("trainer/eval_loss", "eval loss")], False),
    ("mismatch_kl", "Mismatch KL (trainer vs inference)", [("trainer/mismatch_kl", "mismatch KL")], True),
    ("entropy", "Entropy", [("trainer/entropy", "entropy")], False),
    (
        "completion_length",
        "Completion length (tokens)",
        [("rollouts/completion_tokens/mean", "mean"), ("rollouts/completion_tokens/max", "max")],
        False,
    ),
    (
        "rollout_rates",
        "Rollouts errored, truncated, not trained",
        [
            ("rollouts/error_rate", "errored"),
            ("rollouts/truncated_rate", "truncated"),
            ("rollouts/filtered_rate", "filtered (not trained)"),
        ],
        False,
    ),
    ("grad_norm", "Gradient norm (before clipping)", [("trainer/grad_norm", "grad norm")], True),
    ("lr", "Learning rate", [("trainer/lr", "learning rate")], False),
    (
        "tokens_per_s",
        "Tokens per second",
        [("trainer/tokens_per_s", "trained"), ("rollouts/tokens_per_s", "generated")],
        False,
    ),
    (
        "off_policy",
        "Off-policy level",
        [("off_policy/level", "level"), ("off_policy/mean", "mean over samples")],
        False,
    ),
]
# The summary's lines after the reward: (metric key, name)
SUMMARY = [
    ("trainer/loss", "loss"),
    ("trainer/mismatch_kl", "mismatch KL"),
    ("trainer/entropy", "entropy"),
    ("trainer/grad_norm", "grad norm"),
    ("rollouts/completion_tokens/mean", "completion tokens"),
    ("rollouts/error_rate", "error rate"),
    ("rollouts/truncated_rate", "truncated rate"),
    ("rollouts/filtered_rate", "filtered rate"),
    ("trainer/tokens_per_s", "trained tokens/s"),
    ("rollouts/tokens_per_s", "generated tokens/s"),
    ("off_policy/level", "off-policy level"),
]


class ReportError(ValueError):
    """The run directory cannot be reported on (says which file and line)."""


def read_jsonl(path: Path) -> list[dict]:
    rows = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ReportError(f"{path}, line {i}: not JSON ({err.msg})") from None
        if not isinstance(row, dict) or not isinstance(row.get("step", row.get("policy")), int):
            raise ReportError(f"{path}, line {i}: expected an object with an integer `step`")
        rows.append(row)
    return rows


def load_metrics(run_dir: Path) -> list[dict]:
    """The run's metric rows, one per step (a resumed run's later rows win)."""
    path = RunDir(run_dir).metrics
    if not path.exists():
        raise ReportError(f"{run_dir} has no metrics.jsonl: is it a primerl run directory?")
    by_step = {row["step"]: with_derived(current_names(row)) for row in read_jsonl(path)}
    if not by_step:
        raise ReportError(f"{path} is empty: the run has not finished a step yet")
    return [by_step[s] for s in sorted(by_step)]


def current_names(row: dict) -> dict:
    """A row under docs/metrics.md's names: an older primerl logged the trainer's keys flat
    (`loss`) and its times as `time_x`; they become `trainer/loss` and `time/x`."""

    def name(key: str) -> str:
        if key == "step" or "/" in key:
            return key
        return f"time/{key[5:]}" if key.startswith("time_") else f"trainer/{key}"

    return {name(k): v for k, v in row.items()}


def with_derived(row: dict) -> dict:
    """The row with `rollouts/filtered_rate`: rollouts not trained over rollouts of the step."""
    filtered, count = row.get("rollouts/filtered"), row.get("rollouts/count")
    if isinstance(filtered, (int, float)) and isinstance(count, (int, float)) and count > 0:
        row["rollouts/filtered_rate"] = filtered / count
    return row


def series(rows: list[dict], key: str, x: str = "step") -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) of the rows that have a finite `key` (`x`: the rows' step key)."""
    pts = [(r[x], float(r[key])) for r in rows if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
    if not pts:
        return np.zeros(0), np.zeros(0)
    steps, values = zip(*pts)
    return np.array(steps), np.array(values)


def moving_average(values: np.ndarray, window: int) -> np.ndarray:
    """Mean of the last `window` values at each point (fewer at the start)."""
    csum = np.cumsum(np.insert(values, 0, 0.0))
    idx = np.arange(1, len(values) + 1)
    lo = np.maximum(0, idx - window)
    return (csum[idx] - csum[lo]) / (idx - lo)


def time_keys(rows: list[dict]) -> list[str]:
    """The `time/` metrics the run logged, in the order first seen."""
    return list(dict.fromkeys(k for r in rows for k in r if k.startswith("time/")))


def summary(rows: list[dict], evals: list[dict], window: int = 20) -> str:
    lines = [f"steps: {rows[0]['step']}..{rows[-1]['step']} ({len(rows)} logged)"]
    _, reward = series(rows, "reward/mean")
    if len(reward) >= 2:
        # the first and the last n steps never overlap: n is at most half the steps
        n = min(window, len(reward) // 2)
        first, last = reward[:n].mean(), reward[-n:].mean()
        lines.append(f"reward: first {n} steps {first:.4f}, last {n} steps {last:.4f} (change {last - first:+.4f})")
    elif len(reward):
        lines.append(f"reward: {reward[0]:.4f} (one step)")
    for key, name in SUMMARY:
        _, v = series(rows, key)
        if len(v):
            lines.append(f"{name}: mean {v.mean():.4g}, max {v.max():.4g}, last {v[-1]:.4g}")
    split = [(k.removeprefix("time/"), series(rows, k)[1]) for k in time_keys(rows)]
    if split := [(name, v.mean()) for name, v in split if len(v)]:
        lines.append("time per step (mean s): " + ", ".join(f"{name} {mean:.3g}" for name, mean in split))
    for e in evals:
        scores = ", ".join(f"{k.removeprefix('eval/')} {v:.3f}" for k, v in e.items() if "@" in k)
        lines.append(f"eval of policy {e['policy']}: {scores}")
    return "\n".join(lines) + "\n"


def write_report(run_dir: str | Path, window: int = 20) -> Path:
    """Write RUN_DIR/report/ (PNGs and summary.txt); returns the folder."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    rows = load_metrics(run_dir)
    evals_path = RunDir(run_dir).orchestrator_evals
    evals = read_jsonl(evals_path) if evals_path.exists() else []
    out = RunDir(run_dir).report
    out.mkdir(exist_ok=True)
    plots = [
        (name, title, [(label, *series(rows, key)) for key, label in keys], log_scale, "step")
        for name, title, keys, log_scale in PLOTS
    ]
    plots.append(
        (
            "time",
            "Where a step's time went (seconds)",
            [(k.removeprefix("time/"), *series(rows, k)) for k in time_keys(rows)],
            False,
            "step",
        )
    )
    if evals:  # x: the policy evaluated (steps trained)
        scores = list(dict.fromkeys(k for e in evals for k in e if k.startswith("eval/") and "@" in k))
        plots.append(
            (
                "evals",
                "Evals",
                [(k.removeprefix("eval/"), *series(evals, k, x="policy")) for k in scores],
                False,
                "policy (steps trained)",
            )
        )
    for name, title, drawn, log_scale, xlabel in plots:
        drawn = [d for d in drawn if len(d[1])]
        if not drawn:
            continue
        fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
        for label, steps, values in drawn:
            ax.plot(
                steps,
                values,
                label=label,
                alpha=0.5 if name == "reward" else 1.0,
                marker="o" if name == "evals" else None,
            )
            if name == "reward":
                ax.plot(steps, moving_average(values, window), label=f"moving average ({window} steps)", linewidth=2)
        if log_scale and all((v > 0).all() for _, _, v in drawn):
            ax.set_yscale("log")
        ax.set_title(title)
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
        if len(drawn) > 1 or name == "reward":
            ax.legend()
        fig.tight_layout()
        fig.savefig(out / f"{name}.png")
        plt.close(fig)
    (out / "summary.txt").write_text(summary(rows, evals, window))
    return out
