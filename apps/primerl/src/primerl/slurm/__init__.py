"""`primerl rl|sft|eval --slurm`: the sbatch job that runs a config on a Slurm cluster.

    primerl rl @ run.toml --slurm            # writes RUN_DIR/slurm/rl.sbatch and the role configs
    primerl rl @ run.toml --slurm --submit   # ... and submits it with sbatch

The job runs the processes `primerl rl` runs on one machine, as one `srun` step per role
(templates beside this file, also in infra/slurm/): inference nodes with one `primerl-inference`
(its servers) each, trainer nodes with torchrun over a c10d rendezvous, the orchestrator on the
first trainer node. Addresses are passed at run time from the job's node list. The first role
that fails ends the job with that role's exit status, its log path and last lines in the job's
output (`slurm.log_dir`/job-<id>.out); every other role is stopped first.

Placement on GPU nodes (`_placement`): inference and trainer on nodes of their own; or, with
`trainer_gpus` (GPU indices of each node), on the same nodes, the trainer on those GPUs and the
servers on the rest; or with `colocate = true` on the same GPUs, the trainer on `trainer_gpus`
(default: all). Every step is given all the node's GPUs (`--gres`), so that each role's indices
are the node's; the trainer's CUDA_VISIBLE_DEVICES is set on its command, the servers' through
`inference.gpus` in their config. vLLM's memory share is resolved here (primerl.plan.with_vllm_share).

Paths in the config must be on a file system every node sees (run_dir, model, weights).
"""

from __future__ import annotations

import re
import secrets
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import msgspec
from primerl_protocol.config import to_toml, write_private
from primerl_protocol.rundir import RunDir

HERE = Path(__file__).resolve().parent
PLACEHOLDER = re.compile(r"\{\{(\w+)\}\}")


class SlurmError(RuntimeError):
    """The config cannot be laid out on the cluster as asked (names the keys), or sbatch failed."""


def fill(template: str, values: dict[str, object]) -> str:
    """Replace every {{name}}; a placeholder without a value is an error, not left in the script."""
    missing = sorted({m for m in PLACEHOLDER.findall(template) if m not in values})
    if missing:
        raise SlurmError(f"template placeholders without a value: {missing}")
    return PLACEHOLDER.sub(lambda m: str(values[m.group(1)]), template)


def _sbatch_lines(s, gpus_per_node: int) -> str:
    lines = []
    if s.partition:
        lines.append(f"#SBATCH --partition={s.partition}")
    if s.account:
        lines.append(f"#SBATCH --account={s.account}")
    if gpus_per_node:
        lines.append(f"#SBATCH --gpus-per-node={gpus_per_node}")
    if s.exclusive:
        lines.append("#SBATCH --exclusive")
    lines += [f"#SBATCH {arg}" for arg in s.sbatch_args]
    return "\n".join(lines)


def _srun_args(s, gpus: int) -> str:
    args = [f"--gres=gpu:{gpus}"] if gpus else []
    if s.container_image:
        args.append(f"--container-image={shlex.quote(s.container_image)}")
        if s.container_mounts:
            args.append(f"--container-mounts={shlex.quote(','.join(s.container_mounts))}")
    return " ".join(args)


def _write_setup(s, folder: Path) -> Path:
    """slurm.setup as a file; without one, the environment this job was rendered from (its
    bin folder first on PATH: right when it sits on the shared file system)."""
    path = folder / "setup.sh"
    body = s.setup or f'export PATH={shlex.quote(str(Path(sys.executable).parent))}:"$PATH"'
    path.write_text("# slurm.setup: sourced by the job and before every role, on every node\n" + body + "\n")
    return path


def _common(cfg, kind: str) -> tuple[Path, dict[str, object]]:
    s = cfg.slurm
    run_dir = Path(cfg.run_dir).resolve()
    folder = RunDir(run_dir).slurm
    folder.mkdir(parents=True, exist_ok=True)
    RunDir(run_dir).configs.mkdir(exist_ok=True)
    log_dir = Path(s.log_dir).resolve() if s.log_dir else folder
    log_dir.mkdir(parents=True, exist_ok=True)  # sbatch opens the job's output there
    values = {
        "run_dir": shlex.quote(str(run_dir)),
        "configs_dir": shlex.quote(str(RunDir(run_dir).configs)),
        "log_dir": str(log_dir),
        "setup_file": shlex.quote(str(_write_setup(s, folder))),
        "job_name": s.job_name or f"primerl-{kind}-{run_dir.name}",
        "time": s.time,
        "rdzv_port": s.rendezvous_port,
        "server_timeout_s": s.server_timeout_s,
        "roles_lib": (HERE / "roles.sh").read_text(),
    }
    return folder, values


