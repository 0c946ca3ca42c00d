"""The trainer's mesh on 4 ranks (torchrun, gloo, CPU, fp32) against one process training the
whole model: expert parallelism (EP=2), context parallelism (CP=2, and CP=4 with fewer kv heads
than ranks) and both (EP=2 x CP=2) give the same losses and the same updated weights as one
rank within 1e-5 over 3 optimizer steps on the same packed batch (documents crossing the CP
split; rows of odd length, padded), for a tiny Qwen3-MoE and a tiny GLM-4.5 (grouped sigmoid
routing, a correction bias, shared experts, a dense first layer). The weights gathered for
publishing are the checkpoint's bit for bit at every layout. Checkpoints resume across layouts
(EP=2 -> CP=2, CP=2 -> EP=2 x CP=2) with the uninterrupted run's losses."""

from pathlib import Path

import pytest
import torch
from primerl_models.tiny import build_tiny_model
from primerl_trainer.testing import run_on_ranks

pytestmark = pytest.mark.slow  # starts vLLM servers, torchrun trainers or installs: excluded by -m "not slow"

ENTRY = Path(__file__).with_name("parallel_layouts_entry.py")
LAYOUTS = ("ep2", "cp2", "ep2_cp2", "cp4")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    root = tmp_path_factory.mktemp("layouts")
    models = {
        "qwen3_moe": build_tiny_model(root / "qwen3_moe", "qwen3_moe", hidden_size=32, init_std=0.2, seed=1),
        "glm4_moe": build_tiny_model(
            root / "glm4_moe",
            "glm4_moe",
            hidden_size=32,
            num_layers=3,
            init_std=0.2,
            seed=2,
            router_bias_std=0.1,
            config_overrides={"n_group": 2, "topk_group": 1, "first_k_dense_replace": 1},
        ),
    }
    return run_on_ranks(ENTRY, root, num_ranks=4, args=tuple(f"{k}={v}" for k, v in models.items()))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("family", ["qwen3_moe", "glm4_moe"])
def test_a_layout_trains_as_one_rank(ranks, family, layout):
    ref = ranks[0][family]["ref"]
    for rank in range(4):  # every rank reports the same (global) losses and gradient norms
        got = ranks[rank][family][layout]
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), atol=1e-5, rtol=0)
        # AdamW's updates barely depend on a gradient's scale; its norm does (a rank's
        # expert gradients counted twice, a CP group's rows counted on every rank)
        torch.testing.assert_close(torch.tensor(got["grad_norms"]), torch.tensor(ref["grad_norms"]), atol=0, rtol=1e-5)
    assert ref["losses"][0] != ref["losses"][-1]  # the steps changed the model
    weights = ranks[0][family][layout]["weights"]
    assert weights.keys() == ref["weights"].keys()
    for name, full in ref["weights"].items():
        torch.testing.assert_close(weights[name], full, atol=1e-5, rtol=0, msg=name)
    dp, cp, ep = ranks[0][family][layout]["mesh"]
    assert dp * cp == 4 and (ep, cp) == {"ep2": (2, 1), "cp2": (1, 2), "ep2_cp2": (2, 2), "cp4": (1, 4)}[layout]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("family", ["qwen3_moe", "glm4_moe"])
def test_the_weights_gathered_for_publishing_do_not_depend_on_the_layout(ranks, family, layout):
    """Sharded at any layout and gathered back (FolderPublisher.gather, what each publish
    writes), the loaded weights are the checkpoint's, bit for bit."""
    got, checkpoint = ranks[0][family][layout]["loaded"], ranks[0][family]["checkpoint"]
    assert got.keys() == checkpoint.keys()
    for name, tensor in checkpoint.items():
        assert torch.equal(got[name], tensor), name


@pytest.mark.parametrize("run", ["resume ep2 -> cp2", "resume cp2 -> ep2_cp2"])
def test_a_checkpoint_resumes_at_another_layout(ranks, run):
    ref = ranks[0]["qwen3_moe"]["ref"]["losses"]
    for rank in range(4):
        torch.testing.assert_close(torch.tensor(ranks[rank][run]), torch.tensor(ref), atol=1e-5, rtol=0)
