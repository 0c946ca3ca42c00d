"""Each loss against numbers worked by hand from its formula (docs/algorithms.md)."""

import math

import pytest
import torch
from primerl_algos.config import BUILTIN_LOSSES, LossConfig
from primerl_algos.losses import (
    LOSSES,
    TOKEN_LOCAL,
    LossInputs,
    LossScale,
    compute_loss,
    mean_metrics,
    token_loss_terms,
)

LN2 = math.log(2)


def inputs(pi, mu, adv, mask=None, seq_lens=None, entropy=None):
    pi = torch.tensor(pi, dtype=torch.float64, requires_grad=True)
    n = len(adv)
    return LossInputs(
        logprobs=pi,
        inference_logprobs=torch.tensor(mu, dtype=torch.float64),
        advantages=torch.tensor(adv, dtype=torch.float64),
        loss_mask=torch.tensor(mask if mask is not None else [True] * n),
        seq_lens=torch.tensor(seq_lens if seq_lens is not None else [n]),
        entropy=None if entropy is None else torch.tensor(entropy, dtype=torch.float64),
    )


def run(x, scale=None, **cfg):
    n = len(x.advantages)
    loss, metrics = compute_loss(x, LossConfig(**cfg), scale or LossScale(tokens=n, sequences=len(x.seq_lens)))
    loss.backward()
    return loss.item(), x.logprobs.grad.tolist(), metrics


def test_aipo_truncates_the_importance_weight():
    # token 1: r = 0.5/0.25 = 2 truncated to delta = 1.5, A = 2  -> l = -3, dl/dpi = -3
    # token 2: r = 0.2/0.4 = 0.5, A = -1                         -> l = 0.5, dl/dpi = 0.5
    x = inputs([math.log(0.5), math.log(0.2)], [math.log(0.25), math.log(0.4)], [2.0, -1.0])
    loss, grad, m = run(x, type="aipo", ratio_max=1.5)
    assert loss == pytest.approx((-3 + 0.5) / 2)
    assert grad == pytest.approx([-3 / 2, 0.5 / 2])
    assert m["clipped_high"].item() == 1
    # mismatch KL = mean of r - ln r - 1 = ((2 - ln2 - 1) + (0.5 + ln2 - 1)) / 2 = 0.25
    assert mean_metrics([m])["mismatch_kl"] == pytest.approx(0.25)


def test_ppo_clip_by_hand():
    r = [1.5, 0.5, 1.1, 0.5]
    adv = [1.0, -1.0, 1.0, 1.0]
    x = inputs([math.log(v) for v in r], [0.0] * 4, adv)
    loss, grad, m = run(x, type="ppo", eps_low=0.2, eps_high=0.28)
    # 1: min(1.5, 1.28) = 1.28 clipped (no grad); 2: min(-0.5, -0.8) = -0.8 clipped (no grad)
    # 3: min(1.1, 1.1) = 1.1 (grad -r A = -1.1); 4: min(0.5, 0.8) = 0.5 (grad -0.5)
    assert loss == pytest.approx((-1.28 + 0.8 - 1.1 - 0.5) / 4)
    assert grad == pytest.approx([0.0, 0.0, -1.1 / 4, -0.5 / 4])
    assert (m["clipped_high"].item(), m["clipped_low"].item()) == (1, 1)


def test_cispo_keeps_gradient_through_clipped_tokens():
    x = inputs([math.log(1.5), math.log(0.5)], [0.0, 0.0], [1.0, 1.0])
    loss, grad, m = run(x, type="cispo", eps_low=0.2, eps_high=0.28)
    # weights clip(1.5) = 1.28, clip(0.5) = 0.8; l = -w A; dl/dpi = -w A (stop-gradient weight)
    assert loss == pytest.approx((-1.28 - 0.8) / 2)
    assert grad == pytest.approx([-1.28 / 2, -0.8 / 2])
    assert (m["clipped_high"].item(), m["clipped_low"].item()) == (1, 1)


