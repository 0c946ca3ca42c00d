"""Publishing LoRA merged into full bf16 weights (trainer.lora.publish = "merged",
trainer.weights.dtype = "bfloat16"): each adapted weight is rounded to bf16 once, from
W + (alpha / r) B A summed in fp32 (experts: W + (alpha / r) A B), never from a W or a delta
already rounded to bf16. The expected values are computed here from the fp32 tensors."""

from pathlib import Path

import torch
from primerl_models import load_model, read_config
from primerl_models.blocks.moe import GroupedExperts
from primerl_models.hf import to_hf
from primerl_models.tiny import build_tiny_model
from primerl_trainer.config import LoRAConfig
from primerl_trainer.distributed import Dist
from primerl_trainer.lora import LoRALinear, apply_lora
from primerl_trainer.lora import adapted_weights as adapted_names
from primerl_trainer.publish import FolderPublisher
from safetensors.torch import load_file

BF16 = torch.bfloat16
RANK, ALPHA = 4, 8.0
SCALE = ALPHA / RANK


def weights_and_deltas(model) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{weight name: (W, delta)} of every adapted weight, in fp32 as the model holds them:
    delta = (alpha / r) B A (experts: (alpha / r) A B)."""
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, LoRALinear):
            out[f"{name}.weight"] = (m.weight, m.delta())
        elif isinstance(m, GroupedExperts) and m.lora_scale:
            for w, p in m.named_parameters(recurse=False):
                if w.startswith("w_"):
                    out[f"{name}.{w}"] = (p, SCALE * torch.bmm(getattr(m, f"lora_A_{w}"), getattr(m, f"lora_B_{w}")))
    return {name: (w.detach().clone(), delta.detach()) for name, (w, delta) in out.items()}


def draw(model, g: torch.Generator) -> None:
    """Trained-looking weights and adapters: every adapted W and its A and B ~ N(0, 0.6^2), so
    each delta is about as large as its W, and W is not a bf16 value."""
    adapted = adapted_names(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in adapted or "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.6)


def test_merged_lora_published_in_bf16_rounds_each_weight_once(tmp_path):
    folder = build_tiny_model(tmp_path / "src", "qwen3_moe", hidden_size=32, num_layers=1)
    model = load_model(folder)
    apply_lora(model, LoRAConfig(rank=RANK, alpha=ALPHA, targets=["q_proj", "o_proj"], experts=True, publish="merged"))
    draw(model, torch.Generator().manual_seed(0))
    adapted = weights_and_deltas(model)
    assert any(".experts." in n for n in adapted) and any(n.endswith("q_proj.weight") for n in adapted)
    # One element by hand: W = 1 + 2^-9 (bf16 rounds it to 1), delta = 2^-8 (a bf16 value).
    # Once: 1 + 3 * 2^-9 is nearer 1 + 2^-7 than 1. Twice: 1 + 2^-8 is the tie, which goes to even, 1.
    q = next(m for n, m in model.named_modules() if n.endswith("q_proj") and isinstance(m, LoRALinear))
    with torch.no_grad():
        q.weight[0, 0] = 1 + 2**-9
        q.lora_A.weight[:, 0] = torch.tensor([1.0] + [0.0] * (RANK - 1))
        q.lora_B.weight[0, :] = torch.tensor([2**-8 / SCALE] + [0.0] * (RANK - 1))
    assert float(q.delta().detach()[0, 0]) == 2**-8

    expected, twice = {}, {}
    for name, (w, delta) in weights_and_deltas(model).items():
        expected[name] = (w + delta).to(BF16)
        forms = [
            (w.to(BF16) + delta.to(BF16)).to(BF16),  # both rounded, summed in bf16
            (w.to(BF16).float() + delta).to(BF16),  # W rounded first
            (w + delta.to(BF16).float()).to(BF16),
        ]  # delta rounded first
        # each twice-rounded form differs from the once-rounded one somewhere: the test can tell them apart
        assert all(not torch.equal(f, expected[name]) for f in forms), name
        twice[name] = forms[0]
    q_name = next(n for n in adapted if n.endswith("q_proj.weight"))
    assert float(expected[q_name][0, 0]) == 1 + 2**-7 and float(twice[q_name][0, 0]) == 1.0

    d = Dist(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    ready = FolderPublisher(tmp_path / "run", folder, read_config(folder), 1, BF16, d).publish(model, 0)
    published = {k: v for f in Path(ready.location).glob("*.safetensors") for k, v in load_file(f).items()}
    want = to_hf(expected, model.args)
    assert want and not any("lora" in k for k in published)
    for name, tensor in want.items():
        assert published[name].dtype == BF16, name
        assert torch.equal(published[name], tensor), (
            f"{name}: {int((published[name] != tensor).sum())} of {tensor.numel()} elements are not bf16(W + delta)"
        )
