"""One-pass Triton kernels for `logprobs.chunked_logprobs` on CUDA: a chunk's logits are read
once in the forward (an online log-sum-exp that carries the entropy's sum along) and read once
and overwritten by their gradient in the backward. The compiled torch form they replace read
each [C, V] chunk several times and kept fp32 copies of it (the logits chunk is 2 GB in bf16
at 4,096 x 248k: ~16 ms of a Qwen3.5-0.8B step at 16k went to it).

    logprob_C, entropy_C, lse_C = forward_stats(logits_CV, temp_C1, target_C1)
    grad_CV = logits_grad(logits_CV, temp_C1, target_C1, lse_C1, grad_C1)   # in place

Same definitions as logprobs._forward_stats / _logits_grad (z = logits / t in fp32). Legend:
C tokens in the chunk, V vocab.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

BLOCK_V = 4096


@functools.cache
def _triton_kernels() -> tuple[Any, Any, Any]:
    """(triton, stats kernel, grad kernel), built on first use (Triton comes with CUDA torch only).
    Any: Triton's module and JIT functions, which the type checker cannot see without Triton."""
    import triton  # pyright: ignore[reportMissingImports]
    import triton.language as tl  # pyright: ignore[reportMissingImports]

    @triton.jit
    def _stats_kernel(
        logits_ptr, stride, temps_ptr, targets_ptr, logprob_ptr, entropy_ptr, lse_ptr, V, BLOCK: tl.constexpr
    ):
        # one row: m the running max of z, s = sum exp(z - m), t = sum exp(z - m) z
        row = tl.program_id(0).to(tl.int64)
        base = logits_ptr + row * stride
        inv_t = 1.0 / tl.load(temps_ptr + row)
        m = tl.full([BLOCK], float("-inf"), tl.float32)
        s = tl.zeros([BLOCK], tl.float32)
        t = tl.zeros([BLOCK], tl.float32)
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            z = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32) * inv_t
            new_m = tl.maximum(m, z)
            # lanes still at -inf (nothing seen yet) keep s = t = 0
            scale = tl.where(new_m == float("-inf"), 0.0, tl.exp(m - new_m))
            seen = z != float("-inf")
            p = tl.where(seen, tl.exp(z - new_m), 0.0)
            s = s * scale + p
            t = t * scale + p * tl.where(seen, z, 0.0)
            m = new_m
        row_m = tl.max(m, axis=0)
        lane = tl.where(m == float("-inf"), 0.0, tl.exp(m - row_m))
        total = tl.sum(s * lane, axis=0)
        lse = row_m + tl.log(total)
        entropy = lse - tl.sum(t * lane, axis=0) / total
        target_z = tl.load(base + tl.load(targets_ptr + row)).to(tl.float32) * inv_t
        tl.store(lse_ptr + row, lse)
        tl.store(entropy_ptr + row, entropy)
        tl.store(logprob_ptr + row, target_z - lse)

    @triton.jit
    def _grad_kernel(logits_ptr, stride, temps_ptr, targets_ptr, lse_ptr, grad_ptr, V, BLOCK: tl.constexpr):
        # (onehot(target) - exp(z - lse)) * grad / t over one block of one row, written over the logits
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < V
        ptr = logits_ptr + row * stride + cols
        inv_t = 1.0 / tl.load(temps_ptr + row)
        z = tl.load(ptr, mask=mask, other=0.0).to(tl.float32) * inv_t
        p = tl.exp(z - tl.load(lse_ptr + row))
        onehot = tl.where(cols == tl.load(targets_ptr + row), 1.0, 0.0)
        g = (onehot - p) * (tl.load(grad_ptr + row) * inv_t)
        tl.store(ptr, g.to(logits_ptr.dtype.element_ty), mask=mask)

    return triton, _stats_kernel, _grad_kernel


def _rows(logits_CV: torch.Tensor) -> int:
    if logits_CV.stride(1) != 1:
        raise ValueError(f"logits chunk must be row-contiguous; strides {logits_CV.stride()}")
    return logits_CV.shape[0]


def forward_stats(logits_CV: torch.Tensor, temp_C1: torch.Tensor, target_C1: torch.Tensor):
    """(logprob, entropy, log-sum-exp) [C] fp32 of one chunk of raw logits, one read of them."""
    c = _rows(logits_CV)
    _, stats_kernel, _ = _triton_kernels()
    out = torch.empty(3, c, dtype=torch.float32, device=logits_CV.device)
    if c:
        stats_kernel[(c,)](
            logits_CV,
            logits_CV.stride(0),
            temp_C1.contiguous(),
            target_C1.contiguous(),
            out[0],
            out[1],
            out[2],
            logits_CV.shape[1],
            BLOCK=BLOCK_V,
            num_warps=8,
        )
    return out[0], out[1], out[2]


def logits_grad(logits_CV, temp_C1, target_C1, lse_C1, grad_C1):
    """grad * (onehot(target) - softmax) / t in the logits dtype, written over `logits_CV` (the
    recomputed chunk, not needed after) and returned."""
    c = _rows(logits_CV)
    triton, _, grad_kernel = _triton_kernels()
    if c:
        grid = (c, triton.cdiv(logits_CV.shape[1], BLOCK_V))
        grad_kernel[grid](
            logits_CV,
            logits_CV.stride(0),
            temp_C1.contiguous(),
            target_C1.contiguous(),
            lse_C1.contiguous(),
            grad_C1.contiguous(),
            logits_CV.shape[1],
            BLOCK=BLOCK_V,
            num_warps=8,
        )
    return logits_CV
