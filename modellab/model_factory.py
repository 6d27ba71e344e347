"""Random-weight base models with Kev/Laya LoRA adapters, written to disk in HF format.

Used by the tests (a tiny model) and by GPU benchmarks (real shapes, random weights). Answers from these models
are noise; their shapes and file layout are real.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    LlamaConfig,
    PretrainedConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
)

from modellab.presets import LORA_PRESETS
from shared.base_match import record_base
from shared.manifest import write_manifest

PAD, EOS = "<|pad|>", "<|endoftext|>"
ROLE_TOKENS = {"system": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>"}

# Role tokens are written literally (never built from the role string), so `sanitize_control_tokens` can keep
# users from injecting them through message content; an unknown role is an error, not free text.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}<|system|>"
    "{% elif message['role'] == 'user' %}<|user|>"
    "{% elif message['role'] == 'assistant' %}<|assistant|>"
    "{% else %}{{ raise_exception('unknown role: ' + message['role']) }}{% endif %}"
    "{{ message['content'] }}<|endoftext|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

SHAPES: dict[str, tuple[type[PretrainedConfig], dict[str, Any]]] = {
    # vocab_size None = the byte tokenizer's size
    "tiny": (LlamaConfig, dict(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=None, max_position_embeddings=2048,
    )),
    # ~360 M parameters (1.4 GB in fp32): quantizing it to NF4 while loading takes several seconds on a CPU,
    # longer than a new Celery pool child gets by default (tests of worker restarts with a slow model load).
    "slow-load": (LlamaConfig, dict(
        hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=4,
        intermediate_size=4096, vocab_size=None, max_position_embeddings=2048,
    )),
    "qwen2.5-1.5b": (Qwen2Config, dict(
        hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
        intermediate_size=8960, vocab_size=151936, max_position_embeddings=32768, tie_word_embeddings=True,
    )),
    "qwen2.5-3b": (Qwen2Config, dict(
        hidden_size=2048, num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2,
        intermediate_size=11008, vocab_size=151936, max_position_embeddings=32768, tie_word_embeddings=True,
    )),
    "llama-2-7b": (LlamaConfig, dict(
        hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
        intermediate_size=11008, vocab_size=32000, max_position_embeddings=4096,
    )),
}

# the roles' real ranks and alphas, so a random model's adapters have the shipped shapes
DEFAULT_ADAPTERS: dict[str, tuple[int, int]] = {name: (p.r, p.alpha) for name, p in LORA_PRESETS.items()}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (what the ByteLevel pre-tokenizer emits), so token id == byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            mapping[byte] = chr(byte)
        else:
            mapping[byte] = chr(256 + extra)
            extra += 1
    return mapping


SPECIAL_TOKENS = (PAD, EOS, *ROLE_TOKENS.values())


def build_byte_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE with no merges (one token per byte) plus pad/eos and the three role tokens."""
    vocab = {char: byte for byte, char in _bytes_to_unicode().items()}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return chat_tokenizer(backend)


def chat_tokenizer(backend: Tokenizer) -> PreTrainedTokenizerFast:
    """Wrap a byte-level `tokenizers` backend with the special tokens and chat template every kevlaya model uses."""
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD, eos_token=EOS, bos_token=EOS,
        extra_special_tokens=list(ROLE_TOKENS.values()),
        padding_side="left",  # decoder-only generation needs the prompt flush against the new tokens
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _config(shape: str, tokenizer: PreTrainedTokenizerFast) -> PretrainedConfig:
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; choose one of {', '.join(SHAPES)}")
    config_class, kwargs = SHAPES[shape]
    kwargs = dict(kwargs)
    if kwargs["vocab_size"] is None:
        kwargs["vocab_size"] = len(tokenizer)
    return config_class(
        **kwargs,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )


def build_random_model(
    out_dir: Path,
    shape: str = "tiny",
    *,
    seed: int = 0,
    adapters: dict[str, tuple[int, int]] | None = None,
    target_modules: tuple[str, ...] = ("q_proj", "v_proj"),
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
) -> dict[str, Path]:
    """Write `out_dir/base` and one LoRA adapter per `adapters` entry (name -> (r, alpha)), each with a manifest.

    LoRA B is random (not zero, PEFT's default), so every adapter really changes the base model's outputs.
    Returns {"base": path, <adapter name>: path, ...}.
    """
    out_dir = Path(out_dir)
    adapters = DEFAULT_ADAPTERS if adapters is None else adapters
    for name in ("base", *adapters):  # a model built here before (maybe of another shape) must leave nothing behind
        shutil.rmtree(out_dir / name, ignore_errors=True)
    tokenizer = build_byte_tokenizer()
    config = _config(shape, tokenizer)

    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    base_dir = out_dir / "base"
    model.save_pretrained(base_dir)
    model.name_or_path = str(base_dir)  # PEFT records it as the adapters' base_model_name_or_path
    tokenizer.save_pretrained(base_dir)
    write_manifest(base_dir)
    paths = {"base": base_dir}

    peft_model: PeftModel | None = None
    for index, (name, (rank, alpha)) in enumerate(adapters.items(), start=1):
        lora = LoraConfig(
            r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=list(target_modules),
            init_lora_weights=False, task_type="CAUSAL_LM",
        )
        torch.manual_seed(seed + index)  # each adapter's weights depend only on the seed and its position
        if peft_model is None:
            peft_model = get_peft_model(model, lora, adapter_name=name)
        else:
            peft_model.add_adapter(name, lora)
        # PEFT writes a non-default adapter to <dir>/<adapter name> and a model card beside it: keep only the former
        with tempfile.TemporaryDirectory(dir=out_dir) as scratch:
            peft_model.save_pretrained(scratch, selected_adapters=[name])
            shutil.move(Path(scratch) / name, out_dir / name)
        record_base(out_dir / name, base_dir)
        write_manifest(out_dir / name)
        paths[name] = out_dir / name
    return paths
