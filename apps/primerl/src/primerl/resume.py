"""One `primerl rl` per run directory, and what a resume may change.

    with RunLock(run_dir) as lock:                       # CheckError naming the live run holding it
        plan = plan_resume(new_cfg, user_cfg, run_dir)  # CheckError naming every setting that breaks it
        plan.announce()                                 # "resuming from step N (checkpoint ...)"
        plan.keep_previous()                            # configs/rl.toml -> configs/rl.prev.toml
        ... write configs/rl.toml, start the processes ...

The lock is `run_dir/primerl.lock`: an flock held while `primerl rl` runs (the kernel drops it
when the process dies, however it dies) and a record of its holder (PID, host, process start
time, command). A second `primerl rl` on the directory is refused, naming the holder, before it
writes anything. A record left by a holder that is gone (no process of that PID, or another
process that got its PID since) on this host is taken over, saying so; one from another host is
refused, since its liveness cannot be told from here (delete the file when that run has ended).

Resuming: the trainer continues from the newest usable checkpoint and the orchestrator from
the state saved in it. Some settings are part of what that checkpoint and that state mean, and
a resume that changes them does not continue the run, it corrupts it; those are refused, each
changed key named (old -> new), and nothing in the run directory is touched. Every other
change is allowed and printed. The comparison is with `configs/rl.toml`, the resolved config
the run last started with (no breaking change ever gets past this check, so it has the same
breaking settings as every checkpoint in the directory).
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from primerl_protocol import rundir
from primerl_protocol.config import to_toml

from primerl.errors import CheckError

LOCK = "primerl.lock"
PREVIOUS = "rl.prev"
"""configs/rl.prev.toml: the run's config as it was last started, beside the new one."""

BREAKING = {
    "model": "the checkpoint holds this model's weights, trained on this tokenizer's token ids",
    "seed": "each environment's task order is shuffled with it: the saved task positions would point at other "
    "tasks (some trained twice, some never)",
    "orchestrator.group_size": "sample ids are group id x group_size + i: new groups would reuse the ids of trained "
    "samples, and the groups the saved state runs again were started with the old size",
    "trainer.lora": "the checkpoint's trained tensors and optimizer state are these adapters (and alpha scales them "
    "into the policy)",
    "trainer.freeze_vision": "which parameters train: the optimizer state saved is for the old set",
    "envs.train": "the saved task position of each environment, and the mix's state, belong to these environments, "
    "in this order, with these arguments",
}
"""Settings a resume must keep (a key or the table under it), with why. Allowed and printed:
everything else, e.g. the learning rate and its schedule (the trainer applies the configured
optimizer settings over the checkpoint's), max_steps, batch_size (groups per step; nothing
saved depends on it), max_async_level, sampling, loss, filters, seq_len (no saved state holds
it: rows are packed per step), the trainer's ranks and layout (DCP reshards the checkpoint),
inference, logging, envs.eval, and an environment's weight, mode, harness and limits."""
ALLOWED_IN_BREAKING = {"trainer.lora.dropout", "trainer.lora.publish"}
ENV_KEYS_THAT_BREAK = ("id", "name", "args")
SECRETS = ("inference.admin_token", "transport.sockets.curve")
CHOSEN = ("inference.port", "transport.policy_port", "transport.batch_port")
"""Keys the launcher fills when the config leaves them unset (free ports)."""


# -- the lock ------------------------------------------------------------------------------


def _start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22), to tell it
    from a later process that got the same PID."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return int(stat[stat.rindex(")") + 2 :].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _alive(pid: int, ticks: int | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        pass
    return ticks is None or _start_ticks(pid) in (None, ticks)


def _describe(holder: dict) -> str:
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("started", 0)))
    return f"pid {holder.get('pid')} on host {holder.get('host')} (since {since}: {holder.get('command', '?')})"


