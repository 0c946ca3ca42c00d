"""Policy-gradient losses over the tokens of one micro-batch, normalised for the global batch.

Every loss sees, per token t: pi_t the trainer's logprob (at the token's sampling temperature,
with gradient), mu_t the inference server's logprob, A_t the advantage, and the loss mask.
With r_t = exp(pi_t - mu_t) (log-ratio clamped to +-20 so that no ratio is infinite; the clamp
bounds values only: aipo's and cispo's gradient -w A grad(pi) holds beyond it too):

  aipo   l = -min(r, delta) A            gradient -min(r, delta) A grad(pi): truncated IS
  cispo  l = -clip(r, 1-e_lo, 1+e_hi) A  same, with the weight clipped on both sides
  ppo    l = -min(r A, clip(r, 1-e_lo, 1+e_hi) A)
  dppo   l = -m r A + beta (pi - mu)^2,  m = 0 where the token's probability already moved
         more than prob_delta in the direction of its advantage
  gspo   like ppo with the sequence ratio s_i = exp(mean_{t in i}(pi - mu)) in place of r
         (token form s_i,t = sg[s_i] exp(pi_t - sg[pi_t]))

Optionally the token losses are weighted by an importance correction between the trainer's
and the inference server's policy (w_t from sg[r_t]): TIS w = min(r, cap), MIS w = 1 if
1/cap <= r <= cap else 0.

Normalisation (the micro-batch's share of the global batch's loss, so that gradients
accumulated over micro-batches and summed over ranks give the batch loss):
  tokens    sum_t l_t / (loss tokens in the global batch)
  sequence  sum_i (sum_{t in i} l_t / n_i) / (sequences in the global batch)
  constant  sum_t l_t / (sequences in the global batch x constant)      (Dr. GRPO)

Metrics are sums over this micro-batch's loss tokens (and its token count), to be summed across
micro-batches and ranks and divided by the count: mismatch KL (r - log r - 1 with r = exp(sg[pi]
- mu)), fractions masked, clipped low and high, mean ratio and, when given, entropy.
docs/algorithms.md has the same formulas with their config names.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from primerl_algos.config import LossConfig
from primerl_algos.registry import Registry

MAX_LOG_RATIO = 20.0


@dataclass
class LossInputs:
    """The tokens of one micro-batch (flattened: N tokens in S sequences)."""

    logprobs: torch.Tensor
    """pi [N]: trainer logprobs at the sampling temperature (with gradient)."""
    inference_logprobs: torch.Tensor
    """mu [N]: inference logprobs."""
    advantages: torch.Tensor
    """A [N]."""
    loss_mask: torch.Tensor
    """bool [N]: tokens trained on."""
    seq_lens: torch.Tensor
    """[S]: sequence lengths (sum N), for sequence-level losses and normalisation."""
    entropy: torch.Tensor | None = None
    """[N] entropy of the trainer's distribution, for metrics."""


@dataclass
class LossScale:
    """Counts over the whole step's batch (all micro-batches of all ranks)."""

    tokens: int
    """Loss tokens in the global batch."""
    sequences: int
    """Sequences in the global batch."""


@dataclass
class TokenLoss:
    """What a loss function returns before correction, masking and normalisation."""

    loss: torch.Tensor
    """[N] per-token loss."""
    masked: torch.Tensor | None = None
    """bool [N]: tokens the loss itself drops (counted, and given no loss)."""
    clipped_low: torch.Tensor | None = None
    clipped_high: torch.Tensor | None = None
    per_sequence: bool = False
    """The loss is defined per sequence (normalise per sequence whatever the config says)."""


LossFn = Callable[[LossInputs, torch.Tensor, LossConfig], TokenLoss]
LOSSES: Registry[LossFn] = Registry("loss")


def _weighted(logprobs: torch.Tensor, weight: torch.Tensor, adv: torch.Tensor) -> torch.Tensor:
    """-w A in value, -w A grad(pi) in gradient (w a constant): -sg[w] A exp(pi - sg[pi]).

    The gradient path is pi itself, not the clamped log-ratio: where |pi - mu| > MAX_LOG_RATIO
    the clamp's derivative is 0, while the definition still gives -w A there. nan_to_num keeps a
    non-finite pi (a masked token's -inf) from making exp(nan) and a NaN gradient; its own
    derivative is 0 there."""
    return -weight.detach() * adv * torch.exp((logprobs - logprobs.detach()).nan_to_num(0.0))


@LOSSES.register("aipo")
def aipo(x: LossInputs, log_ratio: torch.Tensor, cfg: LossConfig) -> TokenLoss:
    ratio = log_ratio.detach().exp()
    weight = ratio.clamp(max=cfg.ratio_max)
    return TokenLoss(_weighted(x.logprobs, weight, x.advantages), clipped_high=ratio > cfg.ratio_max)


