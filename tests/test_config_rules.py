"""Rules every config section of every package keeps, checked over each command's root."""

import re

import msgspec
import pytest
from msgspec import inspect as mi
from primerl.configs import (
    EvalConfig,
    InferenceRunConfig,
    OrchRunConfig,
    RLConfig,
    SFTConfig,
    TrainerRunConfig,
)
from primerl_protocol.config import ConfigError, field_docs, load_config

ROOTS = [RLConfig, SFTConfig, EvalConfig, TrainerRunConfig, OrchRunConfig, InferenceRunConfig]


def _structs(root: type) -> set[type]:
    seen: set[type] = set()

    def walk(t: mi.Type) -> None:
        if isinstance(t, mi.StructType):
            if t.cls in seen:
                return
            seen.add(t.cls)
            for f in t.fields:
                walk(f.type)
        for attr in ("types", "item_type", "value_type"):
            sub = getattr(t, attr, None)
            for s in sub if isinstance(sub, tuple) else [sub] if sub is not None else []:
                walk(s)

    walk(mi.type_info(root))
    return seen


ALL = sorted({cls for root in ROOTS for cls in _structs(root)}, key=lambda c: c.__qualname__)


@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.__qualname__)
def test_every_field_has_a_docstring(cls):
    docs = field_docs(cls)
    undocumented = [f.name for f in msgspec.structs.fields(cls) if f.name not in docs]
    assert not undocumented, f"{cls.__qualname__}: fields without a docstring: {undocumented}"


@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.__qualname__)
def test_optional_fields_default_to_none(cls):
    """TOML has no null, so a dumped config drops None values; loading it back must give the
    same config, which holds only if every field that may be None defaults to None."""
    for f in mi.type_info(cls).fields:
        may_be_none = isinstance(f.type, mi.UnionType) and any(isinstance(t, mi.NoneType) for t in f.type.types)
        if may_be_none and not f.required:
            assert f.default is None, f"{cls.__qualname__}.{f.name} may be None but defaults to {f.default!r}"


# -- cross-checks between keys (the __post_init__ of the config Structs) --------------------
# Refusals already covered elsewhere: truncated sampling and temperature 0
# (test_orchestrator_units.py), the transport's loopback rule (test_transport_auth.py), too few
# inference GPUs (test_server_command.py), and one refused value each of micro_batch_tokens and
# weights.keep through `primerl rl` (apps/primerl/tests/test_cli.py). Here: the rest, each
# through the loader (the message must name the key it is about), and each at its boundary.


def load(root, *overrides):
    return load_config(root, ["model.name=m", *overrides])


@pytest.mark.parametrize("root", [RLConfig, OrchRunConfig])
@pytest.mark.parametrize("batch_size, group_size", [(12, 8), (4, 8), (9, 2), (255, 8)])
def test_batch_size_must_be_a_multiple_of_group_size(root, batch_size, group_size):
    overrides = [f"orchestrator.batch_size={batch_size}", f"orchestrator.group_size={group_size}"]
    with pytest.raises(ConfigError) as err:
        load(root, *overrides)
    message = str(err.value)
    assert message.startswith("config key `orchestrator`: ")
    assert f"batch_size ({batch_size}) must be a multiple of group_size ({group_size})" in message


