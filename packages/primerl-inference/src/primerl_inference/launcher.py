"""Start vLLM OpenAI-compatible servers from the inference config, wait until they serve.

    servers = launch(cfg.inference, model="path/or/hub-id", max_model_len=cfg.seq_len, run_dir=...)
    servers.urls          # ["http://127.0.0.1:8000", ...]
    servers.stop()

Each replica is a separate vLLM OpenAI-compatible server process (`python -m
primerl_inference.serve`, vLLM's own server entry point; serve.py says why) with its own port (and GPUs), primerl's admin middleware (admin.py) and its log in
`run_dir/logs/inference-<i>.log`. `server_command` is a pure function from config to argv and
environment, so the GPU-only options are tested here without a GPU.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from primerl_protocol.images import model_images
from primerl_protocol.rundir import RunDir
from primerl_protocol.serving import HEALTH_ROUTE, LOGPROBS_MODE
from primerl_protocol.transfer import BACKEND as TRANSFER_BACKEND

from primerl_inference.config import (
    ADMIN_TOKEN_ENV,
    DEFAULT_GPU_MEMORY_UTILIZATION,
    DEFAULT_MAX_LORA_RANK,
    DEFAULT_MAX_LORAS,
    InferenceConfig,
)
from primerl_inference.serve import INSPECT_ENV

ADMIN_MIDDLEWARE = "primerl_inference.admin.AdminMiddleware"
WORKER_EXTENSION = "primerl_inference.worker.WorkerExtension"


class LaunchError(RuntimeError):
    """A server did not come up: names the replica, why, and the end of its log."""


def resolve_device(cfg: InferenceConfig) -> str:
    if cfg.device != "auto":
        return cfg.device
    has_gpu = Path("/dev/nvidia0").exists() or shutil.which("nvidia-smi") is not None
    return "cuda" if has_gpu else "cpu"


@dataclass
class ServerSpec:
    replica: int
    host: str
    """Where clients reach it (127.0.0.1 when the server listens on all interfaces)."""
    port: int
    argv: list[str]
    env: dict[str, str]
    gpus: list[int] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


def server_command(
    cfg: InferenceConfig,
    model: str,
    max_model_len: int,
    replica: int,
    run_dir: str | Path,
    device: str | None = None,
) -> ServerSpec:
    """argv and environment of replica `replica` (no process is started)."""
    device = device or resolve_device(cfg)
    port = cfg.base_port + replica
    argv = [
        sys.executable,
        "-m",
        "primerl_inference.serve",
        "--model",
        model,
        "--served-model-name",
        model,
        "--host",
        cfg.host,
        "--port",
        str(port),
        "--max-model-len",
        str(max_model_len),
        "--middleware",
        ADMIN_MIDDLEWARE,
        "--worker-extension-cls",
        WORKER_EXTENSION,
        # The engine that receives the trainer's weights in memory (transfer.py); idle until a
        # trainer's group is joined, so every server offers it.
        "--weight-transfer-config",
        json.dumps({"backend": TRANSFER_BACKEND}),
        "--enable-prefix-caching" if cfg.enable_prefix_caching else "--no-enable-prefix-caching",
        # verifiers' training client (primerl-envs) renders prompts itself and calls the
        # token-in/token-out route, which reads sampled tokens back as `token_id:N`.
        "--enable-scale-out",
        "--return-tokens-as-token-ids",
        # Logprobs of the distribution tokens are sampled from (after temperature), which is
        # what the trainer computes; vLLM's default is the raw logits' (temperature 1).
        "--logprobs-mode",
        LOGPROBS_MODE,
        # No log line per HTTP request (thousands a step in RL; extra_args
        # "--no-disable-uvicorn-access-log" brings them back).
        "--disable-uvicorn-access-log",
    ]
    env = {
        "VLLM_CACHE_ROOT": str(RunDir(run_dir).vllm_cache),
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True" if cfg.enable_lora else "False",
        "PRIMERL_MODEL": model,
    }
    if (token := cfg.resolved_admin_token()) is not None:
        env[ADMIN_TOKEN_ENV] = token
    gpus: list[int] = []
    if device == "cpu":
        # The KV cache in bytes (VLLM_CPU_KVCACHE_SPACE takes whole GiB only): zeroing 1 GiB took
        # ~1.7 s of the server's start on 2 cores, where a tiny model needs a few MiB.
        argv += [
            "--enforce-eager",
            "--dtype",
            "float32",
            "--kv-cache-memory-bytes",
            str(int(cfg.cpu_kv_cache_gib * 2**30)),
        ]
        env[INSPECT_ENV] = "1"  # serve.py: no subprocess to inspect the model class (~7 s CPU)
        # One OpenMP thread for the model unless the user set OMP_NUM_THREADS: with 2 the
        # engine's second thread spun between the many small steps of a CPU server (as much
        # CPU as the first) for no gain in step time (reverse-text: 0.62 s a step either way).
        env["OMP_NUM_THREADS"] = os.environ.get("OMP_NUM_THREADS") or "1"
        # No torch.compile in a CPU server unless the user asks for it: the model already runs
        # eagerly (--enforce-eager), and what vLLM still compiles is its sampler's small helpers
        # (the sampled token's rank among the logprobs, v1/sample/ops/logprobs.py), whose first
        # call spent ~2 s of the first step in dynamo and inductor (from its disk cache, and a
        # compiler probe in a subprocess) on the 2-core machine; eager, it is one comparison.
        env["TORCHDYNAMO_DISABLE"] = os.environ.get("TORCHDYNAMO_DISABLE") or "1"
        # CPU only: the model runs inside the engine-core process instead of a worker process of
        # its own. One process fewer to start (22 s to healthy instead of 36 s on 2 cores) and no
        # engine core spinning (sched_yield) on the worker's shared-memory queue, which took
        # ~15% of a core here while the server generated. GPUs keep vLLM's default.
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if (tp := cfg.tensor_parallel_size) > 1:
            # CPU tensor parallelism (vllm-cpu's workers over gloo): one worker process each, and
            # this process's cores split between them unless VLLM_CPU_OMP_THREADS_BIND says how
            # (vLLM's automatic binding wants a NUMA node per worker).
            argv += ["--tensor-parallel-size", str(tp), "--distributed-executor-backend", "mp"]
            del env["VLLM_ENABLE_V1_MULTIPROCESSING"]
            if "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
                cores = sorted(os.sched_getaffinity(0))
                if len(cores) < tp:
                    raise LaunchError(
                        f"inference.tensor_parallel_size = {tp} on CPU needs a core per worker; "
                        f"this process may use {len(cores)}"
                    )
                share = len(cores) // tp
                env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(
                    ",".join(map(str, cores[i * share : (i + 1) * share])) for i in range(tp)
                )
    else:
        n = cfg.gpus_per_replica
        pool = cfg.gpus if cfg.gpus is not None else list(range(cfg.num_replicas * n))
        gpus = pool[replica * n : (replica + 1) * n]
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpus))
        argv += [
            "--tensor-parallel-size",
            str(cfg.tensor_parallel_size),
            "--gpu-memory-utilization",
            # unset: the servers own their GPUs (`primerl rl` writes the colocated share in)
            str(cfg.gpu_memory_utilization or DEFAULT_GPU_MEMORY_UTILIZATION),
        ]
        if cfg.data_parallel_size > 1:
            argv += ["--data-parallel-size", str(cfg.data_parallel_size)]
        if cfg.enable_expert_parallel:
            argv += ["--enable-expert-parallel"]
        if cfg.quantization == "fp8":
            argv += ["--quantization", "fp8"]
        if cfg.kv_cache_dtype != "auto":
            argv += ["--kv-cache-dtype", cfg.kv_cache_dtype]
        if cfg.kv_offload_gib > 0:
            argv += ["--kv-offloading-backend", "native", "--kv-offloading-size", str(cfg.kv_offload_gib)]
        role = cfg.disaggregation.role
        if role != "none":
            kv_role = {"prefill": "kv_producer", "decode": "kv_consumer", "both": "kv_both"}[role]
            argv += [
                "--kv-transfer-config",
                json.dumps({"kv_connector": cfg.disaggregation.connector, "kv_role": kv_role}),
            ]
        if cfg.enforce_eager:
            argv += ["--enforce-eager"]
    if model_images(model) is not None:  # a vision-language model
        # Images only: no video travels primerl's data path, and without torchvision (CPU
        # machines: vision_compat) vLLM's start-up profiling of a dummy video would fail.
        argv += ["--limit-mm-per-prompt", json.dumps({"video": 0})]
    if cfg.enable_lora:
        argv += [
            "--enable-lora",
            "--max-lora-rank",
            str(cfg.max_lora_rank or DEFAULT_MAX_LORA_RANK),
            "--max-loras",
            str(cfg.max_loras or DEFAULT_MAX_LORAS),
        ]
    argv += list(cfg.extra_args)
    env.update(cfg.extra_env)
    host = "127.0.0.1" if cfg.host in ("0.0.0.0", "::") else cfg.host
    return ServerSpec(replica, host, port, argv, env, gpus)


def healthy(url: str) -> bool:
    """The server at `url` answers /health with 200 (not up yet, hung up mid-answer: False)."""
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            return r.status == 200
    except (OSError, http.client.HTTPException):  # not up yet, or hung up mid-answer
        return False


def answers_as_ours(url: str, token: str | None) -> bool:
    """Whether the server answering at `url` is the one started with admin token `token`: its
    admin health route takes the token (another run's server, with its own token, answers 401;
    a server without primerl's routes 404). Without a token nothing tells servers apart: True."""
    if token is None:
        return True
    request = urllib.request.Request(url + HEALTH_ROUTE, headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(request, timeout=5) as r:
            return r.status == 200
    except (OSError, http.client.HTTPException):  # HTTPError (401, 404) is an OSError
        return False


def log_tail(path: Path, lines: int = 30) -> str:
    """The last `lines` lines of a log (or "(no log)")."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


@dataclass
class Servers:
    specs: list[ServerSpec]
    procs: list[subprocess.Popen]
    logs: list[Path]
    startup_timeout_s: float = 600.0
    started_at: float = field(default_factory=time.monotonic)

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.specs]

    def stop(self, timeout_s: float = 30.0) -> None:
        self._stop(self.procs, timeout_s)

    def stop_one(self, replica: int, timeout_s: float = 30.0) -> None:
        """Stop replica `replica` (and its engine) only; a no-op if it has already exited."""
        self._stop([self.procs[replica]], timeout_s)

    @staticmethod
    def _stop(procs: list[subprocess.Popen], timeout_s: float) -> None:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for p in procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()

    def problem(self, replica: int, why: str) -> str:
        """What went wrong with `replica`, naming it, with the end of its log."""
        spec, log = self.specs[replica], self.logs[replica]
        return f"inference replica {replica} ({spec.url}) {why}; last lines of {log}:\n{log_tail(log)}"

    def watch_startup(
        self, *, fail_fast: bool, serving: set[int] | None = None, poll_s: float = 0.5
    ) -> tuple[set[int], list[str]]:
        """Poll until every replica serves, has exited, or is not healthy `startup_timeout_s`
        after the start: (the replicas serving, a problem for each other one). `serving` is
        filled as replicas come up; `fail_fast`: return at the first problem."""
        serving = set() if serving is None else serving
        deadline = self.started_at + self.startup_timeout_s
        pending, problems = set(range(len(self.specs))), []
        while pending:
            for i in sorted(pending | serving):
                if (code := self.procs[i].poll()) is not None:
                    pending.discard(i)
                    serving.discard(i)
                    problems.append(self.problem(i, f"exited with code {code}"))
                elif i in pending and healthy(self.specs[i].url):
                    pending.discard(i)
                    if answers_as_ours(self.specs[i].url, self.specs[i].env.get(ADMIN_TOKEN_ENV)):
                        serving.add(i)
                    else:  # ours cannot listen there: it would fail to bind, after loading the model
                        problems.append(
                            self.problem(
                                i,
                                (
                                    f"cannot serve: another server answers at {self.specs[i].url} and refuses this launch's "
                                    f"admin token (another run's server?): port {self.specs[i].port} is taken"
                                ),
                            )
                        )
            if problems and fail_fast:
                break
            if pending and time.monotonic() > deadline:
                problems += [self.problem(i, f"not healthy after {self.startup_timeout_s}s") for i in sorted(pending)]
                break
            if pending:
                time.sleep(poll_s)
        return serving, problems

    def wait_healthy(self, poll_s: float = 0.5) -> None:
        """Until every replica answers /health; LaunchError when one exits first or is not
        healthy `startup_timeout_s` after the start (naming it, with the end of its log)."""
        _, problems = self.watch_startup(fail_fast=True, poll_s=poll_s)
        if problems:
            raise LaunchError(problems[0])

    def check_alive(self) -> None:
        for i, p in enumerate(self.procs):
            if p.poll() is not None:
                raise LaunchError(self.problem(i, f"exited with code {p.returncode}"))


def start(
    cfg: InferenceConfig, model: str, max_model_len: int, run_dir: str | Path, log_dir: str | Path | None = None
) -> Servers:
    """Start every replica and return at once (`Servers.wait_healthy` waits until they serve).
    Each logs to `log_dir/inference-<i>.log` (default: the run directory's logs/)."""
    device = resolve_device(cfg)
    paths = RunDir(run_dir)
    logs_at = Path(log_dir) if log_dir is not None else paths.logs
    logs_at.mkdir(parents=True, exist_ok=True)
    specs = [server_command(cfg, model, max_model_len, i, run_dir, device) for i in range(cfg.num_replicas)]
    procs, logs = [], []
    try:
        for spec in specs:
            log = logs_at / f"inference-{spec.replica}.log"
            procs.append(
                subprocess.Popen(
                    spec.argv,
                    env={**os.environ, **spec.env},
                    stdout=log.open("w"),
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # its own process group: stop() takes vLLM's workers too
                )
            )
            logs.append(log)
    except BaseException:
        Servers._stop(procs, 30.0)
        raise
    return Servers(specs, procs, logs, startup_timeout_s=cfg.startup_timeout_s)


def launch(cfg: InferenceConfig, model: str, max_model_len: int, run_dir: str | Path) -> Servers:
    """Start every replica, then wait until all answer /health (or fail naming the one that did
    not, with every replica stopped)."""
    servers = start(cfg, model, max_model_len, run_dir)
    try:
        servers.wait_healthy()
    except BaseException:
        servers.stop()
        raise
    return servers
