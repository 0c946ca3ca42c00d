"""Tiny random-weight models in Hugging Face layout, with an offline tokenizer. No network.

    folder = build_tiny_model("runs/tiny/model", family="qwen3", hidden_size=128, num_layers=4)

writes config.json, model.safetensors, tokenizer.json, tokenizer_config.json (with a ChatML chat
template) and generation_config.json: a folder that our loader, transformers and vLLM all load.
The tokenizer is either characters (`alphabet`: one token per character, the best fit for
toy tasks such as reversing text) or byte-level BPE trained on a small corpus (`corpus`).
Tests, examples and the CPU demo use these models.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

import torch

from primerl_models.common.transformer import Transformer
from primerl_models.families import FAMILIES, TinyShape
from primerl_models.hf import save_hf

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Tool calls as Qwen writes them: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
# with the markers as single (non-special) tokens so tool-call parsers find them.
TOOL_TOKENS = ["<tool_call>", "</tool_call>"]
# ChatML, plus tools the Qwen way in miniature: tool names listed in a system turn, an
# assistant's tool calls written after its content, tool results in `tool` turns.
CHAT_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\\ntools: ' }}"
    "{% for tool in tools %}{{ (tool.function.name if tool.function is defined else tool.name) + ' ' }}"
    "{% endfor %}{{ '<|im_end|>\\n' }}{% endif %}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% endif %}"
    "{% for call in message.get('tool_calls') or [] %}"
    "{% set fn = call.function if call.function is defined else call %}"
    "{{ '<tool_call>{\"name\": \"' + fn.name + '\", \"arguments\": ' }}"
    "{{ fn.arguments if fn.arguments is string else fn.arguments | tojson }}{{ '}</tool_call>' }}"
    "{% endfor %}"
    "{{ '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
DEFAULT_ALPHABET = string.ascii_letters + string.digits + string.punctuation + " \n"
DEFAULT_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Reinforcement learning from verifiable rewards trains language models to reason.",
    "What is 12 + 30? The answer is 42.",
    "def add(a, b):\n    return a + b\n",
] * 8


# Characters the chat template itself writes (role names, newlines): always in a char vocabulary.
TEMPLATE_CHARS = "systemuserassistanttool:\n {}\",_namearguments"


def char_tokenizer(alphabet: str):
    """One token per character of `alphabet` (plus the specials and the chat template's own
    characters), no merges."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    chars = list(dict.fromkeys(alphabet + TEMPLATE_CHARS))
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + chars)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIAL_TOKENS)
    tok.add_tokens(TOOL_TOKENS)
    return tok


def bpe_tokenizer(corpus: list[str], vocab_size: int):
    """Byte-level BPE trained on `corpus`: any text encodes, frequent pieces get merged."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    tok.add_tokens(TOOL_TOKENS)
    return tok


def build_tiny_model(
    folder: str | Path,
    family: str = "qwen3",
    *,
    tokenizer: str = "chars",
    alphabet: str = DEFAULT_ALPHABET,
    corpus: list[str] | None = None,
    bpe_vocab_size: int = 512,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int | None = None,
    intermediate_size: int | None = None,
    num_experts: int = 4,
    num_experts_per_tok: int = 2,
    tie_embeddings: bool = False,
    max_position_embeddings: int = 4096,
    init_std: float = 0.02,
    seed: int = 0,
    router_bias_std: float = 0.0,
    config_overrides: dict | None = None,
) -> Path:
    """Write a random-weight model of `family` with its tokenizer to `folder`; returns it.

    MoE families get `num_experts` experts of half the dense width; `router_bias_std` > 0 draws
    the routers' correction biases (zero otherwise, as in HF's initialisation);
    `config_overrides` replaces keys of the family's tiny config.json (n_group, use_qk_norm, ...)."""
    if family not in FAMILIES:
        raise ValueError(f"family {family!r} is not one of {sorted(FAMILIES)}")
    if tokenizer not in ("chars", "bpe"):
        raise ValueError(f"tokenizer must be 'chars' or 'bpe', got {tokenizer!r}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok = char_tokenizer(alphabet) if tokenizer == "chars" else bpe_tokenizer(corpus or DEFAULT_CORPUS, bpe_vocab_size)
    hidden = intermediate_size or 2 * hidden_size
    shape = TinyShape(
        vocab_size=tok.get_vocab_size(), hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads,
        num_kv_heads=num_kv_heads, head_dim=head_dim or hidden_size // num_heads, intermediate_size=hidden,
        num_experts=num_experts, num_experts_per_tok=num_experts_per_tok, moe_intermediate_size=hidden // 2,
        tie_embeddings=tie_embeddings, max_position_embeddings=max_position_embeddings,
    )
    # The family's own config keys, read back by the family's reader: a tiny model is loaded
    # exactly as a real checkpoint of its family would be.
    config = FAMILIES[family].tiny_config(shape) | dict(config_overrides or {})
    args = FAMILIES[family].args_from_hf(config)
    model = Transformer(args)
    model.init_weights(std=init_std, generator=torch.Generator().manual_seed(seed))
    if router_bias_std:
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.normal_(0.0, router_bias_std, generator=torch.Generator().manual_seed(seed + 1))

    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    config = config | {
        "bos_token_id": None,
        "eos_token_id": ids["<|im_end|>"],
        "pad_token_id": ids["<|endoftext|>"],
    }
    save_hf(model.state_dict(), config, folder)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": CHAT_TEMPLATE,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": "<|endoftext|>",
        "bos_token": None,
        "model_max_length": max_position_embeddings,
        "clean_up_tokenization_spaces": False,
    }, indent=2))
    (folder / "special_tokens_map.json").write_text(json.dumps({
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": "<|endoftext|>",
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
    }, indent=2))
    (folder / "generation_config.json").write_text(json.dumps({
        "eos_token_id": ids["<|im_end|>"], "pad_token_id": ids["<|endoftext|>"],
    }, indent=2))
    return folder
