"""`primerl plan`: whether a run fits its GPUs (and its nodes' memory), said before anything starts.

    plan = plan_rl(cfg, args, gpu_gib=80)      # args: the model's ModelArgs (from its config.json)
    print(plan.render())
    plan.refusal()                             # None, or why it cannot fit and the keys to change

Per trainer rank: primerl_trainer.plan.trainer_memory (parameters, gradients, optimizer states,
gathered layers, activations, the loss's logits, what the process itself holds; each part says
where its numbers come from). Per inference GPU: primerl_inference.plan.server_memory (weights,
the profile run, the KV cache vLLM is left, the sequences it holds). A colocated run adds the
trainer's peak to vLLM's share of the same GPU. When the asked layout does not fit, the layouts
that do are listed (trainer: activation checkpointing, expert and context parallelism, optimizer
offload; inference: tensor parallelism, FP8 weights, an FP8 KV cache), fewest changes first.

vLLM's share (`inference.gpu_memory_utilization`) unset: 0.9 where the servers own their GPUs;
colocated, what the trainer leaves (`colocated_share`). `primerl rl` writes the number the plan
took into the run's configs (`with_vllm_share`: launch.prepare here, the Slurm render with
--slurm), so the servers start with it.

The GPU's memory: `plan.gpu_memory_gib`, else the first visible GPU's (nvidia-smi); with neither
(a CPU run, a login node) nothing is checked and the plan says so.

Host memory: with `trainer.optimizer.cpu_offload` each trainer rank keeps its shards of the fp32
weights, gradients and AdamW states on the host (`TrainerMemory.host`); a node's trainer ranks
together must fit HOST_HEADROOM of the node's memory: `plan.host_memory_gib`, else this
machine's (/proc/meminfo's MemTotal) for a run here; under --slurm without the key the check is
skipped and the plan says so. Only what the plan computes is counted (the offloaded states), not
the processes themselves, nor the servers, orchestrator or sandboxes on the node: HOST_HEADROOM
leaves room for them.
"""

from __future__ import annotations

import itertools
import math
import shutil
import subprocess
from dataclasses import dataclass, field, replace
from pathlib import Path

from primerl_inference.config import DEFAULT_GPU_MEMORY_UTILIZATION
from primerl_inference.plan import (
    CUDA_GRAPHS_GIB,
    GIB,
    KVLayer,
    ServedShape,
    ServerLayout,
    ServerMemory,
    server_memory,
)
from primerl_models.args import MLA, Attention, GatedDeltaNet, Mamba2, ModelArgs, MoEMLP
from primerl_trainer.engine import loss_in_forward_applies
from primerl_trainer.plan import TrainerLayout, TrainerMemory, trainer_memory

TRAINER_HEADROOM = 0.95
"""Share of a GPU the trainer's predicted peak may take: the rest for the allocator's
fragmentation and the plan's own error (10% on the shapes measured: docs/benchmarks.md)."""

HOST_HEADROOM = 0.9
"""Share of a node's memory the trainer ranks' offloaded states (cpu_offload) may take: the rest
for what the plan does not count: the OS, each process's own memory (Python, CUDA's and NCCL's
host buffers, the loaded checkpoint while the model is placed) and the other roles on the node
(orchestrator, servers, sandboxes)."""


def colocated_share(trainer_peak: float, gpu_bytes: float, graphs: float) -> float:
    """vLLM's gpu_memory_utilization beside a trainer rank on the same GPU, when unset: the
    trainer's TRAINER_HEADROOM of the GPU less its predicted peak and vLLM's CUDA graphs
    (`graphs` bytes, captured outside vLLM's share), rounded down to 0.01 so that the trainer's
    share stays >= its peak, and at most what vLLM takes of a GPU of its own (0.9). Zero or
    below: the trainer leaves vLLM nothing."""
    share = math.floor((TRAINER_HEADROOM - (trainer_peak + graphs) / gpu_bytes) * 100) / 100
    return min(DEFAULT_GPU_MEMORY_UTILIZATION, share)


