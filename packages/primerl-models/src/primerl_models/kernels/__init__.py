"""GPU kernels (Triton, torch custom ops), each the fast path of a torch form that stays the
reference on every other device and in the tests:

    conv.py          causal_conv_silu          <- blocks.recurrent.causal_conv (then SiLU)
    gated_delta.py   gated_delta_rule (fla)    <- blocks.gated_deltanet.gated_delta_rule
    state_scan.py    chunk_states (Triton)     <- its own _scan_loop (the loop on CPU)
    logprobs.py      forward_stats, logits_grad <- logprobs._forward_stats, logprobs._logits_grad
    sparse_mla.py    sparse_mla_triton         <- blocks.mla._SparseMLA (GLM-5's sparse absorbed attention)

Each imports Triton (or fla) only when first used on CUDA.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ParamSpec, TypeVar, cast

import torch

_P = ParamSpec("_P")
_R = TypeVar("_R")


def compiler_disabled(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """`torch.compiler.disable(fn)` (eager inside compiled code), keeping fn's signature."""
    # cast: torch.compiler.disable is unannotated, so the checker infers the union of everything
    # it can return (a decorator too); called with a function it returns that function, wrapped.
    return cast("Callable[_P, _R]", torch.compiler.disable(fn))
