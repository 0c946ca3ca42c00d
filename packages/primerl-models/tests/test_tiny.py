"""Tiny models: what the builder writes loads in our code and in transformers alike."""

import pytest
import torch
import transformers
from primerl_models import load_model
from primerl_models.tiny import SPECIAL_TOKENS, build_tiny_model


@pytest.mark.parametrize(
    "family",
    [
        "llama",
        "qwen3",
        "qwen3_moe",
        "glm4",
        "glm4_moe",
        "glm_moe_dsa",
        "minimax_m2",
        "gpt_oss",
        "afmoe",
        "laguna",
        "qwen3_5_text",
        "qwen3_5_moe_text",
        "nemotron_h",
    ],
)
@pytest.mark.parametrize("tie", [False, True])
def test_tiny_model_loads_in_ours_and_transformers_alike(family, tie, tmp_path):
    if family == "nemotron_h" and tie:
        pytest.skip("Nemotron-H never ties its output projection (transformers ignores the key)")
    # non-zero router correction biases (GLM-4.5, MiniMax-M2): written and read by both
    folder = build_tiny_model(tmp_path, family, tie_embeddings=tie, init_std=0.2, seed=3, router_bias_std=0.1)
    ours = load_model(folder).eval()
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    ids = torch.tensor([tok("Reverse: primerl!").input_ids])
    pos = torch.arange(ids.shape[1])[None]
    with torch.no_grad():
        torch.testing.assert_close(ours.logits(ids, pos), hf(input_ids=ids).logits, atol=1e-4, rtol=0)
    assert (ours.lm_head is None) == tie


def test_char_tokenizer_is_one_token_per_character(tmp_path):
    folder = build_tiny_model(tmp_path, "qwen3", alphabet="abc ")
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    # the alphabet, the characters the template writes (role names, "tools:", tool-call JSON)
    # and the two tool-call markers
    assert len(tok) == len(SPECIAL_TOKENS) + len(set("abc " + 'systemuserassistanttool:\n {}",_namearguments')) + 2
    assert (
        tok.apply_chat_template([{"role": "user", "content": "ab"}], tokenize=False)
        == "<|im_start|>user\nab<|im_end|>\n"
    )
    assert "<|endoftext|>" not in tok.decode(tok.apply_chat_template([{"role": "user", "content": "ab"}])["input_ids"])
    ids = tok("abc cab").input_ids
    assert len(ids) == 7 and tok.decode(ids) == "abc cab"


def test_chat_template_renders_tools_and_tool_calls(tmp_path):
    folder = build_tiny_model(tmp_path, "qwen3", alphabet="abc0123456789")
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    messages = [
        {"role": "user", "content": "a"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}],
        },
        {"role": "tool", "tool_call_id": "1", "content": "2"},
    ]
    tools = [{"type": "function", "function": {"name": "add", "parameters": {}}}]
    text = tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\ntools: add <|im_end|>\n<|im_start|>user\na<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call><|im_end|>\n'
        "<|im_start|>tool\n2<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tok("<tool_call>a</tool_call>").input_ids
    assert tok.convert_ids_to_tokens(ids) == ["<tool_call>", "a", "</tool_call>"]


def test_chat_template_uses_single_special_tokens(tmp_path):
    folder = build_tiny_model(tmp_path, "llama", tokenizer="bpe")
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    text = tok.apply_chat_template([{"role": "user", "content": "2+2?"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    ids = tok(text).input_ids
    assert ids.count(tok.convert_tokens_to_ids("<|im_start|>")) == 2
    assert tok.eos_token == "<|im_end|>"
    assert tok.decode(tok("any text, even ünïcode").input_ids) == "any text, even ünïcode"


def test_same_seed_same_weights(tmp_path):
    a = load_model(build_tiny_model(tmp_path / "a", "qwen3", seed=7))
    b = load_model(build_tiny_model(tmp_path / "b", "qwen3", seed=7))
    c = load_model(build_tiny_model(tmp_path / "c", "qwen3", seed=8))
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert not torch.equal(a.embed_tokens.weight, c.embed_tokens.weight)


def test_unknown_family_is_refused(tmp_path):
    with pytest.raises(ValueError, match="family 'gpt2' is not one of"):
        build_tiny_model(tmp_path, "gpt2")