class RunLock:
    """`run_dir/primerl.lock`, held from `acquire` to `release` (see the module's docstring)."""

    def __init__(self, run_dir: str | Path) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK
        self.fd: int | None = None
        self.created = False
        self.took_over: str | None = None
        """What was taken over (a stale holder, described), for the console."""

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def _read(self, fd: int) -> dict:
        os.lseek(fd, 0, os.SEEK_SET)
        raw = os.read(fd, 65536)
        try:
            holder = json.loads(raw) if raw.strip() else {}
        except ValueError:
            holder = {"pid": "?", "host": "?", "command": f"unreadable record {raw[:80]!r}"}
        return holder if isinstance(holder, dict) else {}

    def acquire(self) -> None:
        where = f"run_dir = {str(self.run_dir)!r}"
        self.created = not self.run_dir.exists()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise CheckError(
                    f"{where}: another `primerl rl` runs on it: {_describe(self._read(fd))}; stop it "
                    "first (Ctrl-C in its terminal, or kill that pid), or use another run_dir"
                ) from None
            holder = self._read(fd)
            if holder:
                host = socket.gethostname()
                if holder.get("host") != host:
                    raise CheckError(
                        f"{where}: its lock {self.path} names {_describe(holder)}, another host: whether "
                        f"that run still runs cannot be told from {host}; if it has ended, delete {self.path}"
                    )
                if isinstance(holder.get("pid"), int) and _alive(holder["pid"], holder.get("ticks")):
                    raise CheckError(
                        f"{where}: another `primerl rl` runs on it: {_describe(holder)} (its lock is "
                        f"{self.path}); stop it first, or use another run_dir"
                    )
                self.took_over = _describe(holder)
            record = {
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "started": time.time(),
                "ticks": _start_ticks(os.getpid()),
                "command": " ".join(sys.argv)[:300],
            }
            os.ftruncate(fd, 0)
            os.lseek(fd, 0, os.SEEK_SET)
            os.write(fd, json.dumps(record).encode())
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            self._drop_if_fresh()
            raise
        self.fd = fd

    def release(self) -> None:
        """Empty the record (a clean end leaves no holder) and drop the lock; a run directory this
        lock created and nothing else wrote in is removed again."""
        if self.fd is None:
            return
        try:
            os.ftruncate(self.fd, 0)
        finally:
            os.close(self.fd)  # drops the flock
            self.fd = None
        self._drop_if_fresh()

    def _drop_if_fresh(self) -> None:
        if self.created and [p.name for p in self.run_dir.iterdir()] in ([LOCK], []):
            self.path.unlink(missing_ok=True)
            self.run_dir.rmdir()


# -- what a resume may change ----------------------------------------------------------------


def flatten(table: dict, prefix: str = "") -> dict[str, object]:
    """{"a.b": value} for every leaf of a TOML table; arrays of tables as "a[0].b"."""
    out: dict[str, object] = {}
    for key, value in table.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, name + "."))
        elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            out[name] = f"{len(value)} entries"
            for i, v in enumerate(value):
                out.update(flatten(v, f"{name}[{i}]."))
        else:
            out[name] = value
    return out


def breaking_reason(key: str) -> str | None:
    """Why changing `key` breaks a resume (None: it does not)."""
    if key in ALLOWED_IN_BREAKING:
        return None
    if key.startswith("envs.train"):
        rest = key.removeprefix("envs.train")
        if rest and rest.startswith("["):  # envs.train[i].field...
            sub = rest.split("].", 1)[1] if "]." in rest else ""
            if sub.split(".")[0] not in ENV_KEYS_THAT_BREAK:
                return None
        return BREAKING["envs.train"]
    for prefix, why in BREAKING.items():
        if key == prefix or key.startswith(prefix + "."):
            return why
    return None


def _shown(value: object) -> str:
    return "(unset)" if value is None else repr(value) if isinstance(value, str) else str(value)


