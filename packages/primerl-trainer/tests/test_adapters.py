"""LoRA adapters published as adapters (CPU, fp32): the folder holds the trainer's adapter
tensors under the served model's Hugging Face names in PEFT's layout, and merging it onto the
HF base weights by PEFT's rules gives the trainer's merged model, also where the checkpoint
fuses several of our layers into one HF tensor (GLM-4's gate_up_proj, Qwen3.5's q_proj with
its gate) or splits one of ours into several. Served by vLLM: apps/primerl/tests/test_rl_run.py."""

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from primerl_models import Transformer, to_hf
from primerl_models.families import FAMILIES, TinyShape
from primerl_models.families.checkpoint import Checkpoint
from primerl_protocol.weights import ADAPTER, ADAPTER_CONFIG, ADAPTER_WEIGHTS, MARKER, format_of, verify
from primerl_trainer.adapters import AdapterLayout, AdapterPublisher, merge_adapter, published_rank
from primerl_trainer.config import LoRAConfig
from primerl_trainer.distributed import Dist
from primerl_trainer.lora import adapter_state_dict, apply_lora, merged_state_dict
from primerl_trainer.testing import draw_adapters
from safetensors.torch import load_file, save_file

SHAPE = TinyShape(
    vocab_size=48, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, moe_intermediate_size=16
)
EVERY = ["*_proj", "in_proj*", "out_proj"]


def tiny_config(family: str) -> dict:
    return FAMILIES[family].tiny_config(SHAPE)


def adapted(family: str, cfg: LoRAConfig) -> Transformer:
    """A tiny model with adapters that look trained (B away from its zero start)."""
    model = Transformer(FAMILIES[family].args_from_hf(tiny_config(family)))
    model.init_weights(std=0.2, generator=torch.Generator().manual_seed(0))
    apply_lora(model, cfg)
    draw_adapters(model, std=0.1, seed=1)
    return model


def base_state(model) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.state_dict().items() if ".lora_" not in k}