def _ranks_per_node(cfg, nodes: int, ranks: int | None, key: str, gpus: list[int] | None = None) -> int:
    """Ranks of torchrun on each trainer node: one per GPU (of `gpus`, the trainer's GPUs of each
    node, when given), or `ranks` split evenly over CPU nodes (unset: one per node). A set
    `ranks` must be the job's count (SlurmError)."""
    s = cfg.slurm
    if gpus is not None:
        if ranks is not None and ranks != nodes * len(gpus):
            raise SlurmError(
                f"{key} = {ranks}, but slurm.trainer_nodes x len(trainer_gpus) = {nodes} x {len(gpus)} "
                f"= {nodes * len(gpus)}: the trainer runs one rank per GPU of trainer_gpus = {gpus} on each of its nodes"
            )
        return len(gpus)
    if ranks is None:
        return s.gpus_per_node or 1
    if s.gpus_per_node:
        if ranks != nodes * s.gpus_per_node:
            raise SlurmError(
                f"{key} = {ranks}, but slurm.trainer_nodes x slurm.gpus_per_node = {nodes} x {s.gpus_per_node} "
                f"= {nodes * s.gpus_per_node}: the trainer runs one rank per GPU of its nodes"
            )
        return s.gpus_per_node
    if ranks % nodes:
        raise SlurmError(f"{key} = {ranks} does not split evenly over slurm.trainer_nodes = {nodes}")
    return ranks // nodes


def _inference_per_node(cfg) -> int:
    s, inf = cfg.slurm, cfg.inference
    if s.gpus_per_node and inf.num_replicas * inf.gpus_per_replica > s.gpus_per_node:
        raise SlurmError(
            f"inference.num_replicas x GPUs per replica = {inf.num_replicas} x {inf.gpus_per_replica} servers' GPUs "
            f"per node, but slurm.gpus_per_node = {s.gpus_per_node}"
        )
    return inf.num_replicas


def _node_gpus(key: str, gpus: list[int], per_node: int) -> None:
    """`gpus` (the value of `key`) name distinct GPUs of a node of `per_node` (SlurmError)."""
    if not gpus:
        raise SlurmError(f"{key} = []: list the GPUs of each node it uses, or leave it unset")
    if bad := [g for g in gpus if not 0 <= g < per_node]:
        raise SlurmError(
            f"{key} = {gpus} names GPU {bad[0]}, but slurm.gpus_per_node = {per_node}: "
            f"a node's GPUs are 0 to {per_node - 1}"
        )
    if twice := sorted({g for g in gpus if gpus.count(g) > 1}):
        raise SlurmError(f"{key} = {gpus} names GPU {twice[0]} more than once: each GPU once")


@dataclass
class Placement:
    """Where the RL job's roles run on each node."""

    shared_nodes: bool
    """Inference and trainer on the same nodes (colocate, or trainer_gpus splitting each node)."""
    trainer_gpus: list[int] | None
    """The trainer's GPUs of each node (None: all of them, or CPU nodes)."""
    inference_gpus: list[int] | None
    """The servers' GPUs of each node (None: inference.gpus, or the first ones: the launcher's)."""


