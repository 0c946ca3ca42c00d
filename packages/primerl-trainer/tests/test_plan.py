"""The trainer's memory planner (primerl_trainer.plan): two tiny shapes whose every part is worked
out by hand here from the formulas of plan.py's docstring, the way each setting moves the
prediction, and the prediction against every peak measured on the H200 in bench/results
(the rows bench/plan_check.py uses)."""

import sys
from pathlib import Path

import pytest
from primerl_models.args import Attention, DenseMLP, Experts, Layer, Mamba2, ModelArgs, MoEMLP, Rope, Routing
from primerl_trainer.plan import GIB, TrainerLayout, trainer_memory

ROOT = Path(__file__).resolve().parents[3]


def tiny_dense() -> ModelArgs:
    """A Qwen3-like: q/k norms, tied embeddings, 2 layers."""
    attn = Attention(num_heads=4, num_kv_heads=2, head_dim=16, rope=Rope(rotary_dim=16), qk_norm="head")
    return ModelArgs(
        "qwen3", vocab_size=1000, hidden_size=64, layers=[Layer(attn, DenseMLP(128))] * 2, tie_embeddings=True
    )


def tiny_moe() -> ModelArgs:
    """A Qwen3-MoE-like without q/k norms: 8 experts of 32, top-2, untied, 2 layers."""
    attn = Attention(num_heads=4, num_kv_heads=2, head_dim=16, rope=Rope(rotary_dim=16))
    moe = MoEMLP(Routing(num_experts=8, top_k=2), Experts(32))
    return ModelArgs("qwen3_moe", vocab_size=1000, hidden_size=64, layers=[Layer(attn, moe)] * 2)


def test_tiny_dense_by_hand():
    args = tiny_dense()
    d, v, h, g, k, f, t, w = 64, 1000, 4, 2, 16, 128, 4096, 2
    # parameters: per layer q, k, v, o, q/k norms, gate/up/down, two norms; the tied embedding, final norm
    layer = d * h * k * 2 + d * g * k * 2 + 2 * k + 3 * d * f + 2 * d
    root = v * d + d
    n = 2 * layer + root
    assert args.num_params() == n
    mem = trainer_memory(args, TrainerLayout(world=w, row_tokens=t))
    assert mem.phase == "loss (first row)"
    p = mem.parts
    assert p["weights"] == 4 * n / w
    assert p["optimizer"] == 8 * n / w
    assert p["grads"] == 0  # the first row's backward has made none yet
    # FSDP2: the root's bf16 copy (not resharded after its forward), the last layer's all-gather kept (W > 1)
    assert p["gathered"] == 2 * root + 2 * layer
    # per token and layer: input 2 D, two normed inputs 2 D + 4; attention q, out 4 H K, k, v repeated to
    # H heads by varlen 4 H K, lse 4 H, pre-norm q, k 2 H K + 2 G K and their 1 / rms 4 H + 4 G; SwiGLU 6 F + 2 D
    per_layer = 2 * d + 2 * (2 * d + 4)
    per_layer += 4 * h * k + 4 * g * k + 4 * h + 4 * (h - g) * k
    per_layer += 2 * h * k + 2 * g * k + 4 * h + 4 * g
    per_layer += 6 * f + 2 * d
    assert p["activations"] == 2 * per_layer * t
    # the final norm's fp32 input copy 4 D and bf16 output 2 D, 16 B a token of log-sum-exp, targets and
    # temperatures; its backward: the hidden states' gradient 2 D, one chunk of logits 2 C V (C = 4096 = T),
    # the output weight's fp32 gradient 4 V D (one chunk: no second buffer)
    assert p["logits"] == (4 * d + 2 * d + 16) * t + 2 * d * t + 2 * 4096 * v + 4 * v * d
    assert mem.peak == sum(p.values())
    assert mem.host == 0


