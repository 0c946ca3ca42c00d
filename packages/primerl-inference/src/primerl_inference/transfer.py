"""`primerl_gloo`: a vLLM weight-transfer engine that receives the trainer's weights in memory
over torch.distributed's gloo (primerl_protocol.transfer's stream), registered through vLLM's
`WeightTransferEngineFactory`. The launcher starts every server with
`--weight-transfer-config '{"backend": "primerl_gloo"}'`; the worker extension (worker.py)
imports this module in each worker, which registers the engine before vLLM builds it.

vLLM's worker drives it as it drives its own NCCL engine: `init_weight_transfer_engine` (join
the trainer's group), then per update `start_weight_update` (vLLM's layer-wise reload: each
layer is processed once all its weights arrived), `update_weights` (receive the stream, each
group of tensors given to the model's `load_weights`), `finish_weight_update`. Why our own
back-end rather than vLLM's: its dense engines broadcast over NCCL (GPUs only) and none runs on
gloo, so none runs on the CPU machines; this one does, on CPU and GPU (through host memory).
"""

from __future__ import annotations

from dataclasses import dataclass

from primerl_protocol import transfer

from primerl_inference.loading import RELOADED_AGAIN, loader

try:
    import torch
    from vllm.distributed.weight_transfer.base import (
        WeightTransferEngine,
        WeightTransferInitInfo,
        WeightTransferUpdateInfo,
    )
except ImportError:  # no vLLM, or one without weight-transfer engines: the in-memory transport is not offered
    WeightTransferEngine = None


if WeightTransferEngine is not None:

    @dataclass
    class GlooInitInfo(WeightTransferInitInfo):
        host: str
        port: int
        secret: str
        rank_offset: int
        """The group rank of this server's first worker (the trainer is rank 0)."""
        world_size: int
        timeout_s: float = 600.0

    @dataclass
    class GlooUpdateInfo(WeightTransferUpdateInfo):
        step: int

    class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
        init_info_cls = GlooInitInfo
        update_info_cls = GlooUpdateInfo
        supports_draft_weight_update = False

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.group = None
            self.received: tuple[int, str, int] | None = None
            """(step, checksum, bytes) of the last update received whole."""
            self.kept: list = []
            """Received tensors the worker loads again after the reload (loading.RELOADED_AGAIN)."""

        def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
            self.shutdown()
            rank = (
                init_info.rank_offset
                + self.parallel_config.data_parallel_index * self.parallel_config.world_size
                + self.parallel_config.rank
            )
            self.group = transfer.open_group(
                init_info.host, init_info.port, init_info.secret, rank, init_info.world_size, init_info.timeout_s
            )

        def start_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

            self.received, self.kept = None, []
            initialize_layerwise_reload(self.model)

        def receive_weights(self, update_info: GlooUpdateInfo) -> None:
            if self.group is None:
                raise RuntimeError("no transfer group: the server has not joined the trainer's (join first)")
            pieces = RELOADED_AGAIN.get(type(self.model).__name__, ())

            def load(tensors):
                if pieces:
                    self.kept += [(n, t.clone()) for n, t in tensors if any(p in n for p in pieces)]
                loader(self.model).load_weights([(n, t.to(self.device)) for n, t in tensors])

            with torch.no_grad():
                checksum, size = transfer.receive_update(self.group, update_info.step, load)
            self.received = (update_info.step, checksum, size)

        def finish_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            finalize_layerwise_reload(self.model, self.model_config)

        def shutdown(self) -> None:
            self.group = None


def register() -> None:
    """Register the engine with vLLM's factory (once per process; nothing without vLLM's engines)."""
    if WeightTransferEngine is None:
        return
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if transfer.BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(transfer.BACKEND, GlooWeightTransferEngine)
