"""The run directory's contract: numbered step folders, how they are written, and which
checkpoint a restart resumes from. The trainer writes these folders, the orchestrator, the
inference servers and `primerl report`/`eval` read them; this module is the only place that
knows their names.

    run_dir/checkpoints/step_N/   DCP shards, rank{r}.pt, meta.json (written last)
    run_dir/weights/step_N/       HF-layout weights, primerl.json (written last, weights.py)
    run_dir/configs/rl.toml       the run's resolved config (`primerl rl`; a process's own share
                                  beside it: trainer.toml, orchestrator.toml, ...)
    run_dir/metrics.jsonl         the trainer's metrics, a line per step (or SFT's)
    run_dir/evals.jsonl           `primerl eval`'s results, a line per policy
    run_dir/orchestrator/         the orchestrator's metrics.jsonl, evals.jsonl, and samples
                                  of rollouts (rollouts.jsonl, the older half in rollouts.old.jsonl)
    run_dir/logs/NAME.log         each process's log (`primerl rl`, the servers)
    run_dir/slurm/                the rendered batch script, its setup file and its roles' logs
    run_dir/report/               `primerl report`'s plots and summary
    run_dir/cache/vllm/           vLLM's cache (compiled graphs)
    run_dir/wandb_run_id          the W&B run a resume continues

`RunDir(run_dir)` names each of these; every process and the Slurm renderer take them from it.

Step N is the trainer's N-th optimizer step counted from 0 (`step` in metrics.jsonl), so
`weights/step_N` holds the weights after N + 1 optimizer steps: the orchestrator serves them as
policy N + 1 (policy 0 being the model the run started from).

A folder is written as `.step_N.tmp` beside its final place and renamed by `publish` when
whole (`durable_rename`: fsynced before and after), so a `step_N` folder with its marker file
is complete. `prune` keeps the newest few.

Resuming. A checkpoint's `meta.json` holds the step, the world size, `data` (what the data
side needs, including the orchestrator's state) and `files`: the size of every other file in
the folder, taken after they were all written. `latest_checkpoint` walks the complete
checkpoints newest first and skips, with a warning naming the folder and the fault, any whose
`meta.json` does not parse or lacks a needed key, or whose files do not match `files`
(missing, or another size: a truncated shard). The trainer and the orchestrator both call it
on the same folders, so they pick the same checkpoint without talking to each other.
Checkpoints written before `files` existed are accepted unchecked. If checkpoints exist but
none is usable, it raises rather than let a run silently start again from scratch.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tomllib
from pathlib import Path

log = logging.getLogger("primerl.protocol")

CHECKPOINTS = "checkpoints"
WEIGHTS = "weights"
META = "meta.json"
"""A checkpoint's metadata and completion marker (the weights' marker is weights.MARKER)."""
REQUIRED = ("step", "world_size", "data")
"""The keys of meta.json that both sides of a resume need."""
PREFIX = "step_"
ORCHESTRATOR = "orchestrator"
"""The orchestrator's own files."""
ROLLOUTS = "rollouts.jsonl"
"""In ORCHESTRATOR: samples of the run's rollouts as text, one JSON object a line
(primerl_protocol.rollouts.RolloutSample), every `orchestrator.samples.interval` steps."""
ROLLOUTS_OLD = "rollouts.old.jsonl"
"""In ORCHESTRATOR: the previous ROLLOUTS file, moved aside when ROLLOUTS reached half of
`orchestrator.samples.max_mb` (the two together stay within it)."""
CONFIGS = "configs"
RUN_CONFIGS = ("rl", "trainer", "sft")
"""Files in configs/ that hold the run's [model], in the order they are looked for."""
METRICS = "metrics.jsonl"
EVALS = "evals.jsonl"
LOGS = "logs"
SLURM = "slurm"
WANDB_ID = "wandb_run_id"
"""The run's Weights & Biases run id (one line), so that a resume continues the same W&B run."""


