"""Every parallel layout trains the same model as one process (issue 39).

For world sizes 1, 2 and 4 and every (ep, cp) that divides them (dp = world / cp), ep equal to
the world included, one RL step and one SFT step through the trainer's session (FSDP2, EP, CP,
the RL and SFT trainers' own losses and packing; torchrun, gloo, CPU, fp32) give the same
loss, gradient norm and gradients as one process training a plain copy of the model on the
same global batch. Three MoE families with different routers: Qwen3-MoE (softmax top-k),
GLM-4.5 (grouped sigmoid with a correction bias, shared experts, a dense first layer) and
GPT-OSS (softmax over the top-k with router and expert biases, sinks, sliding windows); and
GLM-5 for its attention (MLA whose queries attend to DSA's selected keys only; under CP each rank
gathers the row's latent rows and keeps its queries).

Tolerances. The one-process reference is computed twice, in fp32 and in fp64 (the exact
gradients, for these purposes); fp32 alone is already ~1.6e-6 relative off them on these
models, so the layouts are held to the fp64 values: the loss within 1e-6 per unit of loss
(the RL loss is a sum of terms of both signs that nearly cancel: its relative error means
nothing), the gradient norm within 1e-6 relative, the whole gradient (every parameter, L2)
within 1e-6 relative beyond the fp32 process's own error, and each parameter's gradient within
1e-5 of its own norm beyond the fp32 process's own error for it (a parameter whose gradient is
halved, the bug found at ep = world, is off by 0.5).

The fast tests (2 ranks, Qwen3-MoE and GLM-5, ep = world = 2 and cp = 2) run in `-m "not slow"`, so an
EP or CP regression fails the development subset; the whole matrix is slow.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from primerl_models.tiny import build_tiny_model
from primerl_trainer.testing import free_port_block, run_on_ranks

ENTRY = Path(__file__).with_name("layout_matrix_entry.py")
FAMILIES = {
    "qwen3_moe": dict(hidden_size=32, init_std=0.2, seed=1),
    "glm4_moe": dict(
        hidden_size=32,
        num_layers=3,
        init_std=0.2,
        seed=2,
        router_bias_std=0.1,
        config_overrides={"n_group": 2, "topk_group": 1, "first_k_dense_replace": 1},
    ),
    "gpt_oss": dict(hidden_size=32, init_std=0.2, seed=3),
    # MLA with DSA's top-4 keys (rows are longer): CP gathers the latent rows, queries stay local
    "glm_moe_dsa": dict(hidden_size=32, num_layers=3, init_std=0.2, seed=4, router_bias_std=0.1),
}
FAST = ("ep2cp1", "ep1cp2")


def layouts(world: int) -> list[str]:
    return [f"ep{ep}cp{cp}" for ep in (1, 2, 4) for cp in (1, 2, 4) if world % ep == 0 and world % cp == 0]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("layout-models")
    return {family: build_tiny_model(root / family, family, **kw) for family, kw in FAMILIES.items()}


def run_matrix(models: dict, out: Path, world: int, spec: str, families) -> list[dict]:
    return run_on_ranks(ENTRY, out, num_ranks=world, args=(spec, *(f"{f}={models[f]}" for f in families)))


def _rel(got: dict, exact: dict, names=None) -> float:
    names = names or list(exact)
    err = torch.stack([(got[n].double() - exact[n]).norm() for n in names]).norm()
    return float(err / torch.stack([exact[n].norm() for n in names]).norm())


def check_step(ranks: list[dict], family: str, layout: str) -> None:
    """Each rank's RL and SFT step at `layout` against the one-process references."""
    for job in ("rl", "sft"):
        exact, fp32 = ranks[0][family]["ref64"][job], ranks[0][family]["ref"][job]
        for rank, row in enumerate(ranks):  # every rank reports the same global loss and norm
            got = row[family][layout][job]
            assert abs(got["loss"] - exact["loss"]) <= 1e-6 * max(1.0, abs(exact["loss"])), (job, rank, got["loss"])
            assert got["grad_norm"] == pytest.approx(exact["grad_norm"], rel=1e-6, abs=0), (job, rank)
        grads = ranks[0][family][layout][job]["grads"]
        assert grads.keys() == exact["grads"].keys()
        whole, floor = _rel(grads, exact["grads"]), _rel(fp32["grads"], exact["grads"])
        assert whole <= floor + 1e-6, (job, whole, floor)
        for name in exact["grads"]:
            one, own = _rel(grads, exact["grads"], [name]), _rel(fp32["grads"], exact["grads"], [name])
            assert one <= own + 1e-5, (job, name, one, own)
    world = len(ranks)
    ep, cp = (int(x) for x in layout.removeprefix("ep").split("cp"))
    assert ranks[0][family][layout]["rl"]["mesh"] == (world // cp, cp, ep)


@pytest.fixture(scope="module")
def fast(models, tmp_path_factory):
    return run_matrix(models, tmp_path_factory.mktemp("layouts-fast"), 2, ",".join(FAST), ["qwen3_moe", "glm_moe_dsa"])


def test_expert_parallel_over_every_rank_trains_as_one_process(fast):
    """ep = world = 2: each expert on one rank, its FSDP2 mesh one rank (where the expert
    gradients were halved: EP=8 on an 8-GPU node)."""
    check_step(fast, "qwen3_moe", "ep2cp1")


def test_context_parallel_over_two_ranks_trains_as_one_process(fast):
    check_step(fast, "qwen3_moe", "ep1cp2")


@pytest.mark.parametrize("layout", FAST)
def test_glm5_sparse_attention_over_two_ranks_trains_as_one_process(fast, layout):
    """GLM-5's own CP (each rank its queries, the row's latent rows gathered) and EP = world."""
    check_step(fast, "glm_moe_dsa", layout)


_matrix: dict[int, list[dict]] = {}


@pytest.fixture(scope="module")
def matrix(models, tmp_path_factory):
    def at(world: int) -> list[dict]:
        if world not in _matrix:
            _matrix[world] = run_matrix(models, tmp_path_factory.mktemp(f"layouts-{world}"), world, "all", FAMILIES)
        return _matrix[world]

    return at


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("world,layout", [(w, name) for w in (1, 2, 4) for name in layouts(w)])
def test_every_layout_trains_as_one_process(matrix, world, layout, family):
    check_step(matrix(world), family, layout)


def _sft(models, tmp_path: Path, name: str, ranks: int | None, *overrides: str) -> dict:
    """Step 0 of `primerl sft` (torchrun -m primerl.sft_entry on `ranks` ranks, or one process
    without torchrun) on GLM-4.5: its metrics.jsonl row."""
    data = tmp_path / "data.jsonl"
    if not data.exists():
        data.write_text(
            "\n".join(
                json.dumps({"prompt": "abc"[: 1 + i % 3] * (i + 1), "completion": "xyz" * (i % 4 + 1)})
                for i in range(12)
            )
        )
    run_dir = tmp_path / name
    cfg = tmp_path / f"{name}.toml"
    cfg.write_text(f"""seq_len = 64\nmax_steps = 1\nrun_dir = "{run_dir}"\n[model]\nname = "{models["glm4_moe"]}"
[wandb]\nmode = "disabled"\n[data]\npath = "{data}"\nbatch_size = 12\nshuffle = false
[trainer]\ndtype = "float32"\n[trainer.weights]\ndtype = "float32"\n[trainer.optimizer]\nmax_grad_norm = 1e6\n""")
    args = ["@", str(cfg), *overrides]
    launcher = (
        []
        if ranks is None
        else ["-m", "torch.distributed.run", f"--nproc-per-node={ranks}", f"--master-port={free_port_block(1)}"]
    )
    out = subprocess.run(
        [sys.executable, *launcher, "-m", "primerl.sft_entry", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    row = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    return {"loss": row["trainer/loss"], "grad_norm": row["trainer/grad_norm"]}


@pytest.mark.slow
def test_primerl_sft_under_torchrun_with_ep_equal_to_its_ranks_matches_one_process(models, tmp_path):
    """What a user types: `torchrun --nproc-per-node 2 -m primerl.sft_entry @ cfg trainer.parallel.ep=2`,
    without transport.trainer_ranks (torchrun says how many ranks there are): the first step's
    loss and gradient norm are one process's."""
    one = _sft(models, tmp_path, "one", None)
    two = _sft(models, tmp_path, "ep2", 2, "trainer.parallel.ep=2")
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-6)
    assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-6)
