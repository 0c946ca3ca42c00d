"""Per-step metrics: one console line, `run_dir/metrics.jsonl`, and Weights & Biases.

W&B runs offline (files under `run_dir/wandb`) unless an API key is configured or the config
asks for online; `mode = "disabled"` turns it off. Only rank 0 logs.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

log = logging.getLogger("primerl.trainer")

# Shown on the console, in this order, with these formats (everything goes to the files).
CONSOLE = [
    ("loss", "loss {:.4f}"), ("mismatch_kl", "kl {:.2e}"), ("entropy", "ent {:.3f}"),
    ("grad_norm", "grad {:.3f}"), ("lr", "lr {:.2e}"), ("tokens_per_s", "{:,.0f} tok/s"),
    ("mfu", "mfu {:.1%}"), ("peak_mem_gib", "mem {:.1f}G"),
]


def _wandb_mode(mode: str) -> str:
    if mode != "auto":
        return mode
    has_key = bool(os.environ.get("WANDB_API_KEY")) or (Path.home() / ".netrc").exists() and "api.wandb.ai" in (Path.home() / ".netrc").read_text()
    return "online" if has_key else "offline"


class MetricsLogger:
    def __init__(self, run_dir: str | Path, wandb_cfg, config_dict: dict, is_main: bool, job: str = "trainer"):
        self.is_main = is_main
        self.path = Path(run_dir) / "metrics.jsonl"
        self.run = None
        if not is_main:
            return
        mode = _wandb_mode(wandb_cfg.mode)
        if mode != "disabled":
            import wandb

            self.run = wandb.init(
                project=wandb_cfg.project,
                name=wandb_cfg.name or Path(run_dir).resolve().name,
                tags=wandb_cfg.tags,
                dir=str(run_dir),
                mode=mode,
                config=config_dict,
                job_type=job,
                resume="allow",
            )

    def log(self, step: int, metrics: dict[str, float | None]) -> None:
        if not self.is_main:
            return
        metrics = {k: v for k, v in metrics.items() if v is not None}
        line = " | ".join(fmt.format(metrics[k]) for k, fmt in CONSOLE if metrics.get(k) is not None)
        times = " ".join(f"{k[5:]} {v:.2f}s" for k, v in metrics.items() if k.startswith("time_"))
        log.info("step %d | %s | %s", step, line, times)
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")
        if self.run is not None:
            self.run.log(metrics, step=step)

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
