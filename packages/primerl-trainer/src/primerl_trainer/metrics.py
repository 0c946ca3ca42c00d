"""Per-step metrics: one console line, `run_dir/metrics.jsonl`, and Weights & Biases.

Every few steps the orchestrator's batch carries some of its rollouts as text (RolloutSample):
they become the step's W&B `samples` table (the same rows are in run_dir/orchestrator/rollouts.jsonl).

W&B runs offline (files under `run_dir/wandb`) unless an API key is configured or the config
asks for online; `mode = "disabled"` turns it off. Only rank 0 logs. A run directory is one W&B
run: its id is kept in the run directory (rundir.WANDB_ID) and a resume continues it. Its config
is the whole run's resolved config (`configs/rl.toml`, written by `primerl rl`) where there is
one, else this process's; secrets (the admin token, the sockets' CURVE keys) never reach it.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import tomllib
from pathlib import Path
from typing import TYPE_CHECKING, Literal, overload

from primerl_protocol.rundir import RunDir, append_record

if TYPE_CHECKING:
    from primerl_protocol.config import WandbConfig

log = logging.getLogger("primerl.trainer")

NAMESPACES = (
    "trainer",
    "moe",
    "time",
    "reward",
    "metric",
    "rollouts",
    "filter",
    "off_policy",
    "batch",
    "policy",
    "servers",
    "eval",
)
"""Every metric is `<namespace>/<name>` (docs/metrics.md): the trainer's step (`trainer/`), the
experts' load (`moe/`), the step's time split in seconds, trainer and orchestrator (`time/`), the
environments' rewards and metrics (`reward/`, `metric/`) and the orchestrator's rollouts, filters,
off-policy level, batch, policy version and servers, and the online evals (`eval/`, on the step
after the eval finished; also in orchestrator/evals.jsonl)."""


def namespaced(metrics: dict) -> dict:
    """`metrics` with the trainer's own keys, computed without a namespace (`loss`,
    `grad_norm`, the loss's metrics), under `trainer/`; keys that have one are kept."""
    return {k if "/" in k else f"trainer/{k}": v for k, v in metrics.items()}


# Shown on the console, in this order, with these formats (everything goes to the files).
CONSOLE = [
    ("trainer/loss", "loss {:.4f}"),
    ("trainer/mismatch_kl", "kl {:.2e}"),
    ("trainer/entropy", "ent {:.3f}"),
    ("trainer/grad_norm", "grad {:.3f}"),
    ("trainer/lr", "lr {:.2e}"),
    ("trainer/tokens_per_s", "{:,.0f} tok/s"),
    ("trainer/mfu", "mfu {:.1%}"),
    ("trainer/peak_mem_gib", "mem {:.1f}G"),
]
TIMES = ("time/data", "time/fwd_bwd", "time/optimizer", "time/publish")
"""The trainer's part of the step's time split, shown on its console line."""


def _wandb_mode(mode: Literal["auto", "online", "offline", "disabled"]) -> Literal["online", "offline", "disabled"]:
    if mode != "auto":
        return mode
    has_key = (
        bool(os.environ.get("WANDB_API_KEY"))
        or (Path.home() / ".netrc").exists()
        and "api.wandb.ai" in (Path.home() / ".netrc").read_text()
    )
    return "online" if has_key else "offline"


SECRETS = ("admin_token", "curve")
"""Config keys whose values are credentials, wherever they sit."""


@overload
def redacted(config: dict) -> dict: ...
@overload
def redacted(config: object) -> object: ...
def redacted(config: object) -> object:
    """`config` with the value of every key in SECRETS (at any depth) replaced by "<redacted>"."""
    if isinstance(config, dict):
        return {k: ("<redacted>" if k in SECRETS and v is not None else redacted(v)) for k, v in config.items()}
    if isinstance(config, list):
        return [redacted(v) for v in config]
    return config


def run_config(run_dir: Path, own: dict) -> dict:
    """What W&B shows as the run's config: `primerl rl`'s resolved config of the whole run if
    the run directory has one (the trainer's own section is part of it), else `own`; redacted."""
    whole = RunDir(run_dir).config("rl")
    if whole.is_file():
        try:
            return redacted(tomllib.loads(whole.read_text()))
        except (OSError, tomllib.TOMLDecodeError) as err:
            log.warning("W&B gets the trainer's config only: %s cannot be read (%s)", whole, err)
    return redacted(own)


def run_id(run_dir: Path) -> str:
    """This run directory's W&B run id, made (and kept in the run directory) on first use."""
    path = RunDir(run_dir).wandb_id
    if path.is_file() and (kept := path.read_text().strip()):
        return kept
    run_dir.mkdir(parents=True, exist_ok=True)
    made = secrets.token_hex(4)
    path.write_text(made + "\n")
    return made


SAMPLE_COLUMNS = (
    "step",
    "policy_step",
    "env",
    "group_id",
    "sample_id",
    "prompt",
    "completion",
    "reward",
    "rewards",
    "advantage",
    "error",
    "truncated",
    "completion_tokens",
)
"""Columns of the W&B samples table (primerl_protocol.rollouts.RolloutSample's fields; `rewards` as JSON)."""


def samples_table(samples: list):
    """A wandb.Table of RolloutSamples, one row each."""
    import wandb

    rows = [[json.dumps(s.rewards) if c == "rewards" else getattr(s, c) for c in SAMPLE_COLUMNS] for s in samples]
    return wandb.Table(columns=list(SAMPLE_COLUMNS), data=rows)


class MetricsLogger:
    def __init__(
        self, run_dir: str | Path, wandb_cfg: WandbConfig, config_dict: dict, is_main: bool, job: str = "trainer"
    ):
        self.is_main = is_main
        self.path = RunDir(run_dir).metrics
        self.run = None
        if not is_main:
            return
        mode = _wandb_mode(wandb_cfg.mode)
        if mode != "disabled":
            import wandb

            run_dir = Path(run_dir)
            self.run = wandb.init(
                project=wandb_cfg.project,
                name=wandb_cfg.name or run_dir.resolve().name,
                tags=wandb_cfg.tags,
                dir=str(run_dir),
                mode=mode,
                config=run_config(run_dir, config_dict),
                job_type=job,
                id=run_id(run_dir),
                resume="allow",  # a resumed run continues its W&B run
            )

    def log(self, step: int, metrics: dict[str, float | None], samples: list | None = None) -> None:
        """One step's metrics (None values left out, see `namespaced`); `samples` (the orchestrator's RolloutSamples, every few steps)
        become the W&B `samples` table of that step."""
        if not self.is_main:
            return
        metrics = namespaced({k: v for k, v in metrics.items() if v is not None})
        line = " | ".join(fmt.format(metrics[k]) for k, fmt in CONSOLE if metrics.get(k) is not None)
        times = " ".join(f"{k[5:]} {metrics[k]:.2f}s" for k in TIMES if k in metrics)
        log.info("step %d | %s | %s", step, line, times)
        append_record(self.path, {"step": step, **metrics})
        if self.run is not None:
            self.run.log({**metrics, **({"samples": samples_table(samples)} if samples else {})}, step=step)

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
