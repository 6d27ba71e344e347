"""The 4-bit NF4 base model: one definition for serving (`loading.py`) and QLoRA training (`modellab/training`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from transformers import BitsAndBytesConfig


def nf4_config(compute_dtype: torch.dtype) -> BitsAndBytesConfig:
    """NF4 weights with double quantization (docs/architecture.md §1), computing in `compute_dtype`."""
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=compute_dtype,
    )