class RunDir:
    """The paths of one run directory (the module's docstring says what each holds). Nothing is
    created by naming it."""

    def __init__(self, root: str | Path):
        self.root = Path(root)

    def __repr__(self) -> str:
        return f"RunDir({str(self.root)!r})"

    @property
    def checkpoints(self) -> Path:
        return self.root / CHECKPOINTS

    @property
    def weights(self) -> Path:
        return self.root / WEIGHTS

    @property
    def configs(self) -> Path:
        return self.root / CONFIGS

    def config(self, name: str) -> Path:
        """configs/NAME.toml: `rl` (the whole run's), `trainer`, `orchestrator`, `inference`, ..."""
        return self.configs / f"{name}.toml"

    @property
    def metrics(self) -> Path:
        return self.root / METRICS

    @property
    def evals(self) -> Path:
        """`primerl eval`'s results."""
        return self.root / EVALS

    @property
    def orchestrator(self) -> Path:
        return self.root / ORCHESTRATOR

    @property
    def orchestrator_metrics(self) -> Path:
        return self.orchestrator / METRICS

    @property
    def orchestrator_evals(self) -> Path:
        """The evals the orchestrator runs during RL (orchestrator.eval)."""
        return self.orchestrator / EVALS

    @property
    def logs(self) -> Path:
        return self.root / LOGS

    def log(self, name: str) -> Path:
        """logs/NAME.log: `trainer`, `orchestrator`, `inference-0`, ..."""
        return self.logs / f"{name}.log"

    @property
    def slurm(self) -> Path:
        return self.root / SLURM

    @property
    def report(self) -> Path:
        """`primerl report`'s plots and summary."""
        return self.root / "report"

    @property
    def vllm_cache(self) -> Path:
        return self.root / "cache" / "vllm"

    @property
    def wandb_id(self) -> Path:
        return self.root / WANDB_ID


def append_record(path: str | Path, record: dict) -> None:
    """One JSON line appended to a .jsonl file of the run (metrics, evals): the one way they are
    written."""
    with Path(path).open("a") as f:
        f.write(json.dumps(record) + "\n")


class CheckpointError(ValueError):
    """A run has checkpoints but none of them can be resumed from (says which and why)."""


def step_folder(root: str | Path, step: int) -> Path:
    """`root/step_N`, the final place of step N's folder."""
    return Path(root) / f"{PREFIX}{step}"


def staging_folder(root: str | Path, step: int) -> Path:
    """`root/.step_N.tmp`, where step N's folder is written before `publish`."""
    return Path(root) / f".{PREFIX}{step}.tmp"


def step_of(path: str | Path) -> int | None:
    """N for a folder named `step_N`, else None (staging folders, other files)."""
    digits = Path(path).name.removeprefix(PREFIX)
    if digits == Path(path).name or not (digits.isascii() and digits.isdigit()):
        return None
    return int(digits)


def complete_steps(root: str | Path, marker: str | None) -> list[tuple[int, Path]]:
    """(N, folder) of every `step_N` folder in `root` that holds `marker` (every one if
    None), oldest first."""
    out = []
    for folder in Path(root).glob(f"{PREFIX}*"):
        step = step_of(folder)
        if step is not None and (marker is None or (folder / marker).exists()):
            out.append((step, folder))
    return sorted(out)


def run_model(run_dir: str | Path) -> tuple[dict, Path]:
    """The [model] table of the config a run was started with (its RUN_CONFIGS, the first found)
    and the file it came from; ValueError naming what was looked for."""
    paths = RunDir(run_dir)
    folder = paths.configs
    for name in RUN_CONFIGS:
        path = paths.config(name)
        if path.is_file():
            try:
                model = tomllib.loads(path.read_text()).get("model")
            except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as err:
                raise ValueError(f"{path} cannot be read ({err})") from None
            if isinstance(model, dict):
                return model, path
    raise ValueError(
        f"{run_dir} has no run config with a [model] ({', '.join(n + '.toml' for n in RUN_CONFIGS)} in {folder}) to take the "
        "run's model from: set model.name"
    )


def publish(staging: str | Path, final: str | Path) -> None:
    """Put the finished `staging` folder in `final`'s place (replacing it), durably."""
    shutil.rmtree(final, ignore_errors=True)
    durable_rename(staging, final)


