"""trainer.precision = "fp8" (primerl_trainer.precision): what the config refuses and where,
which layers become torchao's Float8Linear, that checkpoints and published weights do not see
the difference, and that an FP8 step's loss stays within e4m3's precision of the reference's
(on the CPU, whose `torch._scaled_mm` takes e4m3 operands too, and on a GPU with FP8 matmuls).

The bound: e4m3 keeps 3 mantissa bits, so every FP8 operand is off by at most its unit roundoff
u = 2^-4, relatively (bf16's is 2^-9). A matmul of two such operands is off by about u in
relative terms (about 3.8% measured, against 0.3% for bf16); the mean token loss, an average of
smooth functions of such outputs, must then move by less than u relatively, step after step.
That FP8 ran at all is seen in the logprobs: further from the fp32 reference than bf16's."""

import copy
import logging

import pytest
import torch
import torch.distributed as dist
from primerl_models import Transformer, load_model, read_config
from primerl_models.families import FAMILIES, TinyShape
from primerl_models.tiny import build_tiny_model
from primerl_protocol.config import ConfigError, load_config
from primerl_trainer.checkpoint import SetupError
from primerl_trainer.config import SFTDataConfig, SFTRunConfig, TrainerConfig, TrainerRunConfig
from primerl_trainer.distributed import Dist
from primerl_trainer.precision import check_fp8_device, convert_to_fp8
from primerl_trainer.publish import FolderPublisher
from primerl_trainer.testing import free_port_block, one_rank_group
from safetensors.torch import load_file

U = 2.0**-4
"""e4m3's unit roundoff (3 mantissa bits)."""


def tiny(family: str, seed: int = 0, std: float = 0.1, **shape) -> Transformer:
    f = FAMILIES[family]
    sizes = dict(vocab_size=512, hidden_size=128, intermediate_size=256, head_dim=32) | shape
    torch.manual_seed(seed)
    model = Transformer(f.args_from_hf(f.tiny_config(TinyShape(**sizes))))
    model.init_weights(std=std)
    return model


def float8_names(model: torch.nn.Module) -> set[str]:
    return {name for name, m in model.named_modules() if type(m).__name__ == "Float8Linear"}


# --- the config and the device ---------------------------------------------------------------


def test_an_unknown_precision_is_refused_at_load_naming_the_key():
    with pytest.raises(ConfigError, match=r"`trainer.precision`: invalid enum value 'fp4'"):
        load_config(TrainerRunConfig, ["model.name=m", "trainer.precision=fp4"])
    assert load_config(TrainerRunConfig, ["model.name=m"]).trainer.precision == "bf16"


@pytest.mark.parametrize(
    "overrides, says",
    [
        (["trainer.lora.rank=8"], r'trainer.precision = "fp8" with trainer.lora: FP8 training of adapted layers'),
        (["trainer.dtype=float32"], r'trainer.precision = "fp8" with trainer.dtype = "float32"'),
    ],
)
def test_fp8_with_lora_or_fp32_compute_is_refused_at_load(overrides, says):
    with pytest.raises(ConfigError, match=says):
        load_config(TrainerRunConfig, ["model.name=m", "trainer.precision=fp8", *overrides])


