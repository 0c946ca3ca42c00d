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

Where the loss is a sum of per-token terms, each a function of its own token's logprob only
(the token-local losses: NLL, AIPO, CISPO, PPO, DPPO; not GSPO's sequence ratio),
`chunked_token_loss` takes the loss's terms and computes the gradients while each chunk's
logits are in hand: one output-projection matmul less than recomputing them in the backward
(as `keep_logits`), with no [N, V] logits kept.

    loss, logprobs_N, entropy_N = chunked_token_loss(hidden_ND, weight_VD, targets_N, terms, temperature)
"""

from __future__ import annotations

from collections.abc import Callable

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


class _Chunks:
    """What both Functions loop with: the chunk kernels, the weight in the hidden states' dtype,
    the accumulation dtype, and a chunk's statistics and gradients."""

    def __init__(self, hidden_ND, weight_VD, targets_N, temps_N):
        self.forward_stats, self.logits_grad = _kernels(hidden_ND)
        self.h_ND, self.w_VD = hidden_ND, weight_VD.to(hidden_ND.dtype)
        self.targets_N, self.temps_N = targets_N, temps_N
        self.acc = _acc_dtype(hidden_ND)
        self.n = hidden_ND.shape[0]

    def vector(self) -> torch.Tensor:
        return self.h_ND.new_empty(self.n, dtype=self.acc)

    def logits(self, s: int, e: int) -> torch.Tensor:
        return self.h_ND[s:e] @ self.w_VD.T

    def stats(self, logits_CV, s: int, e: int):
        """(logprob, entropy, log-sum-exp) [C] of tokens s..e-1."""
        return self.forward_stats(logits_CV, self.temps_N[s:e, None], self.targets_N[s:e, None])

    def grads(self, logits_CV, s, e, lse_C, grad_C, grad_hidden_ND, grad_w_VD, want_weight):
        """The gradients of tokens s..e-1's logprobs (times grad_C) into grad_hidden_ND[s:e] (if
        any) and the weight's accumulator (returned; None before the first chunk). May overwrite
        `logits_CV` with its gradient."""
        grad_CV = self.logits_grad(logits_CV, self.temps_N[s:e, None], self.targets_N[s:e, None], lse_C, grad_C)
        if grad_hidden_ND is not None:
            grad_hidden_ND[s:e] = grad_CV @ self.w_VD
        if want_weight:
            grad_w_VD = _matmul_into(grad_w_VD, grad_CV.T, self.h_ND[s:e], self.acc)
        return grad_w_VD


class _ChunkedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_ND, weight_VD, targets_N, temps_N, chunk_size, keep_logits):
        c = _Chunks(hidden_ND, weight_VD, targets_N, temps_N)
        logprobs_N, entropy_N, lse_N = c.vector(), c.vector(), c.vector()
        logits_NV = hidden_ND.new_empty(c.n, c.w_VD.shape[0]) if keep_logits else None
        for s in range(0, c.n, chunk_size):
            e = min(s + chunk_size, c.n)
            if logits_NV is not None:  # keep_logits
                logits_CV = torch.mm(hidden_ND[s:e], c.w_VD.T, out=logits_NV[s:e])
            else:
                logits_CV = c.logits(s, e)
            logprobs_N[s:e], entropy_N[s:e], lse_N[s:e] = c.stats(logits_CV, s, e)
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
        c = _Chunks(hidden_ND, weight_VD, targets_N, temps_N)
        grad_hidden_ND = torch.empty_like(hidden_ND) if ctx.needs_input_grad[0] else None
        grad_w_VD = None
        grad_N = grad_logprobs_N.to(c.acc)
        for s in range(0, c.n, ctx.chunk_size):
            e = min(s + ctx.chunk_size, c.n)
            # kept from the forward, or recomputed (the gradient may overwrite either)
            logits_CV = logits_NV[s:e] if logits_NV is not None else c.logits(s, e)
            grad_w_VD = c.grads(
                logits_CV, s, e, lse_N[s:e, None], grad_N[s:e, None], grad_hidden_ND, grad_w_VD, ctx.needs_input_grad[1]
            )
        if grad_w_VD is not None:
            grad_w_VD = grad_w_VD.to(weight_VD.dtype)
        return grad_hidden_ND, grad_w_VD, None, None, None, None


