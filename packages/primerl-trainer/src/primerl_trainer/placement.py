"""Placing the model for training: the mesh of ranks, loading the model, then, in torchtitan's
order, FP8 linear layers (trainer.precision, precision.py), expert parallelism, activation
checkpointing, torch.compile and FSDP2 (each MoE layer's experts, each decoder layer, then the
root), and context parallelism as the attention back-end. All of it is applied from outside
primerl-models' code, which stays plain modules.

    mesh = build_mesh(cfg.trainer.parallel, d)          # dp x cp ranks, ep groups
    model, loaded = load_for_training(cfg, d, mesh)     # what the trainer does, from its config
    parallelize(model, device, mesh, activation_checkpointing=True, compile_layers=True)  # the steps

The mesh (one code path for any sizes, 1 included): rank = g * cp + c is rank c of data-parallel
group g; a group's cp ranks split each of its rows (context_parallel.py). Expert-parallel
groups are ep consecutive ranks (expert_parallel.py). FSDP2 shards every dense parameter over
all ranks, and each expert weight over the world / ep ranks that hold the same experts.

Gradients: each rank's loss is its share of the global batch's loss, back-propagated as it is,
and every FSDP2 reduction is a plain sum (no average, no divide factor): a dense gradient is
the sum over all ranks, i.e. over every token of the batch. A rank's expert gradients already
hold every token of its EP group (the all-to-all's backward brought them), so their sum over
the world / ep ranks holding the same experts is again the sum over every token; with
ep = world that "sum" is over one rank, and nothing is reduced or divided. (Dividing instead,
FSDP2's default, needs a factor per mesh, and torch 2.13 divides twice by a factor set on a
one-rank mesh with sum-only reductions: EP = world trained on half the expert gradients.)

Activation checkpointing wraps each chosen decoder layer's forward in `torch.utils.checkpoint`
(non-reentrant): its activations are recomputed in the backward pass instead of being kept.
Parameter names do not change (no wrapper module), so checkpoints, HF conversion and FSDP2 see
the same model.

Mixed precision: on GPUs the sharded parameters stay fp32 and are all-gathered as bf16
(`MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`); on CPUs everything is fp32.
With `cpu_offload`, parameters, gradients and optimizer state live in CPU memory
(FSDP2's CPUOffloadPolicy) and the optimizer step runs there. A CPU trainer has nothing to
offload (its states are in host memory already): `cpu_offload` is ignored there, with one
warning (FSDP2's policy would pin memory, which needs an accelerator).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from primerl_models import ModelArgs, MoEMLP, Transformer, load_model, read_config, resolve_model_folder
from primerl_models.blocks.moe import MoE
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.utils.checkpoint import checkpoint

from primerl_trainer.config import ParallelConfig, SFTRunConfig, TrainerRunConfig
from primerl_trainer.context_parallel import UlyssesAttention
from primerl_trainer.distributed import Dist
from primerl_trainer.expert_parallel import shard_experts
from primerl_trainer.lora import apply_lora
from primerl_trainer.precision import convert_to_fp8

log = logging.getLogger("primerl.trainer")


@dataclass(frozen=True)
class Mesh:
    """This rank's place among the trainer's ranks (see the module's docstring)."""

    world: int
    dp: int
    cp: int
    ep: int
    rank: int
    dense: DeviceMesh
    """All ranks, 1-D: FSDP2 of every parameter but the sharded experts."""
    cp_group: dist.ProcessGroup | None = None
    """This rank's context-parallel group (None when cp == 1)."""
    experts: DeviceMesh | None = None
    """(efsdp, ep) when ep > 1: "ep" shards the experts, "efsdp" (world / ep ranks, the same
    experts) is FSDP2's mesh for them."""

    @property
    def cp_rank(self) -> int:
        return self.rank % self.cp

    @property
    def row_share(self) -> float:
        """What this rank counts of its rows' sums (loss, metrics, tokens, FLOPs) so that a sum
        over all ranks counts each row once: 1 on the first rank of a context-parallel group,
        0 on the others (they computed the same whole-row values)."""
        return 1.0 if self.cp_rank == 0 else 0.0

    @property
    def layout(self) -> dict[str, int]:
        return {"dp": self.dp, "cp": self.cp, "ep": self.ep}

    def group_rows(self, rows: list) -> list:
        """The rows a rank trains on: its own, or with context parallelism those of every rank
        of its group (in rank order: each row is split over the group, so all of them run every
        row). The orchestrator packs per rank; a group trains on what its ranks were sent."""
        if self.cp == 1:
            return rows
        parts: list[list] = [[] for _ in range(self.cp)]  # all_gather_object puts each rank's rows in
        dist.all_gather_object(parts, rows, group=self.cp_group)
        return [row for part in parts for row in part]


def build_mesh(parallel: ParallelConfig, d: Dist) -> Mesh:
    """The mesh of `parallel` over this job's ranks (ValueError naming the keys if it does not fit)."""
    dp, cp, ep = parallel.layout(d.world_size)
    kind = d.device.type
    dense = init_device_mesh(kind, (d.world_size,), mesh_dim_names=("fsdp",))
    cp_group = init_device_mesh(kind, (dp, cp), mesh_dim_names=("dp", "cp")).get_group("cp") if cp > 1 else None
    experts = init_device_mesh(kind, (d.world_size // ep, ep), mesh_dim_names=("efsdp", "ep")) if ep > 1 else None
    return Mesh(d.world_size, dp, cp, ep, d.rank, dense, cp_group, experts)


def check_fits(args: ModelArgs, ep: int, cp: int) -> None:
    """ValueError naming the key when the model of `args` cannot be split over ep and cp ranks."""
    layers = args.layers
    if ep > 1:
        moe = sorted({layer.mlp.num_experts for layer in layers if isinstance(layer.mlp, MoEMLP)})
        if not moe:
            raise ValueError(f"trainer.parallel.ep = {ep}, but the model has no MoE layer (no experts to split)")
        if bad := [n for n in moe if n % ep]:
            raise ValueError(f"trainer.parallel.ep = {ep} does not divide the model's {bad[0]} experts per MoE layer")
    if cp > 1:
        for i, layer in enumerate(layers):
            mixer = layer.mixer
            if mixer is None:  # an MLP alone (Nemotron-H): nothing along the sequence
                continue
            for count, what in mixer.cp_splits():  # what context parallelism splits over the ranks
                if count % cp:
                    raise ValueError(f"trainer.parallel.cp = {cp} does not divide layer {i}'s {count} {what}")


@dataclass
class LoadedModel:
    folder: Path
    """The local HF folder the weights came from (its tokenizer files travel with published weights)."""
    hf_config: dict


def load_for_training(cfg: TrainerRunConfig | SFTRunConfig, d: Dist, mesh: Mesh) -> tuple[Transformer, LoadedModel]:
    """Every rank loads the HF checkpoint (CPU), then it is placed on the mesh (FSDP2 shards it
    onto the rank's device). ValueError when the model does not fit the mesh."""
    folder = resolve_model_folder(cfg.model.name, cfg.model.revision)
    tcfg = cfg.trainer
    model = load_model(folder, device="cpu", attn_backend=tcfg.attention, freeze_vision=tcfg.freeze_vision)
    model.train()
    model.keep_logits = tcfg.keep_logits
    if tcfg.lora is not None:  # before FSDP2 wraps the layers: adapters and frozen weights shard alike
        apply_lora(model, tcfg.lora)
    check_fits(model.args, mesh.ep, mesh.cp)
    if tcfg.precision == "fp8":  # before compile and FSDP2 (precision.py); the config refuses it with LoRA
        converted = convert_to_fp8(model)
        if d.is_main:
            log.info(
                "trainer.precision = fp8: %d linear projections of the decoder layers run as row-wise FP8 matmuls "
                "(the rest in bf16: precision.py)%s",
                len(converted),
                "" if tcfg.compile else "; without trainer.compile the casts run as separate ops (little speed-up)",
            )
    parallelize(
        model,
        d.device,
        mesh,
        activation_checkpointing=tcfg.activation_checkpointing,
        compile_layers=tcfg.compile,
        bf16=tcfg.dtype == "bfloat16",
        cpu_offload=tcfg.optimizer.cpu_offload,
    )
    return model, LoadedModel(folder, read_config(folder))


def apply_activation_checkpointing(model: Transformer, every: int = 1) -> int:
    """Checkpoint every `every`-th decoder layer; returns how many layers were wrapped."""
    if every < 1:
        raise ValueError(f"every must be >= 1, got {every}")
    wrapped = 0
    for i, layer in enumerate(model.layers):
        if i % every or getattr(layer, "_primerl_checkpointed", False):
            continue
        inner = layer.forward

        def forward(*args, _inner=inner, **kwargs):
            if not torch.is_grad_enabled():
                return _inner(*args, **kwargs)
            return checkpoint(_inner, *args, use_reentrant=False, **kwargs)

        layer.forward = forward
        setattr(layer, "_primerl_checkpointed", True)  # a marker (getattr above), not a module attribute
        wrapped += 1
    return wrapped


def parallelize(
    model: Transformer,
    device: torch.device,
    mesh: Mesh | None = None,
    *,
    activation_checkpointing: bool = False,
    compile_layers: bool = False,
    bf16: bool = True,
    cpu_offload: bool = False,
) -> Transformer:
    """Place `model` on `mesh` (default: FSDP2 over all ranks, nothing else), in place."""
    experts = None
    if mesh is not None and mesh.ep > 1:
        assert mesh.experts is not None, "build_mesh makes the experts' mesh whenever ep > 1"
        experts = mesh.experts
        shard_experts(model, experts["ep"])
    if activation_checkpointing:
        apply_activation_checkpointing(model)
    if compile_layers:
        for layer in model.layers:
            layer.compile()
    if mesh is not None and mesh.cp > 1:
        ulysses = UlyssesAttention(mesh.cp_group, model.attn_backend)
        # a callable back-end (attention() takes one), which primerl_models' `Backend` type leaves out
        model.attn_backend = ulysses
    use_bf16 = bf16 and device.type == "cuda"
    mp_policy = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16 if use_bf16 else torch.float32, reduce_dtype=torch.float32
    )
    if cpu_offload and device.type != "cuda":
        cpu_offload = False
        if not dist.is_initialized() or dist.get_rank() == 0:
            log.warning(
                "trainer.optimizer.cpu_offload = true on a CPU trainer: ignored (its weights, gradients and optimizer "
                "states are in host memory already)"
            )
    offload_policy = CPUOffloadPolicy() if cpu_offload else OffloadPolicy()  # the latter: fully_shard's default
    dense = None if mesh is None else mesh.dense

    def shard(module: torch.nn.Module, on: DeviceMesh | None) -> None:
        _summing(fully_shard(module, mesh=on, mp_policy=mp_policy, offload_policy=offload_policy))

    if experts is not None:
        for module in model.modules():
            if isinstance(module, MoE):
                shard(module.experts, experts["efsdp"])
    for layer in model.layers:
        shard(layer, dense)
    shard(model, dense)
    return model


def _summing(module: FSDPModule) -> FSDPModule:
    """FSDP2's gradient reduction of `module` as a plain sum over its mesh (see the module's
    docstring): a divide factor of 1 and sum-only collectives, so that no version's rule for
    averaging (AVG, PREMUL_SUM, a division after the collective or on a one-rank mesh in its
    place) applies."""
    module.set_gradient_divide_factor(1.0)
    module.set_force_sum_reduction_for_comms(True)
    return module
