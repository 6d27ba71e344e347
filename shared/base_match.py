"""Which base an adapter was made for: `BASE.json` in the adapter's directory records the base's shapes and
tokenizer when the adapter is written, and the worker compares it with the base it loaded. PEFT's own check
catches shapes that differ; an adapter of another base with the same shapes (another tokenizer, another
vocabulary order, another GGUF file of the same model) would load silently and answer noise."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from shared.base_source import source_sha256

BASE_RECORD = "BASE.json"
SHAPE_KEYS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "head_dim")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "merges.txt")  # those present count


def describe_base(base_dir: Path) -> dict[str, Any]:
    """The base as an adapter depends on it: its shapes (config.json), its tokenizer's files' digest and, for a
    GGUF base, the file's digest."""
    config = json.loads((base_dir / "config.json").read_text(encoding="utf-8"))
    digest = hashlib.sha256()
    for name in TOKENIZER_FILES:
        if (base_dir / name).is_file():
            digest.update(name.encode() + b"\0" + (base_dir / name).read_bytes())
    described = {"shapes": {key: config.get(key) for key in SHAPE_KEYS}, "tokenizer_sha256": digest.hexdigest()}
    if (gguf := source_sha256(base_dir)) is not None:
        described["gguf_sha256"] = gguf
    return described


def record_base(adapter_dir: Path, base_dir: Path) -> None:
    """Write the adapter's BASE.json (before its manifest, which then covers it)."""
    (adapter_dir / BASE_RECORD).write_text(json.dumps(describe_base(base_dir), indent=2) + "\n", encoding="utf-8")


def base_mismatch(adapter_dir: Path, base_dir: Path) -> str | None:
    """Why the adapter was made for another base than `base_dir`, or None (also when it records no base)."""
    record = adapter_dir / BASE_RECORD
    if not record.is_file():
        return None
    made_for, loaded = json.loads(record.read_text(encoding="utf-8")), describe_base(base_dir)
    for key, value in made_for.get("shapes", {}).items():
        if loaded["shapes"].get(key) != value:
            return f"it was made for a base with {key} {value}; this base has {loaded['shapes'].get(key)}"
    if made_for.get("tokenizer_sha256") != loaded["tokenizer_sha256"]:
        return "it was made for a base with another tokenizer (its BASE.json digest differs from this base's)"
    if made_for.get("gguf_sha256") != loaded.get("gguf_sha256"):
        return (f"it was made for the base read from GGUF file sha256 {made_for.get('gguf_sha256') or '(none)'}; "
                f"this base is {loaded.get('gguf_sha256') or 'not read from a GGUF file'}")
    return None
