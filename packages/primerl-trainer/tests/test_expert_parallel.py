"""Expert parallelism on 2 ranks (torchrun, gloo, CPU, fp32) against one rank holding every
expert: each rank's outputs and input gradients are the reference's, router and shared-expert
gradients too, and each rank's local expert gradients are the sum over ranks of the reference's
gradients of those experts (every rank's tokens reach them through the all-to-all)."""

from pathlib import Path

import pytest
import torch
from primerl_trainer.testing import run_on_ranks

pytestmark = pytest.mark.slow  # starts vLLM servers, torchrun trainers or installs: excluded by -m "not slow"

ENTRY = Path(__file__).with_name("expert_parallel_entry.py")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_on_ranks(ENTRY, tmp_path_factory.mktemp("ep"))


@pytest.mark.parametrize("family", ["qwen3_moe", "glm4_moe", "gpt_oss", "nemotron_h_latent"])
def test_expert_parallel_equals_one_rank_with_every_expert(ranks, family):
    rows = [r[family] for r in ranks]
    for rank, row in enumerate(rows):
        ref, ep = row["ref"], row["ep"]
        torch.testing.assert_close(ep["out"], ref["out"], atol=1e-5, rtol=0)
        torch.testing.assert_close(ep["x_grad"], ref["x_grad"], atol=1e-5, rtol=0)
        assert torch.equal(ep["counts"], ref["counts"])  # routing unchanged: all E experts counted
        for name, grad in ep["grads"].items():
            if ".experts." in f".{name}":
                # [2, ...] of the [4, ...] stacked weight: rank r keeps experts 2r, 2r + 1
                assert ep["shapes"][name][0] == 2 and ref["shapes"][name][0] == 4
                expected = sum(r["ref"]["grads"][name] for r in rows)[2 * rank : 2 * rank + 2]
                torch.testing.assert_close(grad, expected, atol=1e-5, rtol=0)
            else:  # router, shared expert, latent projections: this rank's own tokens only
                torch.testing.assert_close(grad, ref["grads"][name], atol=1e-5, rtol=0)
    # the ranks routed differently (5 and 9 tokens): uneven splits were exercised
    assert not torch.equal(rows[0]["ref"]["counts"], rows[1]["ref"]["counts"])