def _placement(cfg) -> Placement:
    """The roles' nodes and GPUs from colocate, trainer_gpus, inference.gpus and slurm.*; what
    does not fit a node is a SlurmError naming the keys. On CPU nodes trainer_gpus is ignored."""
    s, inf = cfg.slurm, cfg.inference
    if not s.gpus_per_node:
        return Placement(cfg.colocate, None, None)
    if inf.gpus is not None:
        _node_gpus("inference.gpus", list(inf.gpus), s.gpus_per_node)
    if cfg.trainer_gpus is None:
        return Placement(cfg.colocate, None, None)
    trainer = list(cfg.trainer_gpus)
    _node_gpus("trainer_gpus", trainer, s.gpus_per_node)
    if cfg.colocate:  # the servers keep every GPU (or inference.gpus); the trainer shares trainer_gpus of them
        return Placement(True, trainer, None)
    left = [g for g in range(s.gpus_per_node) if g not in trainer]
    need = inf.num_replicas * inf.gpus_per_replica
    if inf.gpus is not None:
        if both := sorted(set(inf.gpus) & set(trainer)):
            raise SlurmError(
                f"inference.gpus = {inf.gpus} and trainer_gpus = {trainer} both name GPU {both[0]}: without "
                f"colocate = true each GPU of a node is the servers' or the trainer's"
            )
        return Placement(True, trainer, list(inf.gpus))
    if need > len(left):
        raise SlurmError(
            f"inference.num_replicas x GPUs per replica = {inf.num_replicas} x {inf.gpus_per_replica} = {need} GPUs "
            f"per node, but trainer_gpus = {trainer} leaves {len(left)} of slurm.gpus_per_node = {s.gpus_per_node} "
            f"to the servers: fewer servers or trainer GPUs, or colocate = true to share them"
        )
    return Placement(True, trainer, left[:need])


def _placement_line(cfg, place: Placement) -> str:
    """What the job's header says about GPUs."""
    if not cfg.slurm.gpus_per_node:
        return "none (CPU nodes)"
    trainer = ",".join(map(str, place.trainer_gpus)) if place.trainer_gpus else "all"
    share = f"vLLM's gpu_memory_utilization {cfg.inference.gpu_memory_utilization}"
    if cfg.colocate:
        return f"inference and trainer share the nodes' GPUs (colocate), the trainer's: {trainer}; {share}"
    if place.shared_nodes:
        servers = ",".join(map(str, place.inference_gpus or []))
        return f"each node split: inference on GPUs {servers}, trainer on GPUs {trainer}; {share}"
    return f"inference and trainer on nodes of their own; {share}"


def _with_token(cfg):
    token = cfg.inference.resolved_admin_token() or secrets.token_hex(16)
    return msgspec.structs.replace(cfg, inference=msgspec.structs.replace(cfg.inference, admin_token=token))


def _render(cfg, kind: str, roles: dict[str, type | None], values: dict[str, object]) -> Path:
    """Write RUN_DIR/configs/<name>.toml for each role (its projection of `cfg`; None: all of
    it) and RUN_DIR/slurm/<kind>.sbatch; returns the script."""
    folder, common = _common(cfg, kind)
    paths = RunDir(Path(cfg.run_dir).resolve())
    for name, root in roles.items():
        write_private(paths.config(name), to_toml(cfg if root is None else cfg.project(root)))
    script = folder / f"{kind}.sbatch"
    script.write_text(fill((HERE / f"{kind}.sbatch").read_text(), common | values))
    return script


def _inference_values(cfg) -> dict[str, object]:
    s = cfg.slurm
    if s.inference_nodes < 1:
        raise SlurmError("slurm.inference_nodes must be at least 1 for a job with inference servers")
    return {
        "inference_nodes": s.inference_nodes,
        "replicas_per_node": _inference_per_node(cfg),
        "inference_port": cfg.inference.base_port,
        "inference_srun": _srun_args(s, s.gpus_per_node),
    }


def _trainer_values(cfg, gpus: list[int] | None = None) -> dict[str, object]:
    """The trainer's step; `gpus`: its GPUs of each node (None: all of them)."""
    s = cfg.slurm
    ranks = _ranks_per_node(cfg, s.trainer_nodes, cfg.transport.trainer_ranks, "transport.trainer_ranks", gpus)
    return {
        "trainer_nodes": s.trainer_nodes,
        "ranks_per_node": ranks,
        "trainer_srun": _srun_args(s, s.gpus_per_node),  # all the node's GPUs: the indices are the node's
        "trainer_env": f"env CUDA_VISIBLE_DEVICES={','.join(map(str, gpus))} " if gpus is not None else "",
    }


