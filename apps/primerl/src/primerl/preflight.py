"""Checks of what a launch needs from this machine, made before anything starts: the run
directory's path, the ports, the environments.

    check_run_dir(cfg.run_dir)                      # CheckError naming run_dir
    check_environments("envs.train", cfg.envs.train)
    cfg = with_ports(cfg)                           # unset ports chosen free, set ones checked

Ports: a port left unset in the config is chosen here, free (a bind test), below the kernel's
ephemeral range (a port from that range may be handed to any process's outgoing connection
before our server binds it), and written into the configs the run's processes read; a port
the config sets is bind-tested and refused naming its key when another process holds it. So
two runs on one machine get ports of their own without a word, and a busy port costs a second
instead of vLLM's 48 s start and traceback. The bind sets SO_REUSEADDR, as uvicorn and ZeroMQ
do: a port in TIME_WAIT after a run ended is free to them, so it is free here too.
"""

from __future__ import annotations

import os
import random
import socket
from pathlib import Path

import msgspec
from primerl_protocol.rundir import RunDir

from primerl.errors import CheckError


def check_run_dir(run_dir: str, key: str = "run_dir") -> Path:
    """`run_dir` as a Path, if it is (or can be made) a folder this process writes in; CheckError
    naming `key` otherwise. Creates nothing."""
    path = Path(run_dir).expanduser()
    if path.exists() and not path.is_dir():
        raise CheckError(
            f"{key} = {run_dir!r}: {path} is a file, not a folder; give a folder (it is created if missing)"
        )
    paths = RunDir(path)
    for sub in (paths.configs, paths.logs, paths.checkpoints, paths.weights):
        if sub.exists() and not sub.is_dir():
            raise CheckError(f"{key} = {run_dir!r}: {sub} is a file where the run keeps its {sub.name} folder")
    existing = path
    while not existing.exists():  # the nearest folder that exists is where it will be made
        existing = existing.parent
    if not existing.is_dir():
        raise CheckError(f"{key} = {run_dir!r}: {existing} is a file, so no folder can be made under it")
    if not os.access(existing, os.W_OK | os.X_OK):
        what = "write in it" if existing == path else f"create {path} in {existing}"
        raise CheckError(f"{key} = {run_dir!r}: no permission to {what}")
    return path


def check_environments(section: str, envs) -> None:
    """Load every environment of `section` (import, arguments, one task drawn): CheckError
    naming `section[i]` and what is wrong. Training environments need distinct names."""
    from primerl_envs.checks import check_environment
    from primerl_envs.environment import EnvLoadError

    names: dict[str, int] = {}
    for i, env in enumerate(envs):
        if section == "envs.train" and env.display_name in names:
            raise CheckError(
                f"{section}[{i}]: its name {env.display_name!r} is also {section}[{names[env.display_name]}]'s; "
                f"training environments need distinct names (set {section}[{i}].name)"
            )
        names[env.display_name] = i
        try:
            check_environment(env)
        except EnvLoadError as err:
            raise CheckError(f"{section}[{i}]: {err}") from None


def port_taken(host: str, port: int) -> OSError | None:
    """The error binding `host:port` gives (None: it is free now)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as err:
            return err
    return None


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_block(host: str, n: int, avoid: set[int] | frozenset[int] = frozenset()) -> int:
    """A port p such that p .. p + n - 1 are free on `host` now (and not in `avoid`)."""
    high = max(_ephemeral_low() - n, 10000 + n)
    rng = random.Random()
    for _ in range(500):
        base = rng.randrange(10000, high)
        block = range(base, base + n)
        if not avoid.intersection(block) and all(port_taken(host, p) is None for p in block):
            return base
    raise CheckError(f"no {n} consecutive free ports on {host} between 10000 and {high}")


def check_block(key: str, value: int, host: str, n: int, what: str, hint: str = "") -> None:
    """CheckError naming `key` when one of value .. value + n - 1 is taken on `host`."""
    hint = hint or f"leave {key} unset to have a free one chosen, or pick another"
    for i in range(n):
        if (err := port_taken(host, value + i)) is not None:
            which = f"port {value + i} ({what} {i})" if n > 1 else f"port {value}"
            raise CheckError(
                f"{key} = {value}: {which} on {host} is taken ({err.strerror or err}): another process "
                f"(another run?) listens there; {hint}"
            )


def with_ports(cfg, inference: bool = True, transport: bool = True):
    """`cfg` with its unset ports chosen free and its set ones checked (CheckError naming the
    key). `inference`: the servers' ports (inference.port + i for each replica); `transport`:
    the orchestrator's sockets (transport.policy_port, transport.batch_port + r for each rank)."""
    taken: dict[int, str] = {}

    def claim(key: str, first: int, n: int) -> None:
        for p in range(first, first + n):
            if p in taken:
                raise CheckError(f"{key} = {first} uses port {p}, which {taken[p]} uses too; give them apart")
            taken[p] = key

    inf = cfg.inference
    if inference:
        n = inf.num_replicas
        if inf.port is None:
            inf = msgspec.structs.replace(inf, port=free_block(inf.host, n))
        else:
            check_block("inference.port", inf.port, inf.host, n, "replica")
        claim("inference.port", inf.port, n)
    t = cfg.transport
    if transport:
        ranks = t.ranks
        if t.policy_port is None:
            t = msgspec.structs.replace(t, policy_port=free_block(t.host, 1, set(taken)))
        else:
            check_block("transport.policy_port", t.policy_port, t.host, 1, "")
        claim("transport.policy_port", t.policy_port, 1)
        if t.batch_port is None:
            t = msgspec.structs.replace(t, batch_port=free_block(t.host, ranks, set(taken)))
        else:
            check_block("transport.batch_port", t.batch_port, t.host, ranks, "trainer rank")
        claim("transport.batch_port", t.batch_port, ranks)
    changes = {"inference": inf} | ({"transport": t} if hasattr(cfg, "transport") else {})
    return msgspec.structs.replace(cfg, **changes)
