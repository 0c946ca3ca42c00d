"""`primerl rl @ cfg.toml`: the whole run on this machine from one config.

1. Checks what can be checked before anything starts, writing nothing (a refusal is a
   CheckError, exit 2): the run directory's path and its lock (one `primerl rl` per run
   directory: primerl.resume), the model folder and its architecture (primerl-models must
   implement it; it decides whether groups' prompts are packed once: orchestrator.share_prompts),
   every environment loaded (import, arguments, one task drawn), the trainer's
   rank count, the ports (unset ones chosen free, set ones bind-tested: primerl.preflight), and
   what a resume would change (primerl.resume).
2. Lays out the run directory: `configs/` (the resolved config, the previous one kept as
   rl.prev.toml, and each process's projection of it), `logs/` (one log per process).
3. Starts the inference servers, the torchrun trainer and the orchestrator, each in its own
   process group, all at once (on CPU the servers a little earlier, while the slower checks of
   step 1 run: `start_early`; a refusal then stops them and leaves the run directory as it
   was): the trainer builds its model and the orchestrator its environments while vLLM loads
   (the orchestrator waits for the first server to serve, up to `inference.startup_timeout_s`).
   A server that exits or is not healthy within that time stops the run, as before.
4. Watches them: prints one line per step (step, reward, tokens/s, off-policy level, ETA);
   when a process exits with an error, on Ctrl-C, SIGTERM or SIGHUP, stops all of them (SIGTERM, then
   SIGKILL) and says which one failed, its exit code and the end of its log.

Rerunning the same command on the same run directory resumes: the trainer from its newest
checkpoint, the orchestrator from the state stored in it ("resuming from step N" on the
console); a change of the settings that checkpoint depends on is refused, naming them.

Placement: on a machine without a GPU everything runs on the CPU (`transport.trainer_ranks`
gloo ranks). With GPUs, inference takes `inference.gpus` (or the first ones) and the trainer
`trainer_gpus` (or the ones inference does not use), one rank per GPU; with `colocate = true`
both use the same GPUs (the trainer `trainer_gpus` of them, if set), vLLM limited to
`inference.gpu_memory_utilization` of their memory: unset, 0.9 on GPUs of its own and,
colocated, what the memory plan says the trainer leaves (primerl.plan.with_vllm_share, resolved
in `prepare` and written into configs/, so the servers start with that number).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import msgspec
from primerl_inference.launcher import Servers, resolve_device
from primerl_inference.launcher import start as start_servers
from primerl_orchestrator.health import console_notes, step_summary
from primerl_protocol.config import to_toml, write_private
from primerl_protocol.rundir import RunDir
from primerl_protocol.serving import ADMIN_TOKEN_ENV

from primerl.configs import OrchRunConfig, RLConfig, TrainerRunConfig
from primerl.errors import CheckError, RunError
from primerl.preflight import check_environments, check_run_dir, with_ports
from primerl.resume import RunLock, plan_resume


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log: Path

    def tail(self, lines: int = 25) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def check(cfg: RLConfig) -> RLConfig:
    """Everything that can fail before a process starts, named (CheckError); the config with what
    depends on the model resolved (inference.max_lora_rank for published adapters)."""
    from primerl_envs.environment import EnvLoadError, resolve_taskset_id
    from primerl_models import family_for, is_hub_id, read_config, resolve_model_folder

    try:
        folder = Path(cfg.model.name)
        if is_hub_id(cfg.model.name):  # fetched once here; vLLM and the trainer find it in the HF cache
            folder = resolve_model_folder(cfg.model.name, cfg.model.revision)
        hf_config = read_config(folder)
        family_for(hf_config, where=f"{cfg.model.name}/config.json")
    except (FileNotFoundError, ValueError) as err:
        raise CheckError(f"model.name: {err}") from None
    limit = hf_config.get("max_position_embeddings")
    text = hf_config.get("text_config") or {}
    limit = limit or (text.get("max_position_embeddings") if isinstance(text, dict) else None)
    scaled = hf_config.get("rope_scaling") or (text.get("rope_scaling") if isinstance(text, dict) else None)
    if isinstance(limit, int) and not scaled and cfg.seq_len > limit:
        raise CheckError(
            f"seq_len = {cfg.seq_len} is above the model's max_position_embeddings = {limit} "
            f"({cfg.model.name}/config.json): vLLM would refuse to serve it; use seq_len <= {limit}"
        )
    if not cfg.envs.train:
        raise CheckError("envs.train: no training environments; add at least one [[envs.train]] entry")
    for section, envs in (("envs.train", cfg.envs.train), ("envs.eval", cfg.envs.eval)):
        for i, env in enumerate(envs):
            try:
                resolve_taskset_id(env.id)
            except EnvLoadError as err:
                raise CheckError(f"{section}[{i}].id: {err}") from None
    if cfg.trainer.weights.transport == "memory" and cfg.inference.data_parallel_size > 1:
        raise CheckError(
            'trainer.weights.transport = "memory" with inference.data_parallel_size = '
            f"{cfg.inference.data_parallel_size}: weights in memory reach servers without vLLM's own "
            "data parallelism only (for now); use inference.num_replicas for more servers"
        )
    return fit_lora_rank(share_prompts(cfg, hf_config), hf_config)


def share_prompts(cfg: RLConfig, hf_config: dict) -> RLConfig:
    """orchestrator.share_prompts resolved: unset, on where the trainer computes shared prompts
    exactly (every mixer attention, no context parallelism, not the varlen back-end), off
    elsewhere; true where it is not exact, refused naming why."""
    from primerl_models import family_for

    asked = cfg.orchestrator.share_prompts
    if asked is False:
        return cfg
    try:
        problem = family_for(hf_config).args_from_hf(hf_config).prompt_sharing_problem()
    except (KeyError, TypeError, ValueError) as err:  # the trainer names what is wrong with it when it loads
        problem = f"its layers could not be read from {cfg.model.name}/config.json ({type(err).__name__}: {err})"
    if asked and problem is not None:
        raise CheckError(
            f"orchestrator.share_prompts = true, but {problem}: a completion cannot continue from a shared "
            "prompt exactly; set orchestrator.share_prompts = false (or leave it unset)"
        )
    if asked is None:
        exact = problem is None and cfg.trainer.parallel.cp == 1 and cfg.trainer.attention != "varlen"
        orchestrator = msgspec.structs.replace(cfg.orchestrator, share_prompts=exact)
        return msgspec.structs.replace(cfg, orchestrator=orchestrator)
    return cfg


def fit_lora_rank(cfg: RLConfig, hf_config: dict) -> RLConfig:
    """With published adapters, the servers' --max-lora-rank must hold the adapter's largest
    rank: trainer.lora.rank, or k times it where the checkpoint fuses k adapted layers into one
    (GLM-4's gate_up_proj). Unset, it is set to the smallest vLLM takes; set too low, refused."""
    lora, have = cfg.trainer.lora, cfg.inference.max_lora_rank
    if lora is None or lora.publish != "adapter":
        return cfg
    from primerl_inference.config import LORA_RANKS, lora_rank_for
    from primerl_trainer.adapters import published_rank

    try:
        need = published_rank(hf_config, lora)
    except ValueError as err:
        raise CheckError(f'trainer.lora.publish = "adapter": {err}') from None
    fit = lora_rank_for(need)
    why = f"the adapters trainer.lora publishes have rank {need}" + (
        f" (trainer.lora.rank = {lora.rank} x {need // lora.rank} layers the checkpoint fuses)"
        if need != lora.rank
        else ""
    )
    if fit is None:
        raise CheckError(
            f"{why}, above the largest vLLM serves ({LORA_RANKS[-1]}): lower trainer.lora.rank, or set "
            'trainer.lora.publish = "merged"'
        )
    if have is None:
        return msgspec.structs.replace(cfg, inference=msgspec.structs.replace(cfg.inference, max_lora_rank=fit))
    if have < need:
        raise CheckError(f"inference.max_lora_rank = {have}, but {why}: set it to {fit} or more, or leave it unset")
    return cfg


def gpu_plan(cfg: RLConfig, device: str) -> tuple[list[int], list[int]]:
    """(inference GPUs, trainer GPUs); empty lists on CPU."""
    if device == "cpu":
        return [], []
    inf = cfg.inference
    n_inf = inf.num_replicas * inf.gpus_per_replica
    inference = list(inf.gpus) if inf.gpus is not None else list(range(n_inf))
    if cfg.colocate:
        trainer = cfg.trainer_gpus if cfg.trainer_gpus is not None else inference
    elif cfg.trainer_gpus is not None:
        trainer = list(cfg.trainer_gpus)
    else:
        trainer = list(range(n_inf, n_inf + cfg.transport.ranks))
    if not cfg.colocate and set(trainer) & set(inference):
        raise CheckError(
            f"trainer_gpus {trainer} overlap inference GPUs {inference}; set colocate = true to share them"
        )
    if len(trainer) != cfg.transport.ranks:
        raise CheckError(
            f"transport.trainer_ranks = {cfg.transport.ranks} but the trainer gets GPUs {trainer} (one rank per GPU)"
        )
    return inference, trainer


def _start(name: str, argv: list[str], log: Path, env: dict[str, str]) -> Proc:
    popen = subprocess.Popen(
        argv, stdout=log.open("a"), stderr=subprocess.STDOUT, env={**os.environ, **env}, start_new_session=True
    )
    return Proc(name, popen, log)


def _stop(procs: list[Proc], timeout_s: float = 20.0) -> None:
    for p in procs:
        if p.popen.poll() is None:
            try:
                os.killpg(p.popen.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + timeout_s
    for p in procs:
        try:
            p.popen.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        try:  # the whole group: torchrun's ranks, vLLM's engine
            os.killpg(p.popen.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.popen.wait()


class Progress:
    """One line per finished step, from the trainer's metrics.jsonl (docs/metrics.md's names).
    Until the first step, what the run waits for: the servers' start-up (`servers`: how many
    serve, of how many; None once start-up is over), the first step's rollouts (until the
    orchestrator logs a step) or the trainer's first step; a line when that changes and every
    `remind_s` seconds."""

    def __init__(
        self,
        run_dir: Path,
        max_steps: int | None,
        servers: Callable[[], tuple[int, int] | None] | None = None,
        remind_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.path = RunDir(run_dir).metrics
        self.orch_path = RunDir(run_dir).orchestrator_metrics
        self.max_steps = max_steps
        self.seen = self.path.stat().st_size if self.path.exists() else 0
        self.orch_seen = self.orch_path.stat().st_size if self.orch_path.exists() else 0
        self.servers, self.remind_s, self.clock = servers, remind_s, clock
        self.started = clock()
        self.steps_done = 0
        self.waiting: tuple[str, float] | None = None  # (what, when said)

    def waiting_for(self) -> str:
        if self.servers is not None and (state := self.servers()) is not None:
            return f"the inference servers to start ({state[0]} of {state[1]} serving)"
        if not self.orch_path.exists() or self.orch_path.stat().st_size <= self.orch_seen:
            return "the first step's rollouts (the orchestrator generates them)"
        return "the trainer's first step (it loads the model first)"

    def poll(self) -> None:
        self._steps()
        if self.steps_done == 0:
            what, now = self.waiting_for(), self.clock()
            if self.waiting is None or self.waiting[0] != what or now - self.waiting[1] >= self.remind_s:
                print(f"waiting for {what}, {now - self.started:.0f}s so far", flush=True)
                self.waiting = (what, now)

    def _steps(self) -> None:
        if not self.path.exists() or self.path.stat().st_size <= self.seen:
            return
        with self.path.open() as f:
            f.seek(self.seen)
            chunk = f.read()
        complete = chunk[: chunk.rfind("\n") + 1]
        self.seen += len(complete.encode())
        for line in complete.splitlines():
            try:
                m = json.loads(line)
            except json.JSONDecodeError:
                continue
            self.steps_done += 1
            rate = (self.clock() - self.started) / self.steps_done
            eta = f" | ETA {rate * (self.max_steps - m['step'] - 1):.0f}s" if self.max_steps else ""
            reward = f"reward {m['reward/mean']:.3f}" if "reward/mean" in m else "reward -"
            health = step_summary(m)  # errors 12.5% | trained 14/16
            print(
                f"step {m['step']} | {reward} | {health + ' | ' if health else ''}"
                f"{m.get('trainer/tokens_per_s', 0):,.0f} tok/s trained, {m.get('rollouts/tokens_per_s', 0):,.0f} "
                f"generated | off-policy {m.get('off_policy/level', 0):.0f} | kl "
                f"{m.get('trainer/mismatch_kl', float('nan')):.1e}{eta}",
                flush=True,
            )
            for note in console_notes(m, str(RunDir(self.path.parent).log("orchestrator"))):
                print(note, flush=True)


def trainer_threads(cfg: RLConfig, trainer_gpus: list[int]) -> int:
    """Threads of each trainer rank ($OMP_NUM_THREADS, unless set). On GPUs, 1. On CPU, 1 as
    well when training overlaps generation (max_async_level > 0: vLLM computes meanwhile); an
    on-policy run (max_async_level = 0) trains while generation waits, so each rank gets its
    share of the cores (the reverse-text example's forward and backward on 2 cores: ~0.3 s
    instead of ~0.5 s)."""
    if trainer_gpus or cfg.orchestrator.max_async_level > 0:
        return 1
    return max(1, len(os.sched_getaffinity(0)) // cfg.transport.ranks)


def run_rl(cfg: RLConfig) -> None:
    """Run the whole RL run; raises RunError naming the failed process (CheckError: refused
    before anything started, the run directory as it was)."""

    with RunLock(check_run_dir(cfg.run_dir)) as lock:
        if lock.took_over:
            print(f"taking over the lock of {lock.took_over}: that process is no longer running", flush=True)
        cfg, device, trainer_gpus, servers = prepare(cfg)
        _run(cfg, device, trainer_gpus, servers)


def prepare(cfg: RLConfig) -> tuple[RLConfig, str, list[int], Servers | None]:
    """Every check before anything starts (CheckError), then the run directory laid out: the
    resolved config (free ports chosen, the run's admin token and socket keys) written to
    configs/rl.toml, the previous one kept as configs/rl.prev.toml. Returns it, the device,
    the trainer's GPUs and the servers if they were started early (`start_early`: on CPU they
    start while the slower checks run, and a refusal stops them again). On GPUs, an unset
    inference.gpu_memory_utilization is resolved here from the memory plan
    (primerl.plan.with_vllm_share) and the servers start with it."""

    given = cfg
    device = resolve_device(cfg.inference)
    inference_gpus, trainer_gpus = gpu_plan(cfg, device)
    token = cfg.inference.resolved_admin_token() or secrets.token_hex(16)
    cfg = with_ports(cfg)
    inference = msgspec.structs.replace(
        cfg.inference, admin_token=token, device=device, gpus=inference_gpus or cfg.inference.gpus
    )
    # per-run CURVE keys (unless configured): only this run's trainer and orchestrator can talk
    cfg = msgspec.structs.replace(cfg, inference=inference, transport=cfg.transport.with_run_keys())
    run_dir = Path(cfg.run_dir)
    paths = RunDir(run_dir)
    early = start_early(cfg, device)
    try:
        cfg = check(cfg)
        if early is not None and cfg.inference != inference:  # start_early's rule was not kept: a bug to name
            raise RunError("the checks changed the inference settings of servers already started")
        for section in ("envs.train", "envs.eval"):
            check_environments(section, getattr(cfg.envs, section.split(".")[1]))
        if device != "cpu":  # the memory plan (primerl plan), before anything starts; vLLM's share from it
            from primerl.plan import check_fits, with_vllm_share

            cfg = with_vllm_share(cfg, check_fits(cfg, slurm=False))
        plan = plan_resume(cfg, given, run_dir)  # refuses a resume that changes what it cannot
        plan.announce()
        paths.configs.mkdir(parents=True, exist_ok=True)
        paths.logs.mkdir(exist_ok=True)
        plan.keep_previous()
        write_private(paths.config("rl"), to_toml(cfg))
        if early is not None:  # their logs join the others (a rename: they go on writing)
            for i, log in enumerate(early.logs):
                early.logs[i] = log.replace(paths.log(log.stem))
            shutil.rmtree(run_dir / STARTING)
    except BaseException:
        if early is not None:
            early.stop()
            shutil.rmtree(run_dir / STARTING, ignore_errors=True)
        raise
    return cfg, device, trainer_gpus, early


STARTING = ".starting"
"""The run directory's folder for the logs of servers started early, until the checks pass."""


def start_early(cfg: RLConfig, device: str) -> Servers | None:
    """On CPU, the inference servers start before the slower checks (the model's family: torch
    and primerl-models imported; every environment loaded: verifiers imported), which took
    ~5 s of `primerl rl`'s start on the 2-core machine, all of it before vLLM's own ~15 s start
    began. Their logs go to run_dir/.starting/ until the checks pass; a refusal stops them and
    removes it, so the run directory is left as it was. Not on GPUs (the memory plan decides
    vLLM's share, and their start is minutes against these seconds), not for a model vLLM cannot
    serve from a folder here (a hub id, no weights: the checks name the problem first), and not
    with published LoRA adapters (the servers' --max-lora-rank comes from the checks)."""
    folder = Path(cfg.model.name)
    lora = cfg.trainer.lora
    if device != "cpu" or not (folder / "config.json").is_file() or not any(folder.glob("*.safetensors")):
        return None
    if lora is not None and lora.publish == "adapter":
        return None
    shutil.rmtree(Path(cfg.run_dir) / STARTING, ignore_errors=True)  # what a killed `primerl rl` left there
    print(
        f"starting {cfg.inference.num_replicas} inference server(s) on cpu while the checks run "
        f"(logs in {RunDir(cfg.run_dir).logs})",
        flush=True,
    )
    return start_servers(cfg.inference, cfg.model.name, cfg.seq_len, cfg.run_dir, Path(cfg.run_dir) / STARTING)


def _run(cfg: RLConfig, device: str, trainer_gpus: list[int], servers: Servers | None = None) -> None:
    """Start the servers (unless `prepare` started them early), the trainer and the orchestrator;
    watch them until done; stop them all."""
    run_dir = Path(cfg.run_dir)
    paths = RunDir(run_dir)
    logs = paths.logs
    procs: list[Proc] = []
    try:
        if servers is None:
            print(f"starting {cfg.inference.num_replicas} inference server(s) on {device} (logs in {logs})", flush=True)
            servers = start_servers(cfg.inference, cfg.model.name, cfg.seq_len, run_dir)
        procs += [Proc(f"inference-{i}", p, log) for i, (p, log) in enumerate(zip(servers.procs, servers.logs))]
        startup = ServersStartup(servers)

        trainer_cfg = paths.config("trainer")
        write_private(trainer_cfg, to_toml(with_servers(cfg.project(TrainerRunConfig), servers.urls, cfg.inference)))
        trainer_env = {
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS") or str(trainer_threads(cfg, trainer_gpus)),
            "PYTHONUNBUFFERED": "1",
        }
        if cfg.trainer.weights.transport == "memory":  # it joins the servers through their admin routes
            token = cfg.inference.resolved_admin_token()
            if token is None:  # prepare() sets one; a config that reaches here without it is a bug to name
                raise RunError("inference.admin_token: unset, and the trainer needs it to join the servers")
            trainer_env[ADMIN_TOKEN_ENV] = token
        if trainer_gpus:
            trainer_env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, trainer_gpus))
        else:
            trainer_env["CUDA_VISIBLE_DEVICES"] = ""
        procs.append(
            _start(
                "trainer",
                [  # --standalone: a single-node rendezvous on a free port
                    sys.executable,
                    "-m",
                    "torch.distributed.run",
                    "--standalone",
                    f"--nproc-per-node={cfg.transport.ranks}",
                    "-m",
                    "primerl.trainer_entry",
                    "@",
                    str(trainer_cfg),
                ],
                paths.log("trainer"),
                trainer_env,
            )
        )

        orch = msgspec.structs.replace(
            cfg.project(OrchRunConfig), inference=msgspec.structs.replace(cfg.inference, urls=servers.urls)
        )
        orch_cfg = paths.config("orchestrator")
        write_private(orch_cfg, to_toml(orch))
        procs.append(
            _start(
                "orchestrator",
                [sys.executable, "-m", "primerl.orch_entry", "@", str(orch_cfg)],
                paths.log("orchestrator"),
                {"PYTHONUNBUFFERED": "1"},
            )
        )
        print(f"trainer ({cfg.transport.ranks} rank(s)) and orchestrator started", flush=True)
        _watch(procs, Progress(run_dir, cfg.max_steps, startup.state), startup)
    except KeyboardInterrupt as err:  # Ctrl-C, or SIGTERM / SIGHUP (cli.Stopped)
        print(f"stopping every process ({err.args[0] if err.args else 'Ctrl-C'})", flush=True)
        raise
    finally:
        _stop(procs)


def with_servers(trainer: TrainerRunConfig, urls: list[str], inference) -> TrainerRunConfig:
    """The trainer's config with the servers it sends weights to in memory (as they were started:
    their URLs, and each one's workers), when trainer.weights.transport = "memory"."""
    weights = trainer.trainer.weights
    if weights.transport != "memory":
        return trainer
    weights = msgspec.structs.replace(weights, servers=list(urls), workers_per_server=inference.tensor_parallel_size)
    return msgspec.structs.replace(trainer, trainer=msgspec.structs.replace(trainer.trainer, weights=weights))


class ServersStartup:
    """Watches the servers' start-up in a thread, so that the trainer and the orchestrator
    start meanwhile. A replica that exits or is not healthy in time while another serves is a
    lost server like any other (`_watch` warns, the run goes on); `check()` raises RunError
    only when none came up (naming the first replica that failed, with its log's end)."""

    def __init__(self, servers) -> None:
        self.servers = servers
        self.error: str | None = None
        self.serving: set[int] = set()
        self.done = False
        self.thread = threading.Thread(target=self._wait, name="servers-startup", daemon=True)
        self.thread.start()

    def _wait(self) -> None:
        s = self.servers
        _, failed = s.watch_startup(fail_fast=False, serving=self.serving)
        if self.serving:
            print(
                f"inference server(s) serving at {', '.join(s.specs[i].url for i in sorted(self.serving))}", flush=True
            )
            for problem in failed:
                print(f"warning: {problem.splitlines()[0]}; the run goes on with the other servers", flush=True)
        else:
            self.error = failed[0] if failed else "no inference server came up"
        self.done = True

    def check(self) -> None:
        if self.error is not None:
            raise RunError(f"inference: {self.error}")

    def state(self) -> tuple[int, int] | None:
        """(servers serving, servers) while start-up goes on; None once it is over."""
        return None if self.done else (len(self.serving), len(self.servers.specs))


def _watch(procs: list[Proc], progress: Progress, startup: ServersStartup | None = None) -> None:
    """Until the trainer and the orchestrator have both finished; the first failure stops all
    (a server that exits before all of them serve is a failure, even with others left)."""
    finishers = {"trainer", "orchestrator"}
    lost: set[str] = set()
    while True:
        if startup is not None:
            startup.check()
        progress.poll()
        servers = [p for p in procs if p.name not in finishers]
        for p in procs:
            code = p.popen.poll()
            if code is None or (code == 0 and p.name in finishers) or p.name in lost:
                continue
            reason = f"exited with code {code}" if code >= 0 else f"was killed by signal {-code}"
            if p.name not in finishers and startup is not None and not startup.serving:
                startup.thread.join(timeout=5.0)  # when none came up, its error names the replica and its log
                startup.check()
            if p.name not in finishers and any(q.popen.poll() is None for q in servers):
                # the orchestrator routes around a dead server; the run goes on
                print(
                    f"warning: {p.name} {reason}; the run goes on with the other servers "
                    f"(last lines of {p.log}:\n{p.tail(10)})",
                    flush=True,
                )
                lost.add(p.name)
                continue
            raise RunError(f"{p.name} {reason}; last lines of {p.log}:\n{p.tail()}")
        if all(p.popen.poll() == 0 for p in procs if p.name in finishers):
            progress.poll()
            print(f"run finished; plots and a summary: primerl report {progress.path.parent}", flush=True)
            return
        time.sleep(0.1)  # cheap (a stat and a poll per process); the step lines and the end show within 0.1 s