class _ChunkedTokenLoss(torch.autograd.Function):
    """The loss's gradients computed in the forward, chunk by chunk; the backward scales them."""

    @staticmethod
    def forward(ctx, hidden_ND, weight_VD, targets_N, temps_N, terms, chunk_size):
        c = _Chunks(hidden_ND, weight_VD, targets_N, temps_N)
        logprobs_N, entropy_N = c.vector(), c.vector()
        loss = hidden_ND.new_zeros((), dtype=c.acc)
        want_hidden, want_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden_ND = torch.empty_like(hidden_ND) if want_hidden else None
        grad_w_VD = None
        for s in range(0, c.n, chunk_size):
            e = min(s + chunk_size, c.n)
            logits_CV = c.logits(s, e)
            logprob_C, entropy_N[s:e], lse_C = c.stats(logits_CV, s, e)
            logprobs_N[s:e] = logprob_C
            with torch.enable_grad():
                leaf_C = logprob_C.detach().requires_grad_(want_hidden or want_weight)
                terms_C = terms(leaf_C, s, e)
                if terms_C.shape != (e - s,):
                    raise ValueError(f"the loss's terms of tokens [{s}, {e}) have shape {tuple(terms_C.shape)}")
                chunk_loss = terms_C.to(c.acc).sum()
                grad_C = (
                    torch.autograd.grad(chunk_loss, leaf_C, allow_unused=True)[0] if chunk_loss.requires_grad else None
                )
            loss += chunk_loss.detach()
            if not (want_hidden or want_weight):
                continue
            if grad_C is None:  # terms that do not depend on the logprobs
                grad_C = torch.zeros_like(logprob_C)
            grad_w_VD = c.grads(
                logits_CV, s, e, lse_C[:, None], grad_C[:, None], grad_hidden_ND, grad_w_VD, want_weight
            )
        ctx.save_for_backward(grad_hidden_ND, grad_w_VD)
        ctx.weight_dtype = weight_VD.dtype
        ctx.mark_non_differentiable(logprobs_N, entropy_N)
        return loss, logprobs_N, entropy_N

    @staticmethod
    def backward(ctx, grad_loss, _grad_logprobs, _grad_entropy):
        grad_hidden_ND, grad_w_VD = ctx.saved_tensors
        if grad_hidden_ND is not None:
            grad_hidden_ND = grad_hidden_ND * grad_loss.to(grad_hidden_ND.dtype)
        if grad_w_VD is not None:
            grad_w_VD = (grad_w_VD * grad_loss).to(ctx.weight_dtype)
        return grad_hidden_ND, grad_w_VD, None, None, None, None


def _checked_temperatures(hidden_ND: torch.Tensor, weight_VD: torch.Tensor, targets_N: torch.Tensor, temperature):
    """Per-token temperatures [N] in the accumulation dtype, after checking them and the
    targets (one host sync for both: the kernels index the logits by target unchecked)."""
    if hidden_ND.ndim != 2 or targets_N.shape != hidden_ND.shape[:1]:
        raise ValueError(
            f"hidden must be [N, D] and targets [N]; got {tuple(hidden_ND.shape)}, {tuple(targets_N.shape)}"
        )
    acc = torch.promote_types(hidden_ND.dtype, torch.float32)
    temps_N = torch.as_tensor(temperature, dtype=acc, device=hidden_ND.device).expand(hidden_ND.shape[0])
    vocab = weight_VD.shape[0]
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
    return temps_N.contiguous()


TokenTerms = Callable[[torch.Tensor, int, int], torch.Tensor]
"""terms(logprobs_C, s, e) -> [e - s]: the loss's terms of tokens s..e-1 from their logprobs."""


def chunked_token_loss(
    hidden_ND: torch.Tensor,
    weight_VD: torch.Tensor,
    targets_N: torch.Tensor,
    terms: TokenTerms,
    temperature: float | torch.Tensor = 1.0,
    chunk_size: int = 4096,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, logprobs [N], entropy [N]) with loss = sum over tokens of `terms`, whose gradient
    reaches `hidden` and `weight` as that of sum(terms(chunked_logprobs(...))) does.

    `terms(logprobs_C, s, e)` gets the logprobs of tokens s..e-1 (a leaf with gradient) and
    returns their loss terms [e - s]; a term must depend on its own token's logprob only, and
    on nothing else that needs a gradient. It runs inside the forward, once per chunk, and the
    gradients of `hidden` and `weight` are computed there, while the chunk's logits exist:
    three output-projection matmuls a step instead of four, and no logits kept. The backward
    only scales them by the loss's gradient. logprobs and entropy come back detached (metrics).
    """
    temps_N = _checked_temperatures(hidden_ND, weight_VD, targets_N, temperature)
    return _ChunkedTokenLoss.apply(hidden_ND, weight_VD, targets_N.long(), temps_N, terms, chunk_size)


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
    temps_N = _checked_temperatures(hidden_ND, weight_VD, targets_N, temperature)
    return _ChunkedLogprobs.apply(hidden_ND, weight_VD, targets_N.long(), temps_N, chunk_size, keep_logits)