@LOSSES.register("cispo")
def cispo(x: LossInputs, log_ratio: torch.Tensor, cfg: LossConfig) -> TokenLoss:
    ratio = log_ratio.detach().exp()
    weight = ratio.clamp(1 - cfg.eps_low, 1 + cfg.eps_high)
    return TokenLoss(
        _weighted(x.logprobs, weight, x.advantages),
        clipped_low=ratio < 1 - cfg.eps_low,
        clipped_high=ratio > 1 + cfg.eps_high,
    )


def _ppo(ratio: torch.Tensor, adv: torch.Tensor, eps_low: float, eps_high: float) -> TokenLoss:
    clipped = ratio.clamp(1 - eps_low, 1 + eps_high)
    loss = -torch.minimum(ratio * adv, clipped * adv)
    r = ratio.detach()
    # The clip is active (no gradient) where min() picked the clipped term.
    return TokenLoss(loss, clipped_low=(r < 1 - eps_low) & (adv < 0), clipped_high=(r > 1 + eps_high) & (adv > 0))


@LOSSES.register("ppo")
def ppo(x: LossInputs, log_ratio: torch.Tensor, cfg: LossConfig) -> TokenLoss:
    return _ppo(log_ratio.exp(), x.advantages, cfg.eps_low, cfg.eps_high)


@LOSSES.register("dppo")
def dppo(x: LossInputs, log_ratio: torch.Tensor, cfg: LossConfig) -> TokenLoss:
    ratio = log_ratio.exp()
    moved = x.logprobs.detach().exp() - x.inference_logprobs.exp()
    adv = x.advantages
    masked = ((adv > 0) & (moved > cfg.prob_delta)) | ((adv < 0) & (moved < -cfg.prob_delta))
    loss = torch.where(masked, 0.0, -ratio * adv) + cfg.kl_coef * log_ratio**2
    return TokenLoss(loss, clipped_low=masked & (adv < 0), clipped_high=masked & (adv > 0))


@LOSSES.register("gspo")
def gspo(x: LossInputs, log_ratio: torch.Tensor, cfg: LossConfig) -> TokenLoss:
    seq_N = _sequence_index(x.seq_lens)
    mask = x.loss_mask.to(log_ratio.dtype)
    num_S = torch.zeros(len(x.seq_lens), dtype=log_ratio.dtype, device=log_ratio.device).index_add_(0, seq_N, mask)
    sum_S = torch.zeros_like(num_S).index_add_(0, seq_N, log_ratio.detach() * mask)
    seq_log_ratio_N = (sum_S / num_S.clamp(min=1))[seq_N]
    # Value of the sequence ratio, gradient of each token's own logprob.
    ratio = torch.exp(seq_log_ratio_N + x.logprobs - x.logprobs.detach())
    out = _ppo(ratio, x.advantages, cfg.eps_low, cfg.eps_high)
    out.per_sequence = True
    return out


def _sequence_index(seq_lens: torch.Tensor) -> torch.Tensor:
    return torch.repeat_interleave(torch.arange(len(seq_lens), device=seq_lens.device), seq_lens)


def importance_weights(ratio: torch.Tensor, kind: str, cap: float) -> torch.Tensor | None:
    """TIS/MIS weights from the (detached) trainer/inference ratio."""
    if kind == "none":
        return None
    if kind == "tis":
        return ratio.clamp(max=cap)
    if kind == "mis":
        return ((ratio <= cap) & (ratio >= 1 / cap)).to(ratio.dtype)
    raise ValueError(f"importance_correction {kind!r} is not one of none, tis, mis")


TOKEN_LOCAL = {"aipo", "cispo", "ppo", "dppo"}
"""Losses whose term of a token depends on that token's logprob only (with its own inputs and
the counts of its sequence): `token_loss_terms` serves them, and the trainer computes their
gradients chunk by chunk in the forward (trainer.loss_in_forward). GSPO's sequence ratio mixes
a sequence's tokens. A plugin loss that is token-local may add its name (the config's `type`)."""


def _token_terms(x: LossInputs, log_ratio: torch.Tensor, cfg: LossConfig):
    """(the loss's output, the detached ratio, importance weights, kept tokens, the token terms
    with correction and mask applied, before normalisation)."""
    out = LOSSES.get(cfg.type)(x, log_ratio, cfg)
    ratio = log_ratio.detach().exp()
    weights = importance_weights(ratio, cfg.importance_correction, cfg.importance_cap)
    token_loss = out.loss if weights is None else out.loss * weights
    mask = x.loss_mask.bool()
    keep = mask if out.masked is None else mask & ~out.masked
    token_loss = torch.where(keep, token_loss, 0.0)  # where, not *: a masked inf must not become NaN
    return out, ratio, weights, token_loss


def _log_ratio(logprobs: torch.Tensor, inference_logprobs: torch.Tensor) -> torch.Tensor:
    return (logprobs - inference_logprobs.to(logprobs.dtype)).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)