def test_fp8_on_a_cpu_trainer_is_refused_at_setup_naming_the_key(tmp_path, monkeypatch):
    """Before the model is loaded (the model named here does not exist)."""
    from primerl_trainer.engine import Session

    for key, value in dict(
        RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port_block(1))
    ).items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = SFTRunConfig(
        model=load_config(TrainerRunConfig, ["model.name=no/such-model"]).model,
        data=SFTDataConfig(path=str(tmp_path / "none.jsonl")),
        trainer=TrainerConfig(precision="fp8"),
        run_dir=str(tmp_path / "run"),
    )
    try:
        with pytest.raises(SetupError, match=r'trainer.precision = "fp8" needs a GPU with FP8 matmuls .* runs on cpu'):
            Session(cfg, job="sft")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_fp8_on_a_gpu_without_fp8_matmuls_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ValueError, match=r'trainer.precision = "fp8" .* NVIDIA A100-SXM4-80GB has 8.0'):
        check_fp8_device(torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    check_fp8_device(torch.device("cuda", 0))  # Hopper: accepted


# --- which layers ----------------------------------------------------------------------------


def test_only_the_decoder_layers_projections_become_fp8():
    model = tiny("qwen3_5_moe_text", num_layers=2)  # Gated DeltaNet, gated attention, experts, shared expert
    before = {name: type(m) for name, m in model.named_modules()}
    converted = convert_to_fp8(model)
    assert set(converted) == float8_names(model)
    assert set(converted) == {
        *(f"layers.0.linear_attn.{p}" for p in ("in_proj_qkv", "in_proj_z", "out_proj")),
        *(f"layers.1.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj")),
        *(f"layers.{i}.mlp.shared_experts.{p}" for i in (0, 1) for p in ("gate_proj", "up_proj", "down_proj")),
    }
    # everything else is the module it was: lm_head, embeddings, norms, routers, experts, the
    # linear attention's small gates and the shared expert's one-output gate
    unchanged = {name for name, m in model.named_modules() if type(m) is before[name]}
    assert unchanged == set(before) - set(converted)
    for name in (
        "lm_head",
        "layers.0.linear_attn.in_proj_a",
        "layers.0.linear_attn.in_proj_b",
        "layers.0.mlp.shared_expert_gate",
    ):
        assert type(model.get_submodule(name)) is torch.nn.Linear, name
    assert type(model.get_submodule("layers.0.mlp.router")).__name__ == "Router"


def test_layers_whose_sizes_are_not_multiples_of_16_stay_bf16():
    model = tiny("qwen3", intermediate_size=200, num_layers=1)  # 200 = 16 * 12.5
    converted = convert_to_fp8(model)
    assert converted == [f"layers.0.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj")]


def test_mla_keeps_the_indexer_and_kv_b_proj_in_bf16():
    """The sparse path reads kv_b_proj's weight itself; the indexer is frozen and scores in fp32."""
    model = tiny("glm_moe_dsa", num_layers=1)
    converted = convert_to_fp8(model)
    assert converted and not [n for n in converted if ".indexer." in n or n.endswith("kv_b_proj")]


def test_the_conversion_works_on_the_meta_device():
    """bench/trainer_step.py builds its model there, converts, then places and initialises it."""
    with torch.device("meta"):
        model = Transformer(tiny("qwen3", num_layers=1).args)
    assert len(convert_to_fp8(model)) == 7


def test_an_unknown_recipe_is_refused():
    with pytest.raises(ValueError, match="unknown FP8 recipe 'blockwise'"):
        convert_to_fp8(tiny("qwen3", num_layers=1), recipe="blockwise")


# --- checkpoints and published weights -------------------------------------------------------


def test_the_state_dict_keeps_its_names_shapes_and_dtypes():
    model = tiny("qwen3_moe")
    fp8 = copy.deepcopy(model)
    convert_to_fp8(fp8)
    ours, theirs = model.state_dict(), fp8.state_dict()
    assert list(ours) == list(theirs)
    for name, tensor in ours.items():
        other = theirs[name]
        assert (other.shape, other.dtype, type(other)) == (tensor.shape, tensor.dtype, torch.Tensor), name
        assert torch.equal(other, tensor), name
    assert [type(p) for p in fp8.parameters()] == [torch.nn.Parameter] * len(list(fp8.parameters()))