def test_dppo_masks_tokens_that_moved_too_far_and_penalises_mismatch():
    # token 1: p 0.25 -> 0.5 (moved +0.25 > 0.2) with A > 0: masked; only the penalty remains
    # token 2: p 0.25 -> 0.3 (moved 0.05), A = 1: l = -r A = -1.2 + beta ln(1.2)^2
    x = inputs([math.log(0.5), math.log(0.3)], [math.log(0.25)] * 2, [1.0, 1.0])
    beta = 0.1
    loss, grad, m = run(x, type="dppo", prob_delta=0.2, kl_coef=beta)
    l1 = beta * LN2**2
    l2 = -1.2 + beta * math.log(1.2) ** 2
    assert loss == pytest.approx((l1 + l2) / 2)
    assert grad == pytest.approx([2 * beta * LN2 / 2, (-1.2 + 2 * beta * math.log(1.2)) / 2])
    assert m["clipped_high"].item() == 1


def test_gspo_uses_the_sequence_ratio():
    # sequence 1: log-ratios 0.1, 0.3 -> s = e^0.2 = 1.2214 (inside [0.8, 1.28]), A = 1
    # sequence 2: log-ratio 0.5 -> s = 1.6487, clipped at 1.28, A = 1 (no gradient)
    x = inputs([0.1, 0.3, 0.5], [0.0] * 3, [1.0] * 3, seq_lens=[2, 1])
    loss, grad, m = run(x, type="gspo", eps_low=0.2, eps_high=0.28)
    s = math.exp(0.2)
    assert loss == pytest.approx((-s - 1.28) / 2)  # per-sequence means, over 2 sequences
    assert grad == pytest.approx([-s / 2 / 2, -s / 2 / 2, 0.0])
    assert m["clipped_high"].item() == 1


def test_tis_and_mis_corrections():
    # r = 2 and 0.25 with cap 1.5; AIPO with a large delta: l = -r A
    x = inputs([LN2, math.log(0.25)], [0.0, 0.0], [1.0, 1.0])
    loss, grad, _ = run(x, type="aipo", ratio_max=100.0, importance_correction="tis", importance_cap=1.5)
    # TIS: weights min(r, 1.5) = 1.5 and 0.25
    assert loss == pytest.approx((-2 * 1.5 - 0.25 * 0.25) / 2)
    assert grad == pytest.approx([-2 * 1.5 / 2, -0.25 * 0.25 / 2])
    x = inputs([LN2, math.log(0.25)], [0.0, 0.0], [1.0, 1.0])
    loss, grad, m = run(x, type="aipo", ratio_max=100.0, importance_correction="mis", importance_cap=1.5)
    # MIS: both ratios outside [1/1.5, 1.5]: both tokens dropped
    assert loss == 0.0 and grad == [0.0, 0.0] and m["masked"].item() == 2


def test_normalisations():
    # token losses (AIPO, r = 1): -A = [-1, -2, -3] in sequences [2, 1]; token 2 not trained
    adv = [1.0, 2.0, 3.0]
    mask = [True, False, True]

    def loss_of(**cfg):
        x = inputs([0.0] * 3, [0.0] * 3, adv, mask=mask, seq_lens=[2, 1])
        return run(x, scale=LossScale(tokens=10, sequences=4), type="aipo", **cfg)[0]

    assert loss_of(normalization="tokens") == pytest.approx((-1 - 3) / 10)
    # per sequence: seq 1 has 1 loss token (-1), seq 2 has 1 (-3); over 4 global sequences
    assert loss_of(normalization="sequence") == pytest.approx((-1 / 1 - 3 / 1) / 4)
    assert loss_of(normalization="constant", constant=8.0) == pytest.approx((-1 - 3) / (4 * 8))


@pytest.mark.parametrize("kind", BUILTIN_LOSSES)
def test_all_masked_gives_zero_loss_and_no_nan_even_with_huge_ratios(kind):
    x = inputs([0.0, 5.0], [-1000.0, -1000.0], [1.0, -1.0], mask=[False, False])
    loss, grad, m = run(x, type=kind)
    assert loss == 0.0 and grad == [0.0, 0.0]
    assert all(math.isfinite(v.item()) for v in m.values())


@pytest.mark.parametrize("kind", BUILTIN_LOSSES)
def test_huge_ratios_stay_finite(kind):
    x = inputs([0.0, -0.1], [-1000.0, 0.0], [1.0, -1.0])
    loss, grad, _ = run(x, type=kind)
    assert math.isfinite(loss) and all(math.isfinite(g) for g in grad)