def single() -> Dist:
    return Dist(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


def test_the_published_folder_holds_the_trainers_adapters_under_hf_names(tmp_path):
    """Qwen3: our names are HF's without `model.`; the folder is PEFT's layout, checksummed as
    an adapter, and each tensor is the trainer's own, bit for bit."""
    cfg = LoRAConfig(rank=4, alpha=8.0)
    model = adapted("qwen3", cfg)
    publisher = AdapterPublisher(
        tmp_path / "run", model, cfg, "org/base-model", keep=2, dtype=torch.float32, d=single()
    )
    ready = publisher.publish(model, 0)
    folder = Path(ready.location)
    assert ready.format == ADAPTER and sorted(p.name for p in folder.iterdir()) == [
        ADAPTER_CONFIG,
        ADAPTER_WEIGHTS,
        MARKER,
    ]
    meta = verify(folder, ready.checksum)
    assert format_of(meta) == ADAPTER and sorted(meta["files"]) == [ADAPTER_CONFIG, ADAPTER_WEIGHTS]
    published = load_file(folder / ADAPTER_WEIGHTS)
    ours = adapter_state_dict(model)
    assert sorted(published) == sorted(f"base_model.model.model.{k}" for k in ours)
    for name, tensor in ours.items():
        assert torch.equal(published[f"base_model.model.model.{name}"], tensor), name
    config = json.loads((folder / ADAPTER_CONFIG).read_text())
    assert {k: config[k] for k in ("peft_type", "r", "lora_alpha", "bias", "base_model_name_or_path")} == {
        "peft_type": "LORA",
        "r": 4,
        "lora_alpha": 8.0,
        "bias": "none",
        "base_model_name_or_path": "org/base-model",
    }
    assert config["target_modules"] == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    assert config["rank_pattern"] == {} and config["alpha_pattern"] == {}
    # the same folder contract as full weights: a later step, and the oldest pruned beyond `keep`
    for step in (1, 2):
        publisher.publish(model, step)
    assert sorted(p.name for p in (tmp_path / "run" / "weights").iterdir()) == ["step_1", "step_2"]
    again = publisher.announce_again(3)
    assert again.format == ADAPTER and again.location == publisher.last.location


@dataclass(frozen=True)
class SplitCheckpoint(Checkpoint):
    """A checkpoint that stores each of our up_proj as two HF tensors, the first half of its rows
    and the second half reversed: one of our layers is several HF ones."""

    def to_hf(self, ours):
        out = super().to_hf(ours)
        for name in [n for n in out if n.endswith(".mlp.up_proj.weight")]:
            up = out.pop(name)
            half = up.shape[0] // 2
            out[name.replace("up_proj", "up_proj_a")] = up[:half].contiguous()
            out[name.replace("up_proj", "up_proj_b")] = up[half:].flip(0).contiguous()
        return out


@pytest.mark.parametrize(
    "family, fused",
    [
        ("qwen3", {}),
        ("glm4", {"gate_up_proj": 2}),  # HF's gate_up_proj is our gate_proj and up_proj
        ("qwen3_5_text", {"q_proj": 2}),  # HF's q_proj holds our q_proj and the output gate, per head
        ("qwen3_5", {"q_proj": 2}),  # the same in the released VLM layout (model.language_model.)
        ("qwen3_moe", {}),
        ("nemotron_h", {}),  # backbone. names, Mamba2 in_proj and out_proj
        ("split", {}),  # one of ours is two HF tensors: B split by rows, A shared
    ],
    ids=["qwen3", "glm4", "qwen3_5_text", "qwen3_5", "qwen3_moe", "nemotron_h", "split"],
)
def test_merging_the_published_adapter_onto_hf_weights_gives_the_trainers_merged_model(family, fused, tmp_path):
    cfg = LoRAConfig(rank=4, alpha=8.0, targets=EVERY)
    model = adapted("qwen3" if family == "split" else family, cfg)
    convert = SplitCheckpoint().to_hf if family == "split" else (lambda state: to_hf(state, model.args))
    layout = AdapterLayout.of(model, convert)
    (tmp_path / ADAPTER_CONFIG).write_text(json.dumps(layout.config(cfg, "base")))
    save_file(layout.tensors(adapter_state_dict(model), torch.float32), tmp_path / ADAPTER_WEIGHTS)
    got = merge_adapter(convert(base_state(model)), tmp_path)
    want = convert(merged_state_dict(model))
    assert sorted(got) == sorted(want)
    changed = 0
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, atol=1e-6, rtol=0, msg=name)
        changed += not torch.equal(tensor, convert(base_state(model))[name])
    assert changed >= 2 * SHAPE.num_layers  # the adapters changed something in every layer
    config = json.loads((tmp_path / ADAPTER_CONFIG).read_text())
    patterns = {k.rsplit("\\.", 1)[-1]: v for k, v in config["rank_pattern"].items()}
    assert patterns == {k: cfg.rank * n for k, n in fused.items()}
    assert layout.rank == cfg.rank * max(fused.values(), default=1)
    if family == "split":
        assert {"up_proj_a", "up_proj_b"} <= set(config["target_modules"])


def test_a_layout_other_than_rows_is_refused_naming_the_tensor():
    """A checkpoint that stores a weight transposed cannot hold PEFT's A and B: refused at setup."""

    @dataclass(frozen=True)
    class Transposed(Checkpoint):
        def to_hf(self, ours):
            out = super().to_hf(ours)
            out["model.layers.0.self_attn.o_proj.weight"] = out["model.layers.0.self_attn.o_proj.weight"].T
            return out

    cfg = LoRAConfig(rank=4, alpha=8.0, targets=["o_proj"])
    with pytest.raises(
        ValueError,
        match=r"stores model.layers.0.self_attn.o_proj.weight \(from our "
        r"layers.0.self_attn.o_proj\) in another layout .*publish = \"merged\"",
    ):
        AdapterLayout.of(adapted("qwen3", cfg), Transposed().to_hf)
    # the same layer left out of the targets: nothing to refuse
    AdapterLayout.of(adapted("qwen3", LoRAConfig(rank=4, alpha=8.0, targets=["q_proj"])), Transposed().to_hf)