def _normalizers(x: LossInputs, normalization: str, cfg: LossConfig, scale: LossScale, dtype) -> torch.Tensor:
    """[N]: each token's factor in the micro-batch's share of the batch loss (the module's
    docstring: tokens, sequence, constant)."""
    mask = x.loss_mask.bool()
    ones = torch.ones(mask.shape, dtype=dtype, device=mask.device)
    if normalization == "tokens":
        return ones / max(scale.tokens, 1)
    if normalization == "sequence":
        seq_N = _sequence_index(x.seq_lens)
        num_S = torch.zeros(len(x.seq_lens), dtype=dtype, device=mask.device)
        num_S.index_add_(0, seq_N, mask.to(dtype))
        return ones / (num_S.clamp(min=1)[seq_N] * max(scale.sequences, 1))
    if normalization == "constant":
        return ones / (max(scale.sequences, 1) * cfg.constant)
    raise ValueError(f"normalization {normalization!r} is not one of tokens, sequence, constant")


def _check_inputs(x: LossInputs) -> None:
    n = x.logprobs.shape[0]
    for name in ("inference_logprobs", "advantages", "loss_mask"):
        if getattr(x, name).shape != (n,):
            raise ValueError(f"{name} has shape {tuple(getattr(x, name).shape)}, logprobs has ({n},)")
    if int(x.seq_lens.sum()) != n:
        raise ValueError(f"seq_lens sum to {int(x.seq_lens.sum())}, but there are {n} tokens")


def token_loss_terms(x: LossInputs, cfg: LossConfig, scale: LossScale):
    """terms(logprobs_C, s, e) -> [e - s]: the normalised loss terms of tokens s..e-1 from their
    logprobs, for a loss in TOKEN_LOCAL; summed over all tokens they make compute_loss's loss
    (to rounding). `x.logprobs` is not read (the terms get them chunk by chunk); the other
    inputs are the whole micro-batch's."""
    if cfg.type not in TOKEN_LOCAL:
        raise ValueError(f"loss {cfg.type!r} is not token-local (TOKEN_LOCAL: {sorted(TOKEN_LOCAL)})")
    _check_inputs(x)
    factor_N = _normalizers(x, cfg.normalization, cfg, scale, x.logprobs.dtype)

    def terms(logprobs_C: torch.Tensor, s: int, e: int) -> torch.Tensor:
        part = LossInputs(
            logprobs=logprobs_C,
            inference_logprobs=x.inference_logprobs[s:e],
            advantages=x.advantages[s:e],
            loss_mask=x.loss_mask[s:e],
            seq_lens=torch.tensor([e - s], device=logprobs_C.device),
        )
        out, _, _, token_loss = _token_terms(part, _log_ratio(logprobs_C, part.inference_logprobs), cfg)
        if out.per_sequence:
            raise ValueError(f"loss {cfg.type!r} is in TOKEN_LOCAL but returned a per-sequence loss")
        return token_loss * factor_N[s:e].to(token_loss.dtype)

    return terms


def compute_loss(x: LossInputs, cfg: LossConfig, scale: LossScale) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(scalar loss, metric sums as 0-dim tensors) of one micro-batch, with the configured loss.

    Metrics stay tensors (no host sync here); `mean_metrics` turns many of them into means."""
    _check_inputs(x)
    mask = x.loss_mask.bool()
    log_ratio = _log_ratio(x.logprobs, x.inference_logprobs)
    out, ratio, weights, token_loss = _token_terms(x, log_ratio, cfg)
    normalization = "sequence" if out.per_sequence else cfg.normalization
    loss = (token_loss * _normalizers(x, normalization, cfg, scale, token_loss.dtype)).sum()

    def count(flags: torch.Tensor | None) -> torch.Tensor:
        return torch.zeros((), device=mask.device) if flags is None else (flags & mask).sum().float()

    # r - log r - 1 as expm1(d) - d of d = log r, in float64: in float32 the terms cancel to
    # exactly 0 for |d| below ~1e-4, hiding a trainer/inference mismatch of that size.
    d = torch.where(mask, log_ratio.detach(), 0.0).double()  # masked tokens contribute 0
    dropped = out.masked if out.masked is not None else torch.zeros_like(mask)
    if weights is not None and cfg.importance_correction == "mis":
        dropped = dropped | (weights == 0)
    metrics = {
        "loss_tokens": mask.sum().float(),
        "mismatch_kl": (torch.expm1(d) - d).sum(),
        "ratio": torch.where(mask, ratio, 0.0).sum(),
        "masked": count(dropped),
        "clipped_low": count(out.clipped_low),
        "clipped_high": count(out.clipped_high),
    }
    if x.entropy is not None:
        metrics["entropy"] = torch.where(mask, x.entropy.detach(), 0.0).sum()
    return loss, metrics


def mean_metrics(sums: list[dict[str, torch.Tensor | float]]) -> dict[str, float]:
    """Metric sums of several micro-batches (or ranks) -> means per loss token."""
    total: dict[str, float] = {}
    for s in sums:
        for k, v in s.items():
            total[k] = total.get(k, 0.0) + float(v)
    tokens = max(total.pop("loss_tokens", 0.0), 1.0)
    return {k: v / tokens for k, v in total.items()}