@pytest.mark.parametrize("kind", BUILTIN_LOSSES)
def test_gradcheck(kind):
    g = torch.Generator().manual_seed(0)
    n = 7
    mu = torch.randn(n, generator=g, dtype=torch.float64) * 0.3 - 1
    # One advantage per sequence, as rollouts have (GSPO's token form assumes it).
    adv = torch.tensor([0.7] * 3 + [-1.3] * 4, dtype=torch.float64)
    pi0 = mu + torch.randn(n, generator=g, dtype=torch.float64) * 0.1

    def f(pi):
        x = LossInputs(pi, mu, adv, torch.ones(n, dtype=torch.bool), torch.tensor([3, 4]))
        return compute_loss(x, LossConfig(type=kind, kl_coef=0.1), LossScale(tokens=n, sequences=2))[0]

    assert torch.autograd.gradcheck(f, (pi0.clone().requires_grad_(),))


def test_entropy_metric_is_the_mean_over_loss_tokens():
    x = inputs([0.0] * 3, [0.0] * 3, [1.0] * 3, mask=[True, True, False], entropy=[1.0, 3.0, 100.0])
    _, _, m = run(x, type="aipo")
    assert mean_metrics([m])["entropy"] == pytest.approx(2.0)


def test_plugin_loss_by_import_path(tmp_path, monkeypatch):
    (tmp_path / "my_losses.py").write_text(
        "from primerl_algos.losses import TokenLoss\n"
        "def reinforce(x, log_ratio, cfg):\n"
        "    return TokenLoss(-x.advantages * x.logprobs)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    x = inputs([-1.0, -2.0], [0.0, 0.0], [1.0, 3.0])
    loss, grad, _ = run(x, type="my_losses:reinforce")
    assert loss == pytest.approx((1.0 + 6.0) / 2)
    assert grad == pytest.approx([-0.5, -1.5])


def test_unknown_loss_names_are_refused():
    with pytest.raises(ValueError, match="unknown loss 'grpoo': built-in ones are aipo, cispo, dppo, gspo, ppo"):
        LossConfig(type="grpoo")
    with pytest.raises(ValueError, match="cannot import 'no_such_module'"):
        LOSSES.get("no_such_module:fn")


def test_config_names_match_the_registry():
    assert sorted(BUILTIN_LOSSES) == LOSSES.names


def test_mismatched_shapes_are_refused():
    x = inputs([0.0, 0.0], [0.0], [1.0, 1.0])
    with pytest.raises(ValueError, match=r"inference_logprobs has shape \(1,\)"):
        compute_loss(x, LossConfig(), LossScale(2, 1))


def test_a_tiny_float32_mismatch_is_measured_not_rounded_to_zero():
    # trainer and inference differ by d = 2e-5 nats on each token: KL = e^d - d - 1 ~ d^2/2 = 2e-10,
    # which r - log r - 1 in float32 rounds to 0 (1 + 2e-5 has ~1e-7 resolution)
    mu = [-1.0, -2.0, -0.5]
    x = inputs([m + 2e-5 for m in mu], mu, [1.0, -1.0, 0.5])
    x.logprobs = x.logprobs.detach().float().requires_grad_()
    x.inference_logprobs = x.inference_logprobs.float()
    _, _, m = run(x)
    assert mean_metrics([m])["mismatch_kl"] == pytest.approx(2e-10, rel=0.1)


def test_gspo_sequence_ratio_is_over_the_trained_tokens_of_a_partly_masked_packed_row():
    # One packed row of three multi-turn sequences; False: a token not trained on (a tool's
    # output, a user turn). The masked tokens' log-ratios are large, so counting them anywhere
    # (the mean's sum, or its count) would move or clip the sequence ratio.
    #   seq 1, A = +1: log-ratios [0.1, (2.0), 0.2, 0.0] -> s = exp(0.3 / 3) = e^0.1 = 1.105, inside [0.8, 1.28]
    #   seq 2, A = -1: log-ratios [(-3.0), -0.1, -0.3]    -> s = exp(-0.4 / 2) = e^-0.2 = 0.819, inside
    #   seq 3, A = +1: nothing trained                     -> no loss
    # (over all tokens: seq 1 s = e^0.575 clipped at 1.28, seq 2 s = e^-1.133 clipped at 0.8)
    log_ratio = [0.1, 2.0, 0.2, 0.0, -3.0, -0.1, -0.3, 0.5, 0.5]
    mu = [-0.5, -1.0, -2.0, -0.7, -0.1, -1.5, -0.9, -0.3, -1.2]
    mask = [True, False, True, True, False, True, True, False, False]
    adv = [1.0] * 4 + [-1.0] * 3 + [1.0] * 2
    x = inputs([m + d for m, d in zip(mu, log_ratio)], mu, adv, mask=mask, seq_lens=[4, 3, 2])
    loss, grad, m = run(x, scale=LossScale(tokens=5, sequences=3), type="gspo", eps_low=0.2, eps_high=0.28)
    s1, s2 = math.exp(0.1), math.exp(-0.2)
    # per sequence: the mean over its trained tokens of -min(s A, clip(s) A) = -s A; over 3 sequences
    assert loss == pytest.approx((-s1 + s2) / 3)
    # d/dpi_t of a trained token: -s A / (trained tokens of its sequence) / sequences
    assert grad == pytest.approx([-s1 / 3 / 3, 0.0, -s1 / 3 / 3, -s1 / 3 / 3, 0.0, s2 / 2 / 3, s2 / 2 / 3, 0.0, 0.0])
    assert (m["clipped_low"].item(), m["clipped_high"].item(), m["loss_tokens"].item()) == (0, 0, 5)


@pytest.mark.parametrize("normalization", ["tokens", "sequence"])
@pytest.mark.parametrize("kind", BUILTIN_LOSSES)
def test_a_masked_out_tokens_logprobs_change_nothing(kind, normalization):
    # Two sequences of a packed row, each partly trained; token 1 and token 5 are not trained.
    mu = [-1.0, -0.4, -2.0, -0.6, -1.3, -0.2, -0.8]
    pi = [-0.9, -0.5, -1.8, -0.7, -1.2, -0.3, -0.75]
    mask = [True, False, True, True, True, False, True]
    adv = [0.7] * 3 + [-1.3] * 4  # one advantage per sequence, as rollouts have

    def result(pi, mu):
        x = inputs(pi, mu, adv, mask=mask, seq_lens=[3, 4])
        loss, grad, m = run(
            x, scale=LossScale(tokens=5, sequences=2), type=kind, kl_coef=0.1, normalization=normalization
        )
        return loss, grad, {k: v.item() for k, v in m.items()}

    loss, grad, metrics = result(pi, mu)
    assert grad[1] == 0.0 and grad[5] == 0.0
    for t, (dpi, dmu) in [(1, (4.0, 0.0)), (5, (0.0, -3.0)), (5, (-2.5, 1.0))]:
        pi2, mu2 = list(pi), list(mu)
        pi2[t] += dpi
        mu2[t] += dmu
        loss2, grad2, metrics2 = result(pi2, mu2)
        assert loss2 == pytest.approx(loss, rel=1e-12, abs=1e-15)
        assert grad2 == pytest.approx(grad, rel=1e-12, abs=1e-15)
        assert metrics2 == pytest.approx(metrics, rel=1e-12, abs=1e-15)
    # while a trained token's does (the comparison above is not blind)
    assert result([pi[0] + 0.3, *pi[1:]], mu)[0] != pytest.approx(loss, rel=1e-6)


# Weights by the definition, r = exp(clamp(pi - mu, -20, 20)), with ratio_max 2 and eps 0.2 / 0.28:
#   aipo  w = min(r, 2):             d = +-19.9 -> 2, e^-19.9;  d = +-20.1 -> 2, e^-20 (value clamped)
#   cispo w = clip(r, 0.8, 1.28):    d > 0 -> 1.28;  d < 0 -> 0.8
EDGE_WEIGHTS = [
    ("aipo", 19.9, 2.0),
    ("aipo", 20.1, 2.0),
    ("aipo", -19.9, math.exp(-19.9)),
    ("aipo", -20.1, math.exp(-20.0)),
    ("cispo", 19.9, 1.28),
    ("cispo", 20.1, 1.28),
    ("cispo", -19.9, 0.8),
    ("cispo", -20.1, 0.8),
]


@pytest.mark.parametrize(("kind", "d", "w"), EDGE_WEIGHTS)
def test_aipo_and_cispo_give_minus_w_a_on_tokens_beyond_the_log_ratio_clamp(kind, d, w):
    # Two tokens with pi - mu = d and A = 1.5, -0.5: l = -w A, dl/dpi = -w A, each over 2 tokens.
    # The clamp at |d| = 20 bounds r's value only; the gradient must not vanish past it.
    pi = [-1.0, -0.3] if d > 0 else [-1.0 + d, -0.3 + d]
    mu = [p - d for p in pi]
    x = inputs(pi, mu, [1.5, -0.5])
    loss, grad, _ = run(x, type=kind, ratio_max=2.0, eps_low=0.2, eps_high=0.28)
    assert loss == pytest.approx((-w * 1.5 + w * 0.5) / 2, rel=1e-9)
    assert grad == pytest.approx([-w * 1.5 / 2, w * 0.5 / 2], rel=1e-9, abs=0.0)


@pytest.mark.parametrize("kind", ["aipo", "cispo"])
def test_a_masked_minus_inf_logprob_gives_no_nan_gradient(kind):
    # token 2 is not trained and its trainer logprob is -inf; token 1 (r = 1, A = 1): dl/dpi = -1/1
    x = inputs([-0.5, -math.inf], [-0.5, -1.0], [1.0, 1.0], mask=[True, False])
    loss, grad, _ = run(x, scale=LossScale(tokens=1, sequences=1), type=kind)
    assert loss == pytest.approx(-1.0)
    assert grad == [pytest.approx(-1.0), 0.0]


@pytest.mark.parametrize("correction", ["none", "tis", "mis"])
@pytest.mark.parametrize("normalization", ["tokens", "sequence", "constant"])
@pytest.mark.parametrize("kind", sorted(TOKEN_LOCAL))
def test_token_terms_chunk_by_chunk_sum_to_the_loss_with_its_gradient(kind, normalization, correction):
    """token_loss_terms (the loss in the trainer's forward, chunk by chunk): over chunks that cut
    sequences, its terms sum to compute_loss's loss, and their gradients with respect to each
    chunk's logprobs are compute_loss's gradient."""
    g = torch.Generator().manual_seed(3)
    n, seq_lens = 23, [5, 9, 1, 8]
    pi = -torch.rand(n, generator=g, dtype=torch.float64) * 3
    mu = pi + torch.randn(n, generator=g, dtype=torch.float64) * 0.7
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    mask = torch.rand(n, generator=g) < 0.75
    x = inputs(pi.tolist(), mu.tolist(), adv.tolist(), mask.tolist(), seq_lens)
    cfg = LossConfig(type=kind, normalization=normalization, importance_correction=correction, importance_cap=1.5)
    scale = LossScale(tokens=31, sequences=6)
    loss, _ = compute_loss(x, cfg, scale)
    loss.backward()
    terms = token_loss_terms(x, cfg, scale)
    total, grads = 0.0, []
    for s, e in [(0, 4), (4, 11), (11, 12), (12, 23)]:  # chunks that cut sequences 1 and 2
        leaf = pi[s:e].clone().requires_grad_()
        t = terms(leaf, s, e)
        assert t.shape == (e - s,)
        total = total + t.sum()
        grads.append(torch.autograd.grad(t.sum(), leaf)[0])
    torch.testing.assert_close(total.detach(), loss.detach(), atol=1e-14, rtol=1e-12)
    torch.testing.assert_close(torch.cat(grads), x.logprobs.grad, atol=1e-14, rtol=1e-12)


def test_token_terms_refuse_a_sequence_level_loss():
    x = inputs([-1.0, -2.0], [-1.0, -2.0], [1.0, 1.0])
    with pytest.raises(ValueError, match="loss 'gspo' is not token-local"):
        token_loss_terms(x, LossConfig(type="gspo"), LossScale(tokens=2, sequences=1))
