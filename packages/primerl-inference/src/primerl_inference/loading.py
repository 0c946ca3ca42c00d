"""What the worker extension (worker.py) and the weight-transfer engine (transfer.py) both need
to know of loading weights into vLLM's models: which tensors a reload misses (RELOADED_AGAIN;
worker.py says why) and the models' `load_weights`. Neither torch nor vLLM is imported here."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol, cast

if TYPE_CHECKING:
    from torch import Tensor, nn

RELOADED_AGAIN = {"GptOssForCausalLM": (".self_attn.sinks", ".mlp.experts.")}
"""Model classes whose loader bypasses the weight loaders for some tensors: the checkpoint name
pieces of those tensors, loaded again after each reload."""


class LoadsWeights(Protocol):
    """A vLLM model: every model class vLLM serves defines `load_weights`."""

    def load_weights(self, weights: Iterable[tuple[str, Tensor]], /) -> object: ...


def loader(model: nn.Module) -> LoadsWeights:
    """`model` (typed `nn.Module` by vLLM's worker and engine) as the vLLM model it is."""
    # cast: nn.Module does not declare load_weights, which vLLM's model classes all define.
    return cast(LoadsWeights, model)