def test_tiny_moe_by_hand():
    args = tiny_moe()
    d, v, h, g, k, e, top, fe, t, w, ep = 64, 1000, 4, 2, 16, 8, 2, 32, 4096, 2, 2
    attn = d * h * k * 2 + d * g * k * 2
    experts = e * 3 * d * fe
    dense = attn + e * d + 2 * d  # attention, router, two norms
    root = 2 * v * d + d  # embedding, output head, final norm
    n = 2 * (dense + experts) + root
    assert args.num_params() == n
    mem = trainer_memory(args, TrainerLayout(world=w, ep=ep, row_tokens=t))
    assert mem.phase == "loss (first row)"
    p = mem.parts
    # FSDP2 shards the experts over ep, then over the world / ep ranks holding the same: N / W all the same
    assert p["weights"] == 4 * n / w
    assert p["optimizer"] == 8 * n / w
    assert p["grads"] == 0
    # the root's copy, and the last layer's all-gather kept: its dense part and its ep-th of the experts
    assert p["gathered"] == 2 * root + 2 * (dense + experts / ep)
    per_layer = 2 * d + 2 * (2 * d + 4)
    per_layer += 4 * h * k + 4 * g * k + 4 * h + 4 * (h - g) * k
    # MoE: rows and their transpose 4 k D, gate-up output and the activation's transpose 6 k Fe, the fp32
    # combined output 4 D, fp32 router logits 4 E, expert ids and orders 24 k, fp32 weights 4 k, 4
    per_layer += 4 * top * d + 6 * top * fe + 4 * d + 4 * e + 24 * top + 4 * top + 4
    cat = 4 * (e // ep) * d * fe  # the concatenated bf16 gate-up weight of this rank's experts
    assert p["activations"] == 2 * (per_layer * t + cat)
    assert p["logits"] == (4 * d + 2 * d + 16) * t + 2 * d * t + 2 * 4096 * v + 4 * v * d


def tiny_mamba2() -> ModelArgs:
    """A Nemotron-H-like layer: Mamba2 alone (4 heads of 8, state 16, 2 groups, conv of 4), no MLP."""
    mamba = Mamba2(num_heads=4, head_dim=8, state_size=16, n_groups=2, conv_kernel=4)
    return ModelArgs("nemotron_h", vocab_size=1000, hidden_size=64, layers=[Layer(mamba, None)])


@pytest.mark.parametrize("bench", [True, False], ids=["bench-autocast", "trainer-fsdp"])
def test_mamba2_compiled_by_hand(bench):
    """Mamba2 compiled on a GPU (plan.py's docstring): the graphs' saved tensors around the eager
    _ChunkStates (the Triton scan), the backward matmuls' operands as bf16 casts under the bench's
    autocast, as fp32 copies in the trainer (no autocast)."""
    args = tiny_mamba2()
    d, t, h, p, n, g, k, c = 64, 4096, 4, 8, 16, 2, 4, 64  # c: the scan's chunk (SCAN_CHUNK)
    inner = h * p
    conv = inner + 2 * g * n  # x, B, C
    if bench:
        layout = TrainerLayout(row_tokens=t, fsdp=False, states="bf16+sgd", packed=False)
    else:
        layout = TrainerLayout(row_tokens=t)
    mem = trainer_memory(args, layout)
    assert mem.phase == "loss (first row)"
    # the layer's input (bf16 stream) 2 D, the mixer's normed input 2 D and its 1 / rms 4
    per = 2 * d + 2 * d + 4
    per += 2 * (inner + conv + h)  # in_proj's bf16 output (z, x B C, dt)
    per += 2 * conv  # the conv's bf16 input
    per += (k - 1) * (4 * conv + 1)  # each tap's shifted fp32 copy and its document mask
    per += 4 * conv  # silu(conv) in fp32
    per += 4 * h * n + 4 * h * n  # c and b in the chunk layout, fp32, every head
    per += 4 * h + 4 * h  # G and the decays to each chunk's end
    per += 4 * h * c + 4 * h * c  # c b^T and the segment sums, fp32
    per += 4 * h * n * n / c  # _ChunkStates' m: a [N, N] matrix a head and chunk
    per += 4 * h * n * p / c  # _ChunkStates' states: [N, P] a head and chunk
    per += 4 * h / c  # exp of each chunk's last G
    per += 4 * h * p  # the scan's output y, fp32
    per += 2 * inner  # out_proj's bf16 input
    per += 4 * g  # the gated norm's 1 / rms per group
    per += 8  # the chunk slot of each token (int64)
    if bench:  # the backward matmuls' operands as bf16 casts
        per += 2 * h * c  # attn
        per += 2 * h * n + 2 * h * n  # b weighted to its chunk's end; one of c, b
        per += 2 * h * p + 2 * h * p  # v, in each of two graphs
        per += 2 * h * n * p / c  # the states
    else:  # as fp32 copies
        per += 4 * h * c  # attn
        per += 4 * h * n * 4  # b weighted, c, b^T, c exp(G)
        per += 4 * h * p * 2  # v, twice
    assert mem.parts["activations"] == pytest.approx(per * t)


def layer_moments(mem) -> float:
    return max(total for name, total in mem.phases.items() if name.startswith("layer"))


def test_expert_parallelism_divides_the_experts_gathered():
    args = tiny_moe()
    one = trainer_memory(args, TrainerLayout(world=8, ep=1, row_tokens=4096))
    eight = trainer_memory(args, TrainerLayout(world=8, ep=8, row_tokens=4096))
    # the states stay 16 N / W (FSDP2 shards the experts over every rank either way) ...
    assert one.parts["weights"] == eight.parts["weights"]
    assert one.parts["optimizer"] == eight.parts["optimizer"]
    # ... what ep divides is each layer's experts gathered, their gradients, their concatenated gate-up
    experts = 8 * 3 * 64 * 32
    assert one.parts["gathered"] - eight.parts["gathered"] == pytest.approx(2 * experts * (1 - 1 / 8))
    assert layer_moments(eight) < layer_moments(one)
    assert eight.peak < one.peak


def test_context_parallelism_divides_activations():
    args = tiny_dense()
    one = trainer_memory(args, TrainerLayout(world=2, row_tokens=8192))
    two = trainer_memory(args, TrainerLayout(world=2, cp=2, row_tokens=8192))
    assert one.phase == two.phase == "loss (first row)"
    assert two.parts["activations"] == one.parts["activations"] / 2
    assert two.peak < one.peak


def test_activation_checkpointing_lowers_activations():
    args = tiny_dense()
    plain = trainer_memory(args, TrainerLayout(row_tokens=8192))
    ac = trainer_memory(args, TrainerLayout(row_tokens=8192, activation_checkpointing=True))
    assert ac.parts["activations"] < plain.parts["activations"]
    assert ac.peak < plain.peak
    # each layer keeps its bf16 input; the loss sees those only
    assert ac.phases["loss (first row)"] - plain.phases["loss (first row)"] == pytest.approx(
        2 * 2 * 64 * 8192 - plain.parts["activations"]
    )


def test_cpu_offload_moves_the_states_to_the_host():
    args = tiny_moe()
    on = trainer_memory(args, TrainerLayout(world=2, row_tokens=4096, cpu_offload=True))
    off = trainer_memory(args, TrainerLayout(world=2, row_tokens=4096))
    n = args.num_params()
    assert on.parts["weights"] == on.parts["optimizer"] == on.parts["grads"] == 0
    assert on.host == 16 * n / 2
    assert off.host == 0
    assert on.peak < off.peak


def test_later_rows_hold_every_gradient():
    args = tiny_dense()
    one = trainer_memory(args, TrainerLayout(row_tokens=4096, rows=1))
    two = trainer_memory(args, TrainerLayout(row_tokens=4096, rows=2))
    assert two.phases["loss (later row)"] - two.phases["loss (first row)"] == 4 * args.num_params()
    assert two.peak > one.peak


def test_layout_checks():
    with pytest.raises(ValueError, match="divide"):
        TrainerLayout(world=4, ep=3)
    with pytest.raises(ValueError, match="world must be 1"):
        TrainerLayout(world=2, fsdp=False)


def measured():
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        from plan_check import measured_rows  # pyright: ignore[reportMissingImports]
    finally:
        sys.path.pop(0)
    return measured_rows(ROOT / "bench" / "results")[0]


@pytest.mark.skipif(not (ROOT / "bench" / "results").is_dir(), reason="needs the repository's bench/results")
def test_predictions_within_ten_percent_of_every_measured_peak():
    rows = measured()
    assert len(rows) >= 20
    off = [
        (m.file, m.settings, m.peak_gib, round(m.predicted(), 2))
        for m in rows
        if not 0.9 <= m.predicted() / m.peak_gib <= 1.1
    ]
    assert not off, off
    assert all(m.predicted() * GIB > 0 for m in rows)