def prune(root: str | Path, keep: int, marker: str | None = None) -> list[Path]:
    """Remove all but the newest `keep` complete step folders (none if `keep` is 0);
    returns those removed."""
    old = [folder for _, folder in complete_steps(root, marker)[:-keep]] if keep else []
    for folder in old:
        shutil.rmtree(folder, ignore_errors=True)
    return old


def durable_rename(tmp: str | Path, final: str | Path) -> None:
    """Rename the finished folder `tmp` to `final` so that a crash (or a power cut) leaves
    either the old state or all of the new: every file and folder inside is fsynced before the
    rename, and the parent after it. Without it the rename can reach the disk before the
    files' data, and `final` is "complete" with empty files in it."""
    tmp, final = Path(tmp), Path(final)
    for folder, _, files in os.walk(tmp):
        for name in files:
            _fsync(Path(folder) / name, os.O_RDONLY)
        _fsync(Path(folder), os.O_RDONLY | os.O_DIRECTORY)
    tmp.rename(final)
    _fsync(final.parent, os.O_RDONLY | os.O_DIRECTORY)


def _fsync(path: Path, flags: int) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def manifest(folder: str | Path) -> dict[str, int]:
    """{relative path: size in bytes} of every file under `folder` but its meta.json."""
    folder = Path(folder)
    files = (p for p in folder.rglob("*") if p.is_file() and p != folder / META)
    return {p.relative_to(folder).as_posix(): _size(p) for p in sorted(files)}


def _size(path: Path) -> int:
    # Opened, not stat()ed: on NFS, opening revalidates the attributes (close-to-open), where
    # a stat of a file another node has just written can return a cached size.
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.fstat(fd).st_size
    finally:
        os.close(fd)


def write_meta(folder: str | Path, meta: dict) -> dict:
    """Write a checkpoint's meta.json with the manifest of the files already in `folder`;
    call it last, after every other file is written. Returns what was written."""
    meta = {**meta, "files": manifest(folder)}
    (Path(folder) / META).write_text(json.dumps(meta))
    return meta


def read_checkpoint(folder: str | Path) -> dict:
    """meta.json of a complete checkpoint folder after checking it against the folder;
    ValueError saying what is wrong."""
    folder = Path(folder)
    try:
        meta = json.loads((folder / META).read_text())
    except OSError as err:
        raise ValueError(f"{META} cannot be read ({err})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{META} is not JSON ({err})") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{META} is not a JSON object")
    if missing := [key for key in REQUIRED if key not in meta]:
        raise ValueError(f"{META} lacks {', '.join(missing)}")
    if meta["step"] != step_of(folder):
        raise ValueError(f"{META} says step {meta['step']!r}, the folder's name step {step_of(folder)}")
    files = meta.get("files")
    if files is None:  # written before checkpoints had a manifest: accepted as it is
        return meta
    if not isinstance(files, dict):
        raise ValueError(f"{META}: `files` is not an object")
    faults = []
    for name, size in files.items():
        path = folder / name
        if not path.is_file():
            faults.append(f"{name} is missing")
        elif (got := _size(path)) != size:
            faults.append(f"{name} has {got} bytes, not {size}")
    if faults:
        more = f" and {len(faults) - 3} more" if len(faults) > 3 else ""
        raise ValueError(f"files do not match {META}: {'; '.join(faults[:3])}{more}")
    return meta


def latest_checkpoint(run_dir: str | Path) -> tuple[Path, dict] | None:
    """(folder, meta.json) of the newest usable checkpoint, skipping unusable newer ones with
    a warning; None if the run has no complete checkpoint; CheckpointError if it has some but
    none is usable."""
    root = Path(run_dir) / CHECKPOINTS
    found = complete_steps(root, META)
    faults = []
    for _, folder in reversed(found):
        try:
            meta = read_checkpoint(folder)
        except ValueError as err:
            faults.append(f"{folder.name}: {err}")
            log.warning("checkpoint %s is not usable, trying the one before: %s", folder, err)
            continue
        if faults:
            log.warning("resuming from %s, the newest usable checkpoint", folder)
        return folder, meta
    if faults:
        raise CheckpointError(
            f"no checkpoint in {root} can be resumed from ({'; '.join(faults)}); refusing to start "
            f"again from scratch: repair one, or move {root} aside to start a fresh run"
        )
    return None
