"""Publishing weights of the families whose checkpoints hold more than the trainer trains:
router correction biases stay fp32 in bf16 weights, GLM-4.5's MTP layer travels from the
source folder to every published folder unchanged, and a dequantised fp8 source publishes
plain weights."""

import json
from pathlib import Path

import torch
import transformers
from primerl_models import load_model, read_config
from primerl_trainer.distributed import Dist
from primerl_trainer.publish import FolderPublisher
from safetensors.torch import load_file, save_file

GLM_MOE = transformers.Glm4MoeConfig(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=16,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_shared_experts=1,
    first_k_dense_replace=1,
    n_group=2,
    topk_group=1,
    num_nextn_predict_layers=1,
    pad_token_id=0,
)


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in folder.glob("*.safetensors"):
        out.update(load_file(f))
    return out


def test_published_bf16_weights_keep_fp32_biases_and_carry_the_mtp_layer(tmp_path):
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(GLM_MOE)
    with torch.no_grad():
        hf.model.layers[1].mlp.gate.e_score_correction_bias.normal_(0.0, 0.1)
    src = tmp_path / "src"
    hf.save_pretrained(src)
    mtp = {"model.layers.2.eh_proj.weight": torch.randn(32, 64), "model.layers.2.enorm.weight": torch.randn(32)}
    save_file(mtp, src / "model-mtp.safetensors")
    (src / "model.safetensors.index.json").write_text(
        json.dumps(
            {
                "weight_map": {
                    **{name: "model.safetensors" for name in load_file(src / "model.safetensors")},
                    **{name: "model-mtp.safetensors" for name in mtp},
                }
            }
        )
    )
    source = tensors(src)
    d = Dist(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    publisher = FolderPublisher(tmp_path / "run", src, read_config(src), 2, torch.bfloat16, d)
    model = load_model(src)
    for step in range(2):  # every published folder has them, not only the first
        published = tensors(Path(publisher.publish(model, step).location))
        bias = published["model.layers.1.mlp.gate.e_score_correction_bias"]
        assert bias.dtype == torch.float32
        assert torch.equal(bias, source["model.layers.1.mlp.gate.e_score_correction_bias"])
        assert published["model.layers.1.mlp.gate.weight"].dtype == torch.bfloat16
        for name, tensor in mtp.items():
            assert published[name].dtype == torch.float32 and torch.equal(published[name], tensor), name
        assert sorted(published) == sorted(source)