def test_published_weights_are_the_same_with_fp8_layers(tmp_path):
    folder = build_tiny_model(tmp_path / "src", "qwen3", hidden_size=64, num_layers=2)
    model = load_model(folder)
    fp8 = copy.deepcopy(model)
    assert convert_to_fp8(fp8)
    d = Dist(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    files = []
    for name, m in (("bf16", model), ("fp8", fp8)):
        FolderPublisher(tmp_path / name, folder, read_config(folder), 1, torch.bfloat16, d).publish(m, 0)
        files.append(load_file(next((tmp_path / name / "weights" / "step_0").glob("*.safetensors"))))
    assert list(files[0]) == list(files[1])
    assert all(torch.equal(files[0][k], files[1][k]) for k in files[0])


# --- numerics --------------------------------------------------------------------------------


def steps(model, ids, pos, n: int, lr: float = 1e-3) -> tuple[list[float], torch.Tensor]:
    """n AdamW steps on the row's mean token NLL: the losses, and the first forward's logprobs."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses, first = [], None
    for _ in range(n):
        logprobs, _ = model(ids, pos, torch.roll(ids, -1))
        loss = -logprobs[:, :-1].float().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        first = logprobs.detach().float() if first is None else first
    assert first is not None
    return losses, first


def _cpu_rowwise_scaled_mm() -> bool:
    """Whether this torch's CPU `_scaled_mm` takes row-wise scales (torch 2.13's does; 2.11's
    takes per-tensor scales only: "Now _scaled_mm only supports per-tensor scaling for CPU")."""
    a = torch.ones(16, 16).to(torch.float8_e4m3fn)
    b = torch.ones(16, 16).to(torch.float8_e4m3fn).t()
    try:
        torch._scaled_mm(a, b, scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.bfloat16)
    except RuntimeError:
        return False
    return True


@pytest.mark.skipif(not _cpu_rowwise_scaled_mm(), reason="this torch's CPU _scaled_mm has per-tensor scales only")
def test_fp8_steps_stay_within_e4m3s_precision_of_fp32_on_cpu():
    ref = tiny("qwen3")
    fp8 = copy.deepcopy(ref)
    convert_to_fp8(fp8)
    ids = torch.randint(0, 512, (1, 256), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(256)[None]
    ref_losses, ref_lp = steps(ref, ids, pos, 3)
    fp8_losses, fp8_lp = steps(fp8, ids, pos, 3)
    assert ref_losses[-1] < ref_losses[0] - 1 and fp8_losses[-1] < fp8_losses[0] - 1  # both learn
    for a, b in zip(ref_losses, fp8_losses):
        assert abs(a - b) <= U * abs(a), (ref_losses, fp8_losses)
    assert (fp8_lp - ref_lp).abs().mean() > 0  # FP8 ran


@pytest.fixture
def cuda_group(monkeypatch):
    """A one-rank NCCL group on the first GPU, torn down afterwards."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability(0) < (8, 9):
        pytest.skip("needs a GPU with FP8 matmuls (compute capability 8.9 or newer)")
    with one_rank_group(monkeypatch, timeout_s=120) as d:
        yield d


@pytest.mark.parametrize("compile_layers", [False, True], ids=["eager", "compiled"])
def test_fp8_steps_stay_within_e4m3s_precision_of_bf16_on_cuda(cuda_group, compile_layers, caplog):
    """The trainer's own placement (FSDP2 with bf16 parameters, fp32 master weights, compiled
    layers or not) of the same weights, bf16 against FP8: losses within u of each other over 5
    AdamW steps, FP8's logprobs further from fp32's than bf16's, the same state-dict entries."""
    from primerl_trainer.placement import parallelize

    caplog.set_level(logging.WARNING)
    device = cuda_group.device
    base = tiny("qwen3", hidden_size=256, intermediate_size=768, num_layers=2, head_dim=64)
    ids = torch.randint(0, 512, (1, 1024), generator=torch.Generator().manual_seed(1)).to(device)
    pos = torch.arange(1024, device=device)[None]
    with torch.no_grad():
        fp32_lp = copy.deepcopy(base).to(device)(ids, pos, torch.roll(ids, -1))[0].float()
    models = {"bf16": copy.deepcopy(base), "fp8": copy.deepcopy(base)}
    assert len(convert_to_fp8(models["fp8"])) == 14
    for m in models.values():
        parallelize(m, device, compile_layers=compile_layers, bf16=True)
    states = {k: {n: (t.shape, t.dtype, type(t)) for n, t in m.state_dict().items()} for k, m in models.items()}
    assert states["bf16"] == states["fp8"]
    (l16, lp16), (l8, lp8) = (steps(models[k], ids, pos, 5, lr=5e-4) for k in ("bf16", "fp8"))
    assert l16[-1] < l16[0] and l8[-1] < l8[0]
    for a, b in zip(l16, l8):
        assert abs(a - b) <= U * abs(a), (l16, l8)
    assert (lp8 - fp32_lp).abs().mean() > (lp16 - fp32_lp).abs().mean()  # FP8 ran
    full = {n: t.full_tensor() for n, t in models["fp8"].state_dict().items()}  # what publishing reads
    assert all(t.dtype == torch.float32 and torch.isfinite(t).all() for t in full.values())