def test_the_published_rank_is_known_from_the_config_alone():
    """What `primerl rl` sets vLLM's --max-lora-rank from, on a model of the meta device."""
    assert published_rank(tiny_config("qwen3"), LoRAConfig(rank=8)) == 8
    assert published_rank(tiny_config("glm4"), LoRAConfig(rank=8)) == 16  # gate_up_proj: 2 x 8
    assert published_rank(tiny_config("glm4"), LoRAConfig(rank=8, targets=["gate_proj", "down_proj"])) == 8
    with pytest.raises(ValueError, match="matches no linear layer"):
        published_rank(tiny_config("qwen3"), LoRAConfig(targets=["nothing"]))


def test_export_merges_a_published_adapter_into_a_full_checkpoint_and_refuses_what_does_not_fit(tmp_path):
    """`primerl merge-lora`'s function: a published adapter step merged into its base folder is
    a HF checkpoint equal to the trainer's merged model (fp32, 1e-6), with the base's config and
    tokenizer files. Refused, naming why, with nothing written: an existing output folder, an
    adapter whose checksum does not match (a modified file), one of another model (by the name
    it records, and by its layers when the names are not checked)."""
    from primerl_models import load_model, save_hf
    from primerl_trainer.adapters import export_merged

    cfg = LoRAConfig(rank=4, alpha=8.0)
    model = adapted("qwen3", cfg)
    base = tmp_path / "base"
    save_hf(base_state(model), tiny_config("qwen3"), base)
    (base / "tokenizer_config.json").write_text('{"model_max_length": 64}')
    ready = AdapterPublisher(tmp_path / "run", model, cfg, str(base), keep=2, dtype=torch.float32, d=single()).publish(
        model, 3
    )
    out = export_merged(base, ready.location, tmp_path / "merged")
    got = load_model(out).state_dict()
    for name, tensor in merged_state_dict(model).items():
        torch.testing.assert_close(got[name], tensor, atol=1e-6, rtol=0, msg=name)
    assert (out / "tokenizer_config.json").read_text() == '{"model_max_length": 64}'
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "float32"

    with pytest.raises(ValueError, match="exists"):
        export_merged(base, ready.location, out)
    other = adapted("glm4", cfg)  # gate_up_proj: no such module in a Qwen3
    other_ready = AdapterPublisher(
        tmp_path / "other", other, cfg, "glm", keep=2, dtype=torch.float32, d=single()
    ).publish(other, 0)
    with pytest.raises(ValueError, match=f"was trained on 'glm' .*, not on '{base}'"):
        export_merged(base, other_ready.location, tmp_path / "wrong")
    with pytest.raises(ValueError, match="gate_up_proj has no weight in the base model"):  # whatever the names say
        export_merged(base, other_ready.location, tmp_path / "wrong", check_base_model=False)
    weights = Path(ready.location) / ADAPTER_WEIGHTS
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="checksum"):
        export_merged(base, ready.location, tmp_path / "corrupt")
    assert not (tmp_path / "wrong").exists() and not (tmp_path / "corrupt").exists()


def test_adapters_on_experts_are_refused_as_an_adapter_naming_the_way_out():
    """vLLM's LoRA does not take MoE experts' adapters: asking to publish them as an adapter is
    refused at setup (what `primerl rl` checks before anything starts), naming the setting."""
    with pytest.raises(ValueError, match='publish = "merged"'):
        published_rank(tiny_config("qwen3_moe"), LoRAConfig(rank=4, experts=True))