def render_rl(cfg) -> Path:
    """RUN_DIR/slurm/rl.sbatch and the configs of its roles; returns the script. On GPU nodes
    the servers' configs carry vLLM's memory share: inference.gpu_memory_utilization, or unset
    0.9, or colocated what the memory plan leaves beside the trainer (primerl.plan.with_vllm_share:
    the model's config.json and plan.gpu_memory_gib, or the GPU visible here, are needed then)."""
    from primerl.configs import InferenceRunConfig, OrchRunConfig, TrainerRunConfig

    s = cfg.slurm
    memory = cfg.trainer.weights.transport == "memory"
    place = _placement(cfg)
    layout = _inference_values(cfg) | _trainer_values(cfg, place.trainer_gpus)  # what does not fit, before the plan
    if s.gpus_per_node:
        from primerl.plan import plan_for_launch, with_vllm_share

        share_needs_plan = cfg.colocate and cfg.inference.gpu_memory_utilization is None
        cfg = with_vllm_share(cfg, plan_for_launch(cfg, slurm=True) if share_needs_plan else None)
    if place.inference_gpus is not None:  # the launcher sets each server's CUDA_VISIBLE_DEVICES from them
        cfg = msgspec.structs.replace(cfg, inference=msgspec.structs.replace(cfg.inference, gpus=place.inference_gpus))
    cfg = _with_token(cfg)
    if memory:  # the servers' URLs are known in the job only (their nodes' addresses): given on the command line
        weights = msgspec.structs.replace(
            cfg.trainer.weights,
            workers_per_server=cfg.inference.tensor_parallel_size,
            admin_token=cfg.inference.admin_token,
        )  # the trainer joins them with it
        cfg = msgspec.structs.replace(cfg, trainer=msgspec.structs.replace(cfg.trainer, weights=weights))
    values = layout | {
        "trainer_weights": ' "trainer.weights.servers=[${URL_LIST%,}]"' if memory else "",
        "nodes": max(s.inference_nodes, s.trainer_nodes) if place.shared_nodes else s.inference_nodes + s.trainer_nodes,
        "trainer_offset": 0 if place.shared_nodes else s.inference_nodes,
        "sbatch_lines": _sbatch_lines(s, s.gpus_per_node),
        "placement": _placement_line(cfg, place),
    }
    roles = {"rl": None, "trainer": TrainerRunConfig, "orchestrator": OrchRunConfig, "inference": InferenceRunConfig}
    # the sockets listen on the orchestrator node's address: per-job CURVE keys admit only this job's trainer;
    # the orchestrator packs for the job's trainer ranks (unset in the config: the job's count)
    transport = msgspec.structs.replace(
        cfg.transport.with_run_keys(), trainer_ranks=s.trainer_nodes * values["ranks_per_node"]
    )
    cfg = msgspec.structs.replace(cfg, transport=transport)
    return _render(cfg, "rl", roles, values)


def render_sft(cfg) -> Path:
    """RUN_DIR/slurm/sft.sbatch and its config; returns the script."""
    s = cfg.slurm
    values = _trainer_values(cfg) | {"nodes": s.trainer_nodes, "sbatch_lines": _sbatch_lines(s, s.gpus_per_node)}
    return _render(cfg, "sft", {"sft": None}, values)


def render_eval(cfg) -> Path:
    """RUN_DIR/slurm/eval.sbatch and the configs of its roles; returns the script."""
    from primerl.configs import InferenceRunConfig

    s = cfg.slurm
    values = _inference_values(cfg) | {"nodes": s.inference_nodes, "sbatch_lines": _sbatch_lines(s, s.gpus_per_node)}
    return _render(_with_token(cfg), "eval", {"eval": None, "inference": InferenceRunConfig}, values)


def submit(script: Path) -> str:
    """sbatch the script; returns the job id."""
    try:
        out = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True, timeout=120)
    except FileNotFoundError:
        raise SlurmError(
            f"sbatch not found: submit from a machine with Slurm's commands, or run `sbatch {script}` there"
        ) from None
    if out.returncode != 0:
        raise SlurmError(f"sbatch {script} failed: {out.stderr.strip() or out.stdout.strip()}")
    return out.stdout.strip().split(";")[0]
