"""Per-token logprobs (and entropy) of target tokens without the full fp32 logits.

With a 151k vocabulary, a 16k-token row has 2.5G logits: 10 GB in fp32, and the usual
`log_softmax(logits.float())` keeps several such tensors alive for backward. Here the output
projection, temperature, log-softmax and gather run over chunks of tokens; only each token's
log-sum-exp (fp32 [N]) is saved, and backward recomputes each chunk's logits. Peak extra
memory is one chunk of [chunk x V] fp32. `keep_logits=True` trades memory for time: the
logits ([N, V] in the hidden dtype) are kept from the forward, not recomputed.

    logprobs_N, entropy_N = chunked_logprobs(hidden_ND, weight_VD, targets_N, temperature)

Gradients flow to `hidden` and `weight` through the logprobs; entropy is returned detached
(a metric). Legend: N tokens, D hidden, V vocab, C tokens per chunk.
"""

from __future__ import annotations

import torch


def _acc_dtype(x: torch.Tensor) -> torch.dtype:
    """fp32 for bf16/fp16/fp32 inputs; fp64 stays fp64 (tests, gradcheck)."""
    return torch.promote_types(x.dtype, torch.float32)


def _forward_stats(logits_CV: torch.Tensor, temp_C1: torch.Tensor, target_C1: torch.Tensor):
    """(logprob, entropy, log-sum-exp) [C] of one chunk of raw logits."""
    z_CV = logits_CV.to(temp_C1.dtype) / temp_C1
    lse_C = torch.logsumexp(z_CV, dim=-1)
    p_CV = torch.exp(z_CV - lse_C[:, None])
    entropy_C = lse_C - (p_CV * z_CV).sum(dim=-1)
    return z_CV.gather(1, target_C1).squeeze(1) - lse_C, entropy_C, lse_C


def _logits_grad(logits_CV, temp_C1, target_C1, lse_C1, grad_C1):
    """d(sum grad * logprob)/d logits = grad * (onehot(target) - softmax) / t, in the logits dtype."""
    z_CV = logits_CV.to(temp_C1.dtype) / temp_C1
    vocab_1V = torch.arange(z_CV.shape[1], device=z_CV.device)[None]
    onehot_CV = (vocab_1V == target_C1).to(z_CV.dtype)
    return ((onehot_CV - torch.exp(z_CV - lse_C1)) * (grad_C1 / temp_C1)).to(logits_CV.dtype)


def _kernels(x: torch.Tensor):
    """The chunk math: one-pass Triton kernels on CUDA (logprobs_kernels.py: each chunk's
    logits read once forward, read and overwritten by their gradient backward); the torch
    forms elsewhere (CPU, and fp64 anywhere: tests, gradcheck)."""
    if not x.is_cuda or x.dtype == torch.float64:
        return _forward_stats, _logits_grad
    from primerl_models.kernels import logprobs as logprobs_kernels

    return logprobs_kernels.forward_stats, logprobs_kernels.logits_grad


