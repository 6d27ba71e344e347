"""A new version of a role's adapter, read for the engine to copy into the decoder's per-row LoRA in place
(docs/architecture.md §10): its A and B matrices by module, its LoRA scaling, its identity and calibration. The API
checked it before it was asked for (shared/adapter_check.py); the worker checks again what it copies, since the
directory may have changed since: the manifest, the base, finite weights."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from shared.adapter_identity import AdapterIdentity, describe_adapter
from shared.base_match import base_mismatch
from shared.calibration import Calibration, read_calibration
from shared.manifest import ADAPTER_CONFIG, verify_manifest

WEIGHTS = "adapter_model.safetensors"


@dataclass(frozen=True)
class AdapterWeights:
    identity: AdapterIdentity
    path: str
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]  # module name (as PEFT saves it) -> (A, B)
    scaling: float  # lora_alpha / r (or / sqrt(r) with rsLoRA)
    calibration: Calibration  # of this version: the jobs it answers are settled with it


def read_adapter(name: str, path: str, base_dir: str, base_setting: str, verify: bool) -> AdapterWeights:
    """The adapter at `path` as role `name`; ValueError naming why it cannot be served."""
    directory = Path(path)
    if verify and (problems := verify_manifest(directory)):
        raise ValueError(f"it failed verification: {'; '.join(problems)}")
    if reason := base_mismatch(directory, Path(base_dir)):
        raise ValueError(f"it is for another base: {reason}")
    # Read now, so a broken one refuses the switch, not each job at settle; read here, not through the cache keyed
    # by directory: a new version may come in the same directory with its own calibration.
    calibration = read_calibration(directory)
    config = json.loads((directory / ADAPTER_CONFIG).read_text(encoding="utf-8"))
    rank, alpha = config["r"], config["lora_alpha"]
    scaling = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
    tensors = load_file(directory / WEIGHTS)
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        module, _, kind = key.removesuffix(".weight").rpartition(".")
        if kind not in ("lora_A", "lora_B"):
            raise ValueError(f"{WEIGHTS} holds {key}, not a LoRA matrix")
        if not torch.isfinite(tensor).all():
            raise ValueError(f"{WEIGHTS}: {key} holds NaN or infinite weights")
        halves.setdefault(module, {})[kind] = tensor
    if incomplete := [m for m, pair in halves.items() if len(pair) != 2]:
        raise ValueError(f"{WEIGHTS}: {incomplete[0]} has only one of its A and B")
    weights = {module: (pair["lora_A"], pair["lora_B"]) for module, pair in halves.items()}
    return AdapterWeights(describe_adapter(name, directory, base_setting), path, weights, scaling, calibration)