@pytest.mark.parametrize("batch_size, group_size", [(16, 8), (8, 8), (14, 2), (256, 8)])
def test_batch_sizes_that_are_whole_groups_are_accepted(batch_size, group_size):
    cfg = load(RLConfig, f"orchestrator.batch_size={batch_size}", f"orchestrator.group_size={group_size}")
    assert (cfg.orchestrator.batch_size, cfg.orchestrator.group_size) == (batch_size, group_size)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["orchestrator.advantage.type=grpoo"],
            "config key `orchestrator.advantage`: unknown advantage 'grpoo': built-in ones are drgrpo, grpo, maxrl, rloo",
        ),
        (
            ["trainer.loss.type=gspoo"],
            "config key `trainer.loss`: unknown loss 'gspoo': built-in ones are aipo, cispo, dppo, gspo, ppo",
        ),
        (
            ["inference.num_replicas=2", "inference.tensor_parallel_size=2", "inference.gpus=[0, 1, 2]"],
            "config key `inference`: gpus lists 3 GPUs, but 2 replicas x 2 GPUs each need 4",
        ),
        (
            ["seq_len=1024", "trainer.micro_batch_tokens=1023"],
            "trainer.micro_batch_tokens = 1023 is below seq_len = 1024",
        ),
        (
            ["orchestrator.group_size=1", "orchestrator.batch_size=7"],
            'config key `orchestrator`: group_size = 1 with advantage.type = "grpo" can never train',
        ),
        (
            ["orchestrator.max_async_level=2", "trainer.weights.keep=2"],
            "trainer.weights.keep = 2 with orchestrator.max_async_level = 2: .* set trainer.weights.keep >= 3",
        ),
        (
            ["transport.trainer_ranks=4", "trainer.parallel.cp=3"],
            r"trainer.parallel.cp = 3 does not divide the trainer's 4 ranks \(transport.trainer_ranks\)",
        ),
        (
            ["transport.trainer_ranks=4", "trainer.parallel.ep=8"],
            r"trainer.parallel.ep = 8 does not divide the trainer's 4 ranks \(transport.trainer_ranks\)",
        ),
        (
            ["transport.trainer_ranks=8", "trainer.parallel.cp=2", "trainer.parallel.dp=2"],
            r"trainer.parallel.dp x trainer.parallel.cp = 2 x 2 = 4, but the trainer has 8 ranks \(transport.trainer_ranks\)",
        ),
    ],
    ids=["advantage", "loss", "gpus", "group-of-one", "rows-one-short", "keep-equal", "cp-ranks", "ep-ranks", "dp-cp"],
)
def test_cross_checks_refuse_naming_the_keys(overrides, message):
    with pytest.raises(ConfigError) as err:
        load(RLConfig, *overrides)
    assert re.search(message, str(err.value)), str(err.value)


@pytest.mark.parametrize(
    "overrides",
    [
        ["seq_len=1024", "trainer.micro_batch_tokens=1024"],  # rows exactly seq_len long
        ["orchestrator.max_async_level=2", "trainer.weights.keep=3"],  # one folder more than the window
        ["orchestrator.max_async_level=0", "trainer.weights.keep=1"],  # on-policy keeps one
        ["inference.num_replicas=2", "inference.tensor_parallel_size=2", "inference.gpus=[4, 5, 6, 7]"],
        ["orchestrator.advantage.type=my_pkg.adv:fn", "trainer.loss.type=my_pkg.loss:fn"],  # plugins pass
        ["transport.trainer_ranks=8", "trainer.parallel.dp=2", "trainer.parallel.cp=4", "trainer.parallel.ep=8"],
    ],
    ids=["rows-equal", "keep-one-more", "keep-on-policy", "gpus-exact", "plugins", "mesh-8"],
)
def test_cross_checks_accept_their_boundary(overrides):
    load(RLConfig, *overrides)


@pytest.fixture
def torchrun_ranks(monkeypatch):
    """This process as a rank of a torchrun job of `n` ranks (the variables torchrun sets)."""

    def set_world(n: int) -> None:
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
        monkeypatch.setenv("WORLD_SIZE", str(n))

    return set_world


@pytest.mark.parametrize("root", [SFTConfig, TrainerRunConfig])
def test_a_trainer_under_torchrun_takes_torchruns_ranks(torchrun_ranks, root):
    torchrun_ranks(8)
    extra = ["data.path=d.jsonl"] if root is SFTConfig else []
    cfg = load(root, *extra, "trainer.parallel.ep=8", "trainer.parallel.cp=2")  # no transport.trainer_ranks
    assert cfg.transport.trainer_ranks == 8
    assert load(root, *extra, "transport.trainer_ranks=8", "trainer.parallel.ep=8").transport.trainer_ranks == 8
    with pytest.raises(
        ConfigError, match=r"transport.trainer_ranks = 4, but torchrun started 8 ranks \(WORLD_SIZE = 8\)"
    ):
        load(root, *extra, "transport.trainer_ranks=4")
    with pytest.raises(
        ConfigError, match=r"trainer.parallel.ep = 16 does not divide the trainer's 8 ranks \(torchrun's WORLD_SIZE\)"
    ):
        load(root, *extra, "trainer.parallel.ep=16")