def _matmul_into(acc_VD: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """acc + a @ b in `dtype` (the first chunk: a @ b). bf16/fp16 on CUDA: the GEMM writes
    (and accumulates into) fp32 itself, with no rounded [V, D] product in between."""
    if a.is_cuda and a.dtype != dtype:
        if acc_VD is None:
            return torch.mm(a, b, out_dtype=dtype)
        return torch.addmm(acc_VD, a, b, out_dtype=dtype)
    product = (a @ b).to(dtype)
    return product if acc_VD is None else acc_VD.add_(product)


class _ChunkedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_ND, weight_VD, targets_N, temps_N, chunk_size, keep_logits):
        forward_stats, _ = _kernels(hidden_ND)
        w_VD = weight_VD.to(hidden_ND.dtype)
        n = hidden_ND.shape[0]
        acc = _acc_dtype(hidden_ND)
        logprobs_N = hidden_ND.new_empty(n, dtype=acc)
        entropy_N = hidden_ND.new_empty(n, dtype=acc)
        lse_N = hidden_ND.new_empty(n, dtype=acc)
        logits_NV = hidden_ND.new_empty(n, w_VD.shape[0]) if keep_logits else None
        for s in range(0, n, chunk_size):
            e = min(s + chunk_size, n)
            if logits_NV is not None:  # keep_logits
                logits_CV = torch.mm(hidden_ND[s:e], w_VD.T, out=logits_NV[s:e])
            else:
                logits_CV = hidden_ND[s:e] @ w_VD.T
            logprobs_N[s:e], entropy_N[s:e], lse_N[s:e] = forward_stats(
                logits_CV, temps_N[s:e, None], targets_N[s:e, None]
            )
        ctx.save_for_backward(hidden_ND, weight_VD, targets_N, temps_N, lse_N, logits_NV)
        ctx.chunk_size = chunk_size
        ctx.logits_spent = False
        ctx.mark_non_differentiable(entropy_N)
        return logprobs_N, entropy_N

    @staticmethod
    def backward(ctx, grad_logprobs_N, _grad_entropy):
        hidden_ND, weight_VD, targets_N, temps_N, lse_N, logits_NV = ctx.saved_tensors
        if logits_NV is not None:
            if ctx.logits_spent:
                raise RuntimeError(
                    "chunked_logprobs(keep_logits=True) differentiates once: its first backward "
                    "overwrote the kept logits with their gradient (keep_logits=False recomputes them)"
                )
            ctx.logits_spent = True
        _, logits_grad = _kernels(hidden_ND)
        w_VD = weight_VD.to(hidden_ND.dtype)
        acc = _acc_dtype(hidden_ND)
        grad_hidden_ND = torch.empty_like(hidden_ND) if ctx.needs_input_grad[0] else None
        grad_w_VD = None
        grad_N = grad_logprobs_N.to(acc)
        n = hidden_ND.shape[0]
        for s in range(0, n, ctx.chunk_size):
            e = min(s + ctx.chunk_size, n)
            # kept from the forward, or recomputed (the gradient may overwrite either)
            logits_CV = logits_NV[s:e] if logits_NV is not None else hidden_ND[s:e] @ w_VD.T
            grad_CV = logits_grad(
                logits_CV, temps_N[s:e, None], targets_N[s:e, None], lse_N[s:e, None], grad_N[s:e, None]
            )
            if grad_hidden_ND is not None:
                grad_hidden_ND[s:e] = grad_CV @ w_VD
            if ctx.needs_input_grad[1]:
                grad_w_VD = _matmul_into(grad_w_VD, grad_CV.T, hidden_ND[s:e], acc)
        if grad_w_VD is not None:
            grad_w_VD = grad_w_VD.to(weight_VD.dtype)
        return grad_hidden_ND, grad_w_VD, None, None, None, None


def chunked_logprobs(
    hidden_ND: torch.Tensor,
    weight_VD: torch.Tensor,
    targets_N: torch.Tensor,
    temperature: float | torch.Tensor = 1.0,
    chunk_size: int = 4096,
    keep_logits: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprobs [N], entropy [N]) of `targets` under softmax(hidden @ weight.T / t), in fp32
    (fp64 for fp64 inputs).

    `temperature` is a float or a per-token [N] tensor (each token at its sampling temperature).
    `keep_logits`: hold every chunk's logits ([N, V] in hidden's dtype) from the forward to the
    backward instead of recomputing them there: one output-projection matmul less per step, for
    N x V more memory (8 GB at 16k tokens of a 248k vocab in bf16); backward then runs once.
    """
    if hidden_ND.ndim != 2 or targets_N.shape != hidden_ND.shape[:1]:
        raise ValueError(
            f"hidden must be [N, D] and targets [N]; got {tuple(hidden_ND.shape)}, {tuple(targets_N.shape)}"
        )
    acc = torch.promote_types(hidden_ND.dtype, torch.float32)
    temps_N = torch.as_tensor(temperature, dtype=acc, device=hidden_ND.device).expand(hidden_ND.shape[0])
    vocab = weight_VD.shape[0]
    # one host sync for both checks (the kernels index the logits by target unchecked)
    bad_temp, bad_target = (
        torch.stack([(temps_N <= 0).any(), ((targets_N < 0) | (targets_N >= vocab)).any()]).tolist()
        if hidden_ND.shape[0]
        else (False, False)
    )
    if bad_temp:
        raise ValueError("temperatures must be positive")
    if bad_target:
        raise ValueError(
            f"targets must be token ids in [0, {vocab}); got {int(targets_N.min())}..{int(targets_N.max())}"
        )
    return _ChunkedLogprobs.apply(hidden_ND, weight_VD, targets_N.long(), temps_N.contiguous(), chunk_size, keep_logits)
