"""The trainer's side of weights in memory (`trainer.weights.transport = "memory"`): the stream of
primerl_protocol.transfer, sent by rank 0 to the servers' workers, one group of tensors (a
decoder layer, the embeddings, the final norm and head) at a time.

Every rank takes part in each group's gather (FSDP shards and expert-parallel experts are
all-gathered one parameter at a time, in the same order on every rank), so the trainer holds
at most one layer's full tensors beyond its shards; rank 0 casts them to the published dtype on
the device, renames them to HF's names and layouts there (the family's checkpoint table, as a
published folder would hold them), packs them into one buffer there, copies it to host memory
in one piece and broadcasts it.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator

import torch

from primerl_models.hf import family_for
from primerl_protocol import transfer
from primerl_trainer.distributed import Dist

_INDEXED = re.compile(r"^(.*?\.)?(\d+)\.")


def layer_groups(names: list[str]) -> list[list[str]]:
    """Names grouped by their first index segment (`layers.3.` -> one group per layer); names
    without one before the first layer form a group (embeddings), those after it another (final
    norm, head). Every rank computes the same groups in the same order from the same names."""
    pre, post, layers = [], [], {}
    for name in names:
        m = _INDEXED.match(name)
        if m is None:
            (post if layers else pre).append(name)
        else:
            layers.setdefault((m[1] or "", int(m[2])), []).append(name)
    return [g for g in (pre, *layers.values(), post) if g]


class MemorySender:
    """Sends the model's weights to the servers' workers of one transfer group (rank 0 hosts
    the group; every rank calls `send`, whose gathers are collectives)."""

    def __init__(self, model: torch.nn.Module, hf_config: dict, dtype: torch.dtype, d: Dist):
        if any(".lora_" in name for name, _ in model.named_parameters()):
            raise ValueError("trainer.weights.transport = \"memory\" does not carry LoRA adapters yet: "
                             "use transport = \"folder\" with trainer.lora")
        self.hf_config, self.dtype, self.d = hf_config, dtype, d
        self.to_hf = family_for(hf_config).checkpoint.to_hf
        self.group = None
        self.last_timing: dict[str, float] = {}

    def open(self, host: str, port: int, secret: str, world_size: int, timeout_s: float) -> None:
        """Rank 0: host the group and wait (at most `timeout_s`) until its `world_size - 1`
        workers joined (the servers' join route). Other ranks: nothing."""
        if self.d.is_main:
            self.group = transfer.open_group(host, port, secret, 0, world_size, timeout_s)

    def groups(self, model: torch.nn.Module) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Each group's tensors, HF-named, on rank 0's device (empty lists elsewhere)."""
        state = model.state_dict()
        buffers = {name for name, _ in model.named_buffers()}
        for names in layer_groups(list(state)):
            ours = {}
            for name in names:
                tensor = state[name]
                full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
                if self.d.is_main:  # buffers keep their dtype (router correction biases stay fp32)
                    ours[name] = full.detach().to(full.dtype if name in buffers else self.dtype)
                del full
            # renamed (and experts split) on the device; packed there too (transfer.pack)
            yield list(self.to_hf(ours).items()) if self.d.is_main else []

    def send(self, model: torch.nn.Module, step: int) -> str | None:
        """Send the weights after `step` (every rank; the group's members must be receiving);
        rank 0 returns the update's checksum."""
        t0 = time.monotonic()
        with torch.no_grad():
            if not self.d.is_main:
                for _ in self.groups(model):
                    pass
                return None
            if self.group is None:
                raise RuntimeError("no transfer group: open() it first")
            checksum = transfer.send_update(self.group, step, self.groups(model))
        self.last_timing = {"send": time.monotonic() - t0}
        return checksum