def changes(old: dict, new: dict, chosen: set[str]) -> list[tuple[str, object, object]]:
    """(key, old, new) of every setting that differs, secrets and launcher-chosen keys left out."""
    a, b = flatten(old), flatten(new)
    out = []
    for key in sorted(set(a) | set(b)):
        if key.startswith(SECRETS) or key in chosen or a.get(key) == b.get(key):
            continue
        out.append((key, a.get(key), b.get(key)))
    return out


@dataclass
class ResumePlan:
    run_dir: Path
    checkpoint: tuple[Path, dict] | None
    allowed: list[tuple[str, object, object]] = field(default_factory=list)
    note: str | None = None
    max_steps: int | None = None

    def announce(self) -> None:
        if self.note:
            print(self.note, flush=True)
        if self.checkpoint is not None:
            folder, meta = self.checkpoint
            print(
                f"resuming from step {meta['step']} (checkpoint {folder}): the trainer continues at step "
                f"{meta['step'] + 1}, the orchestrator from the data positions saved with it",
                flush=True,
            )
            if self.max_steps is not None and meta["step"] + 1 >= self.max_steps:
                print(
                    f"the run is complete (max_steps = {self.max_steps}): nothing will be trained; raise max_steps "
                    "to train further",
                    flush=True,
                )
        if self.allowed:
            print("settings changed since the run last started (allowed):", flush=True)
            for key, a, b in self.allowed:
                print(f"  {key}: {_shown(a)} -> {_shown(b)}", flush=True)

    def keep_previous(self) -> None:
        """Move the previous run's resolved config aside (configs/rl.prev.toml) before the new one
        is written: what the run was started with last time stays readable."""
        paths = rundir.RunDir(self.run_dir)
        if paths.config("rl").is_file():
            os.replace(paths.config("rl"), paths.config(PREVIOUS))


def plan_resume(cfg, user_cfg, run_dir: str | Path) -> ResumePlan:
    """What starting `cfg` (resolved: the config to be written) on `run_dir` means: a fresh run,
    or a resume from its newest usable checkpoint. CheckError naming every changed key that
    breaks the resume (old -> new), or when the run has checkpoints but none is usable. Writes
    nothing. `user_cfg`: the config as given, to tell which ports the launcher chose."""
    run_dir = Path(run_dir)
    try:
        found = rundir.latest_checkpoint(run_dir)
    except rundir.CheckpointError as err:
        raise CheckError(f"run_dir = {str(run_dir)!r}: {err}") from None
    previous = rundir.RunDir(run_dir).config("rl")
    plan = ResumePlan(run_dir, found, max_steps=cfg.max_steps)
    if not previous.is_file():
        if found is not None:
            plan.note = (
                f"warning: {previous} is missing, so this resume's settings cannot be checked against "
                "the run's (the model, the environments and their order must be the same)"
            )
        return plan
    try:
        old = tomllib.loads(previous.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as err:
        plan.note = f"warning: {previous} cannot be read ({err}); this resume's settings are not checked"
        return plan
    chosen = {key for key in CHOSEN if _get(user_cfg, key) is None}
    diff = changes(old, tomllib.loads(to_toml(cfg)), chosen)
    if found is None:
        plan.allowed = diff  # nothing to resume: any change is a fresh start
        plan.note = f"no checkpoint in {rundir.RunDir(run_dir).checkpoints}: the run starts at step 0"
        return plan
    broken = [(k, a, b, why) for k, a, b in diff if (why := breaking_reason(k)) is not None]
    if broken:
        folder, meta = found
        lines = "\n".join(f"  {k}: {_shown(a)} -> {_shown(b)}  ({why})" for k, a, b, why in broken)
        raise CheckError(
            f"run_dir = {str(run_dir)!r} holds a run to resume (checkpoint {folder}, step {meta['step']}), and these "
            f"settings differ from the ones it ran with ({previous}), which a resume cannot change:\n{lines}\n"
            "Put them back to resume, or give another run_dir to start a new run (nothing in this one was changed)"
        )
    plan.allowed = diff
    return plan


def _get(cfg, dotted: str):
    value = cfg
    for part in dotted.split("."):
        value = getattr(value, part, None)
    return value
