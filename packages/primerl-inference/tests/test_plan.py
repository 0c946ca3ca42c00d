"""The server side of the memory plan (primerl_inference.plan) against arithmetic done by hand
here: weights per GPU under TP, DP and expert parallelism and FP8; KV bytes of a sequence for
grouped-query attention (kv heads split, replicated past their count), MLA with DSA's index
keys, sliding windows and recurrent states; vLLM's rule for the cache's share, at its edge."""

import pytest
from primerl_inference.plan import (
    CUDA_GRAPHS_GIB,
    GIB,
    NON_TORCH_GIB,
    KVLayer,
    ServedShape,
    ServerLayout,
    activation_bytes,
    kv_bytes_per_seq,
    server_memory,
    weight_bytes,
)

# a Qwen3-1.7B-like dense model: 28 layers of 8 kv heads of 128
GQA = ServedShape(
    dense_params=1_400_000_000,
    expert_params=0,
    vocab_params=151936 * 2048,
    hidden_size=2048,
    vocab_size=151936,
    widest_per_token=3 * 6144,
    kv_layers=[KVLayer(per_token=2 * 2 * 8 * 128, split=8)] * 28,
)
# a GLM-5-like MLA layer with DSA (latent 512 + RoPE 64; index keys of 128 in fp8 + a scale per 128)
MLA = ServedShape(
    dense_params=10**9,
    expert_params=64 * 10**9,
    vocab_params=2 * 154880 * 6144,
    hidden_size=6144,
    vocab_size=154880,
    widest_per_token=8 * 3 * 2048,
    kv_layers=[KVLayer(per_token=2 * (512 + 64), fixed_fp8=128 + 4)] * 3,
)


def test_weights_per_gpu_by_hand():
    # bf16, tp 2: every parameter 2 bytes, halved
    assert weight_bytes(GQA, ServerLayout(tp=2)) == (1_400_000_000 + 151936 * 2048) * 2 / 2
    # fp8: linear layers 1 byte + a float32 scale per 128 x 128 block; embedding and head stay bf16
    fp8 = weight_bytes(GQA, ServerLayout(fp8_weights=True))
    assert fp8 == pytest.approx(1_400_000_000 * (1 + 4 / 16384) + 2 * 151936 * 2048)
    # experts: over tp alone (each DP rank a replica), or over tp x dp with expert parallelism
    dense = (10**9 + 2 * 154880 * 6144) * 2 / 2
    assert weight_bytes(MLA, ServerLayout(tp=2, dp=4)) == dense + 64 * 10**9 * 2 / 2
    assert weight_bytes(MLA, ServerLayout(tp=2, dp=4, expert_parallel=True)) == dense + 64 * 10**9 * 2 / 8


def test_kv_bytes_of_a_sequence_by_hand():
    seq = 16384
    per_layer = seq * 2 * 2 * 8 * 128  # K and V, 8 heads of 128, bf16
    assert kv_bytes_per_seq(GQA, ServerLayout(), seq) == 28 * per_layer
    assert kv_bytes_per_seq(GQA, ServerLayout(tp=4), seq) == 28 * per_layer / 4  # 2 kv heads a GPU
    assert kv_bytes_per_seq(GQA, ServerLayout(tp=8), seq) == 28 * per_layer / 8
    assert kv_bytes_per_seq(GQA, ServerLayout(tp=16), seq) == 28 * per_layer / 8  # replicated past 8
    assert kv_bytes_per_seq(GQA, ServerLayout(fp8_kv=True), seq) == 28 * per_layer / 2
    # MLA: every TP rank holds the latent and the index keys; fp8 halves the latent only
    assert kv_bytes_per_seq(MLA, ServerLayout(tp=8), seq) == 3 * seq * (1152 + 132)
    assert kv_bytes_per_seq(MLA, ServerLayout(fp8_kv=True), seq) == 3 * seq * (576 + 132)


def test_windows_and_recurrent_states_do_not_grow_with_the_sequence():
    shape = ServedShape(
        dense_params=1,
        expert_params=0,
        vocab_params=1,
        hidden_size=8,
        vocab_size=8,
        widest_per_token=8,
        kv_layers=[KVLayer(per_token=100, split=4, window=128), KVLayer(state=10_000, split=4)],
    )
    assert kv_bytes_per_seq(shape, ServerLayout(), 64) == 64 * 100 + 10_000
    assert kv_bytes_per_seq(shape, ServerLayout(), 128) == 128 * 100 + 10_000
    assert kv_bytes_per_seq(shape, ServerLayout(), 4096) == 128 * 100 + 10_000
    assert kv_bytes_per_seq(shape, ServerLayout(tp=2), 4096) == (128 * 100 + 10_000) / 2


def test_the_cache_gets_the_share_left_and_one_sequence_is_the_edge():
    lay = ServerLayout(tp=1, gpu_memory_utilization=0.9)
    m = server_memory(GQA, lay, gpu_gib=80, seq_len=16384, in_flight=256)
    used = weight_bytes(GQA, lay) + activation_bytes(GQA, lay) + NON_TORCH_GIB * GIB
    assert m.kv_bytes == 0.9 * 80 * GIB - used
    assert m.seqs_fit == int(m.kv_bytes // kv_bytes_per_seq(GQA, lay, 16384))
    assert m.in_flight == 256 and m.short_of_concurrency() == (m.seqs_fit < 256)
    # the smallest GPU on which the cache holds one sequence starts; a byte less does not
    lay = ServerLayout(tp=1, gpu_memory_utilization=0.8)  # 20% left outside: room for the CUDA graphs
    used = weight_bytes(GQA, lay) + activation_bytes(GQA, lay) + NON_TORCH_GIB * GIB
    one = kv_bytes_per_seq(GQA, lay, 16384)
    edge_gib = (used + one) / 0.8 / GIB
    assert server_memory(GQA, lay, gpu_gib=edge_gib * (1 + 1e-9), seq_len=16384, in_flight=1).problems() == []
    short = server_memory(GQA, lay, gpu_gib=edge_gib * (1 - 1e-6), seq_len=16384, in_flight=1).problems()
    assert len(short) == 1 and "less than one sequence of 16,384 tokens" in short[0]


def test_too_little_left_outside_vllms_share_for_its_cuda_graphs_is_said():
    lay = ServerLayout(gpu_memory_utilization=1.0 - (CUDA_GRAPHS_GIB / 80) / 2)
    problems = server_memory(GQA, lay, gpu_gib=80, seq_len=4096, in_flight=1).problems()
    assert len(problems) == 1 and "CUDA graphs" in problems[0]
    assert server_memory(GQA, ServerLayout(), gpu_gib=80, seq_len=4096, in_flight=1).problems() == []


def test_data_parallel_ranks_share_the_sequences_in_flight():
    m = server_memory(GQA, ServerLayout(dp=4), gpu_gib=80, seq_len=4096, in_flight=10)
    assert m.in_flight == 3  # ceil(10 / 4)