def served_shape(args: ModelArgs) -> ServedShape:
    """What a vLLM server's memory depends on, from the model's shape."""
    d = args.hidden_size
    experts = 0
    widest = 0
    kv: list[KVLayer] = []
    for layer in args.layers:
        mlp, mixer = layer.mlp, layer.mixer
        if isinstance(mlp, MoEMLP):
            experts += mlp.num_experts * mlp.experts.num_params(mlp.expert_dim(d))
            widest = max(widest, 3 * mlp.top_k * mlp.experts.size)
        elif mlp is not None:
            widest = max(widest, 3 * mlp.intermediate_size)
        if isinstance(mixer, Attention):
            widest = max(widest, (mixer.num_heads + 2 * mixer.num_kv_heads) * mixer.head_dim)
            kv.append(
                KVLayer(
                    per_token=2 * 2 * mixer.num_kv_heads * mixer.head_dim, split=mixer.num_kv_heads, window=mixer.window
                )
            )
        elif isinstance(mixer, MLA):
            widest = max(widest, mixer.num_heads * (mixer.qk_head_dim + mixer.v_head_dim))
            index = mixer.indexer.head_dim * (1 + 4 / 128) if mixer.indexer is not None else 0.0
            kv.append(KVLayer(per_token=2 * (mixer.kv_lora_rank + mixer.qk_rope_head_dim), fixed_fp8=index))
        elif isinstance(mixer, GatedDeltaNet):
            state = mixer.num_v_heads * mixer.head_k_dim * mixer.head_v_dim + mixer.conv_dim * (mixer.conv_kernel - 1)
            kv.append(KVLayer(state=2 * state, split=mixer.num_k_heads))
        elif isinstance(mixer, Mamba2):
            state = mixer.num_heads * mixer.head_dim * mixer.state_size + mixer.conv_dim * (mixer.conv_kernel - 1)
            kv.append(KVLayer(state=2 * state, split=mixer.n_groups))
    vocab = args.vocab_size * d * (1 if args.tie_embeddings else 2)
    return ServedShape(
        dense_params=args.num_params() - experts - vocab,
        expert_params=experts,
        vocab_params=vocab,
        hidden_size=d,
        vocab_size=args.vocab_size,
        widest_per_token=widest,
        kv_layers=kv,
    )


def visible_gpu_gib() -> float | None:
    """The first visible GPU's memory in GiB (nvidia-smi), or None."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run(
            [smi, "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=20,
        )
        return float(out.stdout.split()[0]) / 1024 if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return None


def machine_memory_gib() -> float | None:
    """This machine's memory in GiB (/proc/meminfo's MemTotal), or None."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / 1024**2  # kB
    except (OSError, ValueError, IndexError):
        pass
    return None


@dataclass
class HostPlan:
    """What a node's trainer ranks keep in host memory (cpu_offload), against the node's memory."""

    ranks: int
    """Trainer ranks on a node."""
    per_rank: float
    """Bytes each keeps on the host (TrainerMemory.host)."""
    node_gib: float | None
    """The node's memory; None: unknown, not checked."""
    source: str
    """Where node_gib comes from (or why it is unknown)."""

    @property
    def need(self) -> float:
        return self.ranks * self.per_rank

    @property
    def share(self) -> float | None:
        """Bytes the ranks may keep: HOST_HEADROOM of the node's memory."""
        return None if self.node_gib is None else self.node_gib * GIB * HOST_HEADROOM

    @property
    def fits(self) -> bool:
        return self.share is None or self.need <= self.share


@dataclass
class TrainerPlan:
    layout: TrainerLayout
    memory: TrainerMemory
    ranks: int
    share: float
    """Bytes of each trainer GPU the trainer may use (less vLLM's share when colocated)."""

    @property
    def fits(self) -> bool:
        return self.memory.peak <= self.share