def test_without_torchrun_unset_trainer_ranks_are_one(monkeypatch):
    """A lone process's own WORLD_SIZE (primerl_trainer.distributed sets it to 1) is not torchrun's."""
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert load(SFTConfig, "data.path=d.jsonl").transport.ranks == 1
    with pytest.raises(ConfigError, match=r"ep = 2 does not divide the trainer's 1 ranks \(transport.trainer_ranks\)"):
        load(SFTConfig, "data.path=d.jsonl", "trainer.parallel.ep=2")


@pytest.mark.parametrize(
    "override, key",
    [
        ("trainer.lora.rank=0", "trainer.lora.rank"),
        ("trainer.lora.dropout=1.0", "trainer.lora.dropout"),
        ("trainer.lora.alpha=-2", "trainer.lora.alpha"),
    ],
)
def test_bad_lora_values_are_refused_naming_the_key(override, key):
    with pytest.raises(ConfigError) as err:
        load(RLConfig, override)
    assert key in str(err.value), str(err.value)
    assert load(RLConfig, "trainer.lora.rank=4").trainer.lora.rank == 4  # a good one builds the table


def test_training_the_vision_tower_with_lora_is_refused_naming_both_keys():
    with pytest.raises(ConfigError) as err:
        load(RLConfig, "trainer.freeze_vision=false", "trainer.lora.rank=4")
    assert "trainer.freeze_vision" in str(err.value) and "trainer.lora" in str(err.value), str(err.value)
    assert not load(RLConfig, "trainer.freeze_vision=false").trainer.freeze_vision


def test_published_adapters_turn_on_lora_serving():
    """trainer.lora publishing adapters (the default): the servers load them, with room for an
    adapter per policy rollouts may still run on; publishing merged weights leaves them alone."""
    cfg = load(RLConfig, "trainer.lora.rank=8", "orchestrator.max_async_level=2", "trainer.weights.keep=3")
    assert (cfg.inference.enable_lora, cfg.inference.max_loras, cfg.inference.max_lora_rank) == (True, 3, None)
    merged = load(RLConfig, "trainer.lora.rank=8", 'trainer.lora.publish="merged"').inference
    assert (merged.enable_lora, merged.max_loras) == (None, None)
    assert load(RLConfig).inference.enable_lora is None  # no LoRA: nothing turned on
    kept = load(RLConfig, "trainer.lora.rank=8", "inference.max_lora_rank=64", "inference.max_loras=4").inference
    assert (kept.max_lora_rank, kept.max_loras) == (64, 4)  # what the user set, where it fits


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["trainer.lora.rank=8", "inference.enable_lora=false"],
            r"inference.enable_lora = false, but trainer.lora.publish = \"adapter\" .* trainer.lora.publish = \"merged\"",
        ),
        (
            ["trainer.lora.rank=32", "inference.max_lora_rank=16"],
            r"inference.max_lora_rank = 16 is below trainer.lora.rank = 32, .* set it >= 32",
        ),
        (["trainer.lora.rank=1024"], r"trainer.lora.rank = 1024 is above the largest rank vLLM serves \(512\)"),
        (["inference.max_lora_rank=12"], r"inference.max_lora_rank"),  # vLLM takes 8 or 16, not 12
    ],
    ids=["lora-off", "rank-too-small", "rank-too-large", "rank-vllm-refuses"],
)
def test_serving_settings_that_contradict_published_adapters_are_refused_naming_the_keys(overrides, message):
    with pytest.raises(ConfigError) as err:
        load(RLConfig, *overrides)
    assert re.search(message, str(err.value)), str(err.value)
