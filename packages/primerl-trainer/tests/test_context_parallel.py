"""Ulysses context parallelism on 2 ranks (torchrun, gloo, CPU, fp32) against the whole rows: 2
packed rows of 12 tokens (3 and 2 documents, one crossing the split between the ranks in each),
GQA (4 query heads, 2 kv heads). Each rank's attention output is the whole row's for its tokens, and the gradients of
its q, k, v chunks are the whole row's (the loss over every rank's tokens reaches them)."""

from pathlib import Path

import pytest
import torch
from primerl_trainer.testing import run_on_ranks

pytestmark = pytest.mark.slow  # starts vLLM servers, torchrun trainers or installs: excluded by -m "not slow"

ENTRY = Path(__file__).with_name("context_parallel_entry.py")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_on_ranks(ENTRY, tmp_path_factory.mktemp("cp"))


@pytest.mark.parametrize("case", ["sdpa", "window+sinks"])
def test_ulysses_attention_equals_the_whole_row(ranks, case):
    """Plain, and with a 3-token sliding window and sinks (each rank holds half the heads, so
    half the sinks: their gradients summed over the ranks are the whole row's)."""
    for rank in range(2):
        row = ranks[rank][case]
        torch.testing.assert_close(row["out"], row["ref"], atol=1e-5, rtol=0)
        mine = slice(6 * rank, 6 * rank + 6)
        for got, full in zip(row["grads"], row["ref_grads"]):
            torch.testing.assert_close(got, full[:, mine], atol=1e-5, rtol=0)
        assert row["grads"][1].abs().sum() > 0
        if case == "window+sinks":
            torch.testing.assert_close(row["sinks_grad"], row["ref_sinks_grad"], atol=1e-5, rtol=0)
            assert row["ref_sinks_grad"].abs().min() > 0


@pytest.mark.parametrize("family", ["qwen3", "glm4_moe", "gpt_oss", "afmoe", "laguna", "qwen3_5_text", "nemotron_h"])
def test_a_whole_model_over_chunks_equals_the_whole_row(ranks, family):
    """The model fed each rank's chunk (ids, positions, targets) with the whole row's document
    boundaries and Ulysses as its attention: each rank's logprobs are the whole row's for its
    tokens, and the parameter gradients summed over the ranks are the whole row's. Qwen3.5's
    Gated DeltaNet and Nemotron-H's Mamba2 take the same all-to-alls around their conv and
    scan: the document that crosses the split carries its state and conv window across."""
    for rank in range(2):
        row = ranks[rank][family]
        torch.testing.assert_close(row["logprobs"], row["ref_logprobs"], atol=1e-5, rtol=0)
        for name, grad in row["grads"].items():
            torch.testing.assert_close(grad, row["ref_grads"][name], atol=1e-5, rtol=1e-5, msg=name)