@dataclass
class InferencePlan:
    layout: ServerLayout
    memory: ServerMemory
    servers: int

    @property
    def fits(self) -> bool:
        return not self.memory.problems()


@dataclass
class Plan:
    """What the run needs per GPU, and whether it fits."""

    model: str
    params: int
    gpu_gib: float | None
    trainer: TrainerPlan | None
    inference: InferencePlan | None
    host: HostPlan | None = None
    """The trainer's host memory a node; None: nothing offloaded (or GPU memory unknown)."""
    trainer_options: list[tuple[str, TrainerPlan]] = field(default_factory=list)
    inference_options: list[tuple[str, InferencePlan]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def refusal(self) -> str | None:
        """Why the run cannot fit, naming the keys to change (None: it fits, or was not checked)."""
        why = []
        if self.trainer is not None and not self.trainer.fits:
            t = self.trainer
            why.append(
                f"a trainer rank needs {t.memory.peak / GIB:.1f} GiB at its peak and has {t.share / GIB:.1f} "
                f"({_parts(t.memory.parts)})"
            )
            if self.trainer_options:
                why.append("layouts that fit: " + "; ".join(name for name, _ in self.trainer_options[:4]))
            else:
                why.append(
                    "no layout of trainer.parallel.ep / cp, trainer.activation_checkpointing and "
                    "trainer.optimizer.cpu_offload fits: more trainer GPUs (transport.trainer_ranks) or a shorter seq_len"
                )
        if self.host is not None and not self.host.fits:
            h = self.host
            assert h.share is not None and h.node_gib is not None  # fits when unknown
            why.append(
                f"the trainer's {h.ranks} rank(s) on a node keep {h.need / GIB:.1f} GiB in host memory "
                f"({h.per_rank / GIB:.1f} GiB a rank of weights, gradients and optimizer states: "
                f"trainer.optimizer.cpu_offload) and the node has {h.share / GIB:.1f} ({HOST_HEADROOM} of "
                f"{h.node_gib:.1f} GiB, {h.source})"
            )
            if self.trainer is not None and self.trainer.fits:  # else the GPU's reason listed the layouts
                fit = "; ".join(name for name, _ in self.trainer_options[:4]) or "none on these ranks"
                why.append(f"layouts that fit GPU and host: {fit}")
            why.append(
                "set plan.host_memory_gib if the node has more, trainer.optimizer.cpu_offload = false where the "
                "GPUs hold the states, or more trainer nodes (slurm.trainer_nodes: each rank keeps 1/ranks of the "
                "states, so a node's share shrinks as the ranks spread over more nodes)"
            )
        if self.inference is not None and not self.inference.fits:
            why.extend(self.inference.memory.problems())
            if self.inference_options:
                why.append("server layouts that fit: " + "; ".join(name for name, _ in self.inference_options[:4]))
            else:
                why.append(
                    "no layout of inference.tensor_parallel_size, inference.quantization and inference.kv_cache_dtype "
                    "fits: more GPUs a server, or a shorter seq_len"
                )
        return "; ".join(why) if why else None

    def render(self) -> str:
        lines = [f"model: {self.model}, {self.params / 1e9:.2f}B parameters"]
        if self.gpu_gib is None:
            lines.append("GPU memory unknown (no plan.gpu_memory_gib, no GPU visible): nothing checked")
        else:
            lines.append(f"GPU memory: {self.gpu_gib:.1f} GiB each")
        if self.trainer is not None:
            t, lay = self.trainer, self.trainer.layout
            lines.append(
                f"trainer: {t.ranks} rank(s), ep {lay.ep}, cp {lay.cp}, rows of {lay.row_tokens:,} tokens, "
                f"activation checkpointing {'on' if lay.activation_checkpointing else 'off'}, "
                f"optimizer offload {'on' if lay.cpu_offload else 'off'}"
            )
            lines.append(f"  per rank: {_parts(t.memory.parts)}")
            lines.append(
                f"  peak {t.memory.peak / GIB:.1f} GiB of {t.share / GIB:.1f}: {'fits' if t.fits else 'DOES NOT FIT'}"
                + (f"; host {t.memory.host / GIB:.1f} GiB a rank" if t.memory.host else "")
            )
            for part, source in t.memory.sources.items():
                lines.append(f"    {part}: {source}")
            if (h := self.host) is not None:
                head = f"  host: {h.ranks} rank(s) a node x {h.per_rank / GIB:.1f} GiB = {h.need / GIB:.1f} GiB"
                if h.share is None:
                    lines.append(f"{head}; the node's memory unknown ({h.source}): not checked")
                else:
                    lines.append(
                        f"{head} of {h.share / GIB:.1f} ({HOST_HEADROOM} of {h.node_gib:.1f} GiB, {h.source}): "
                        + ("fits" if h.fits else "DOES NOT FIT")
                    )
        if self.inference is not None:
            i, lay = self.inference, self.inference.layout
            m = i.memory
            lines.append(
                f"inference: {i.servers} server(s) of tp {lay.tp} x dp {lay.dp}"
                + (", experts split" if lay.expert_parallel else "")
                + (", fp8 weights" if lay.fp8_weights else "")
                + (", fp8 KV cache" if lay.fp8_kv else "")
                + f", gpu_memory_utilization {lay.gpu_memory_utilization}"
            )
            lines.append(f"  per GPU: {_parts(m.parts)}, KV cache {m.kv_bytes / GIB:.1f} GiB")
            lines.append(
                f"  one sequence of {m.seq_len:,} tokens takes {m.kv_per_seq / GIB:.2f} GiB of KV: "
                f"{m.seqs_fit} fit at once, {m.in_flight} in flight a GPU group"
                + (" (vLLM will preempt and recompute)" if m.short_of_concurrency() else "")
            )
            lines.append(f"  {'fits' if i.fits else 'DOES NOT FIT: ' + '; '.join(m.problems())}")
        for title, options in (("trainer", self.trainer_options), ("inference", self.inference_options)):
            if options:
                lines.append(f"{title} layouts that fit:")
                lines.extend(f"  {name}" for name, _ in options[:6])
        lines.extend(self.notes)
        return "\n".join(lines)


def _parts(parts: dict[str, float]) -> str:
    return ", ".join(f"{k} {v / GIB:.1f}" for k, v in parts.items()) + " GiB"


def trainer_layout(cfg, ranks: int) -> TrainerLayout:
    """The trainer's layout from a config (RLConfig or SFTConfig) on `ranks` GPUs."""
    t = cfg.trainer
    return TrainerLayout(
        world=ranks,
        ep=t.parallel.ep,
        cp=t.parallel.cp,
        row_tokens=t.micro_batch_tokens or cfg.seq_len,
        rows=2,  # a step of two rows or more: from the second on, every gradient is held too
        compiled=t.compile,
        activation_checkpointing=t.activation_checkpointing,
        cpu_offload=t.optimizer.cpu_offload,
        # the loss's gradients computed in the forward keep no logits whatever keep_logits says
        keep_logits=t.keep_logits
        and not loss_in_forward_applies(t.loss_in_forward, t.loss.type, context_split=t.parallel.cp > 1),
        lora_rank=t.lora.rank if t.lora is not None else None,
    )


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def trainer_options(
    args: ModelArgs, asked: TrainerLayout, share: float, host_room: float | None = None
) -> list[tuple[str, TrainerPlan]]:
    """Layouts of the same ranks that fit (a GPU's `share`, and `host_room` bytes a rank of host
    memory when known), fewest changed settings first, then smallest peak."""
    experts = {layer.mlp.num_experts for layer in args.layers if isinstance(layer.mlp, MoEMLP)}
    eps = [e for e in _divisors(asked.world) if all(n % e == 0 for n in experts)] if experts else [1]
    cps = [c for c in _divisors(asked.world) if asked.row_tokens % c == 0]
    found = []
    for ep, cp, ac, off in itertools.product(eps, cps, (False, True), (False, True)):
        lay = replace(asked, ep=ep, cp=cp, activation_checkpointing=ac, cpu_offload=off)
        if lay == asked:
            continue
        mem = trainer_memory(args, lay)
        if mem.peak > share or (host_room is not None and mem.host > host_room):
            continue
        changes = []
        if ep != asked.ep:
            changes.append(f"trainer.parallel.ep = {ep}")
        if cp != asked.cp:
            changes.append(f"trainer.parallel.cp = {cp}")
        if ac != asked.activation_checkpointing:
            changes.append(f"trainer.activation_checkpointing = {str(ac).lower()}")
        if off != asked.cpu_offload:
            changes.append(f"trainer.optimizer.cpu_offload = {str(off).lower()}")
        plan = TrainerPlan(lay, mem, asked.world, share)
        found.append((len(changes), off, mem.peak, ", ".join(changes) + f" ({mem.peak / GIB:.1f} GiB)", plan))
    found.sort(key=lambda f: f[:3])
    return [(name, plan) for *_, name, plan in found]


def inference_options(
    shape: ServedShape, asked: ServerLayout, heads: int, *, gpu_gib: float, seq_len: int, in_flight: int, servers: int
) -> list[tuple[str, InferencePlan]]:
    """Server layouts that start (tensor parallelism up to 8 that divides the heads, FP8 weights,
    an FP8 KV cache), fewest changed settings first."""
    found = []
    for tp, fp8, kv8 in itertools.product([t for t in (1, 2, 4, 8) if heads % t == 0], (False, True), (False, True)):
        lay = replace(asked, tp=tp, fp8_weights=fp8 or asked.fp8_weights, fp8_kv=kv8 or asked.fp8_kv)
        if lay == asked:
            continue
        mem = server_memory(shape, lay, gpu_gib=gpu_gib, seq_len=seq_len, in_flight=in_flight)
        if mem.problems():
            continue
        changes = []
        if tp != asked.tp:
            changes.append(f"inference.tensor_parallel_size = {tp}")
        if lay.fp8_weights != asked.fp8_weights:
            changes.append('inference.quantization = "fp8"')
        if lay.fp8_kv != asked.fp8_kv:
            changes.append('inference.kv_cache_dtype = "fp8"')
        name = ", ".join(changes) + f" ({mem.seqs_fit} sequences fit)"
        found.append((len(changes), -mem.seqs_fit, name, InferencePlan(lay, mem, servers)))
    found.sort(key=lambda f: f[:2])
    return [(name, plan) for *_, name, plan in found]


def _heads(args: ModelArgs) -> int:
    for layer in args.layers:
        if isinstance(layer.mixer, Attention | MLA):
            return layer.mixer.num_heads
    return 1


def plan_rl(
    cfg,
    args: ModelArgs,
    gpu_gib: float | None,
    *,
    fp8_checkpoint: bool = False,
    servers: int | None = None,
    host_gib: float | None = None,
    host_source: str = "no plan.host_memory_gib",
    node_ranks: int | None = None,
) -> Plan:
    """The plan of an RL run (an RLConfig) of the model `args` on GPUs of `gpu_gib`, its
    `node_ranks` trainer ranks a node (default: all on one) on nodes of `host_gib` memory (None:
    unknown, `host_source` says why)."""
    inf = cfg.inference
    plan = Plan(cfg.model.name, args.num_params(), gpu_gib, None, None)
    if gpu_gib is None:
        return plan
    total = gpu_gib * GIB
    servers = servers or inf.num_replicas
    asked = trainer_layout(cfg, cfg.transport.ranks)
    trainer = trainer_memory(args, asked)
    graphs = 0.0 if inf.enforce_eager else CUDA_GRAPHS_GIB * GIB  # vLLM's, outside its share
    utilization = inf.gpu_memory_utilization
    if utilization is None and cfg.colocate:
        utilization = colocated_share(trainer.peak, total, graphs)
        plan.notes.append(
            f"colocated: vLLM's gpu_memory_utilization {utilization} is what the trainer leaves: "
            f"{TRAINER_HEADROOM} of {gpu_gib:.1f} GiB less its peak {trainer.peak / GIB:.1f} GiB and vLLM's CUDA graphs "
            f"{graphs / GIB:.1f} GiB (a smaller trainer peak leaves vLLM more; inference.gpu_memory_utilization sets it)"
        )
    layout = ServerLayout(
        tp=inf.tensor_parallel_size,
        dp=inf.data_parallel_size,
        expert_parallel=inf.enable_expert_parallel,
        fp8_weights=inf.quantization == "fp8" or fp8_checkpoint,
        fp8_kv=inf.kv_cache_dtype == "fp8",
        gpu_memory_utilization=DEFAULT_GPU_MEMORY_UTILIZATION if utilization is None else max(0.0, utilization),
    )
    orch = cfg.orchestrator
    in_flight = -(-min(orch.max_in_flight, orch.batch_size * (orch.max_async_level + 1)) // servers)
    shape = served_shape(args)
    server = server_memory(shape, layout, gpu_gib=gpu_gib, seq_len=cfg.seq_len, in_flight=in_flight)
    plan.inference = InferencePlan(layout, server, servers)
    share = total * TRAINER_HEADROOM
    if cfg.colocate:
        share -= layout.gpu_memory_utilization * total + graphs
        if inf.gpu_memory_utilization is not None:
            plan.notes.append(
                f"colocated: the trainer gets what vLLM's gpu_memory_utilization = {layout.gpu_memory_utilization} "
                f"and its CUDA graphs ({graphs / GIB:.1f} GiB) leave"
            )
    plan.trainer = TrainerPlan(asked, trainer, asked.world, share)
    if trainer.host:
        plan.host = HostPlan(node_ranks or asked.world, trainer.host, host_gib, host_source)
    if not plan.trainer.fits or (plan.host is not None and not plan.host.fits):
        room = None if plan.host is None or plan.host.share is None else plan.host.share / plan.host.ranks
        plan.trainer_options = trainer_options(args, asked, share, room)
    if not plan.inference.fits:
        plan.inference_options = inference_options(
            shape, layout, _heads(args), gpu_gib=gpu_gib, seq_len=cfg.seq_len, in_flight=in_flight, servers=servers
        )
    return plan


def model_args(name: str, revision: str | None = None) -> tuple[ModelArgs, bool]:
    """(the model's ModelArgs, whether its checkpoint is block FP8) from its config.json
    (ValueError or FileNotFoundError naming what is wrong)."""
    from pathlib import Path

    from primerl_models import family_for, is_hub_id, read_config, resolve_model_folder

    folder = resolve_model_folder(name, revision) if is_hub_id(name) else Path(name)
    hf = read_config(folder)
    args = family_for(hf, where=f"{name}/config.json").args_from_hf(hf)
    quant = hf.get("quantization_config") or {}
    return args, isinstance(quant, dict) and quant.get("quant_method") == "fp8"


def plan_for_launch(cfg, *, slurm: bool) -> Plan | None:
    """The plan of an RL config as it will launch (here, or as a Slurm job: trainer ranks =
    trainer_nodes x gpus_per_node, or x len(trainer_gpus) when set, servers = inference_nodes x
    num_replicas; a node's memory `plan.host_memory_gib`, else here this machine's); None on CPU."""
    from primerl.errors import CheckError

    if slurm and not cfg.slurm.gpus_per_node:
        return None
    if not slurm and cfg.inference.device == "cpu":
        return None
    gpu_gib = cfg.plan.gpu_memory_gib or visible_gpu_gib()
    try:
        args, fp8 = model_args(cfg.model.name, cfg.model.revision)
    except (FileNotFoundError, ValueError, KeyError, TypeError) as err:  # a config.json missing or malformed
        raise CheckError(f"model.name: {cfg.model.name}/config.json: {type(err).__name__}: {err}") from None
    servers = cfg.slurm.inference_nodes * cfg.inference.num_replicas if slurm else None
    host_gib, host_source = cfg.plan.host_memory_gib, "plan.host_memory_gib"
    if host_gib is None and slurm:
        host_source = "--slurm without plan.host_memory_gib"
    elif host_gib is None:
        host_gib = machine_memory_gib()
        host_source = "this machine's MemTotal" if host_gib else "no plan.host_memory_gib, no /proc/meminfo"
    per_node = None
    if slurm:
        per_node = len(cfg.trainer_gpus) if cfg.trainer_gpus else cfg.slurm.gpus_per_node
        cfg = replace_ranks(cfg, cfg.slurm.trainer_nodes * per_node)
    return plan_rl(
        cfg,
        args,
        gpu_gib,
        fp8_checkpoint=fp8,
        servers=servers,
        host_gib=host_gib,
        host_source=host_source,
        node_ranks=per_node,
    )


def replace_ranks(cfg, ranks: int):
    import msgspec

    return msgspec.structs.replace(cfg, transport=msgspec.structs.replace(cfg.transport, trainer_ranks=ranks))


def check_fits(cfg, *, slurm: bool) -> Plan | None:
    """Refuse (CheckError) a launch whose plan does not fit, unless plan.check = false."""
    from primerl.errors import CheckError

    plan = plan_for_launch(cfg, slurm=slurm)
    why = plan.refusal() if plan is not None else None
    if why is None:
        return plan
    if cfg.plan.check:
        raise CheckError(
            f"the run does not fit its GPUs or host memory (`primerl plan` says why; plan.check = false starts it anyway): {why}"
        )
    print(f"warning: the run may not fit its GPUs or host memory: {why}", flush=True)
    return plan


def with_vllm_share(cfg, plan: Plan | None):
    """The config with `inference.gpu_memory_utilization` set to the number the plan took, so
    that the servers start with it (a set value is kept; unset: 0.9, or colocated what the
    trainer leaves: `colocated_share`). Colocated without a plan that knows the GPU's memory, or
    with a trainer that leaves vLLM nothing, there is no number to give vLLM: CheckError naming
    the keys. For runs on GPUs only (a CPU server has no such share)."""
    import msgspec

    from primerl.errors import CheckError

    inf = cfg.inference
    if inf.gpu_memory_utilization is not None:
        return cfg
    if not cfg.colocate:
        utilization = DEFAULT_GPU_MEMORY_UTILIZATION
    elif plan is None or plan.inference is None or plan.trainer is None:
        raise CheckError(
            "colocate = true with inference.gpu_memory_utilization unset: vLLM's share is what the trainer leaves "
            "of each GPU, and the GPU's memory is unknown here (no GPU visible); set plan.gpu_memory_gib "
            "(e.g. 80 for an H100), or inference.gpu_memory_utilization"
        )
    else:
        utilization = plan.inference.layout.gpu_memory_utilization
        if utilization <= 0:
            peak = plan.trainer.memory.peak / GIB
            raise CheckError(
                f"colocate = true: a trainer rank's predicted peak ({peak:.1f} GiB of {plan.gpu_gib:.1f}) leaves vLLM "
                f"no share of its GPU; lower it (`primerl plan` lists trainer layouts) or set "
                f"inference.gpu_memory_utilization"
            )
    return msgspec.structs.replace(cfg, inference=msgspec.structs.replace(inf, gpu_memory_utilization=utilization))
