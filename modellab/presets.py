"""The roles' LoRA presets (docs/architecture.md §10): rank, alpha and peak learning rate, with the serving system
prompt from `shared/settings.py`. Training, the random models and the CLI's help read them here; no torch is
imported, so the CLI can."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shared.settings import ADAPTERS, Adapter, KevProfile, LayaProfile

# The layers the demo adapters cover, as common QLoRA practice does: every linear layer of a decoder block.
ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class LoraPreset:
    r: int
    alpha: int
    lr: float  # peak learning rate


LORA_PRESETS: dict[Adapter, LoraPreset] = {
    "kev": LoraPreset(r=16, alpha=32, lr=1e-4),
    "laya": LoraPreset(r=8, alpha=16, lr=2e-4),
}
_PROFILES = {"kev": KevProfile, "laya": LayaProfile}


def preset(adapter: str) -> dict[str, Any]:
    """The recipe's defaults for `adapter` (r, alpha, lr) plus its serving system prompt."""
    if adapter not in ADAPTERS:
        raise ValueError(f"unknown adapter {adapter!r}; choose one of {', '.join(ADAPTERS)}")
    lora = LORA_PRESETS[adapter]
    return {"r": lora.r, "alpha": lora.alpha, "lr": lora.lr, "system_prompt": _PROFILES[adapter]().system_prompt}
