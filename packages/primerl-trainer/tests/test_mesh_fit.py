"""A model that cannot be split as trainer.parallel asks fails at setup, naming the key; the
sizes that do fit pass. (The mesh's arithmetic over ranks is checked at config load:
tests/test_config_rules.py; the layouts' numbers on 4 ranks: test_parallel_layouts.py.)"""

import pytest
from primerl_models.families import FAMILIES, TinyShape
from primerl_trainer.placement import check_fits

SHAPE = TinyShape(vocab_size=64, num_heads=4, num_kv_heads=2, num_experts=8)


def args(family: str):
    return FAMILIES[family].args_from_hf(FAMILIES[family].tiny_config(SHAPE))


@pytest.mark.parametrize(
    "family, ep, cp, message",
    [
        ("qwen3", 2, 1, "trainer.parallel.ep = 2, but the model has no MoE layer"),
        ("qwen3_moe", 3, 1, "trainer.parallel.ep = 3 does not divide the model's 8 experts per MoE layer"),
        ("glm4_moe", 16, 1, "trainer.parallel.ep = 16 does not divide the model's 8 experts per MoE layer"),
        (
            "qwen3_moe",
            1,
            8,
            r"trainer.parallel.cp = 8 does not divide layer 0's 4 attention heads \(num_attention_heads\)",
        ),
        ("llama", 1, 3, "trainer.parallel.cp = 3 does not divide layer 0's 4 attention heads"),
        # the recurrent mixers split their heads (and Mamba2 its groups) over the CP ranks
        (
            "qwen3_5_text",
            1,
            4,
            r"trainer.parallel.cp = 4 does not divide layer 0's 2 key heads \(linear_num_key_heads\)",
        ),
        ("nemotron_h", 1, 4, r"trainer.parallel.cp = 4 does not divide layer 0's 2 groups \(n_groups\)"),
    ],
)
def test_a_model_that_does_not_split_fails_naming_the_key(family, ep, cp, message):
    with pytest.raises(ValueError, match=message):
        check_fits(args(family), ep, cp)


@pytest.mark.parametrize(
    "family, ep, cp",
    [
        ("qwen3_moe", 8, 4),  # one expert per rank; CP over more ranks than the 2 kv heads (repeated)
        ("glm4_moe", 2, 2),  # its dense first layer is left whole
        ("qwen3", 1, 4),
        ("qwen3_5_moe_text", 2, 2),  # 2 key heads, 4 value heads, 4 attention heads
        ("nemotron_h", 1, 2),  # 4 Mamba2 heads in 2 groups; its MLP blocks need nothing
    ],
)
def test_sizes_that_divide_fit(family, ep, cp):
    check_fits(args(family), ep, cp)
