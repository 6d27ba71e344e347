"""Whether an adapter may be loaded at run time into a role (docs/architecture.md §10): every check the API and
`kevlaya models load` make before anything is recorded, each refusal naming the field and why. Without torch: the
files are read with `json` and the safetensors format read by hand into numpy, so the API stays light.

What the running worker can take in place is fixed at its start (worker/decoder/kernels/row_lora.py): the LoRA
layers of the configured adapters (KEVLAYA_KEV__PATH, KEVLAYA_LAYA__PATH) and each role's rank block, at least
KEVLAYA_MODEL__ADAPTER_MAX_RANK wide, with KEVLAYA_MODEL__SPARE_ROLES blocks as wide for roles loaded under new
names. An adapter is refused here unless it fits those."""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from shared.base_match import base_mismatch
from shared.base_source import BaseSourceError, base_directory
from shared.calibration import CalibrationError, read_calibration
from shared.manifest import ADAPTER_CONFIG, adapter_sha256, verify_manifest
from shared.settings import ADAPTERS, ROLE_NAME_PATTERN, Settings

WEIGHTS = "adapter_model.safetensors"  # the one format read without torch (a pickled .bin is not)
_NUMPY = {"F64": np.float64, "F32": np.float32, "F16": np.float16}
_HEADER_MAX = 100 << 20


class AdapterRefused(ValueError):
    """An adapter that may not be loaded: `field` is the request's field the refusal is about."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field, self.message = field, message


@dataclass(frozen=True)
class CheckedAdapter:
    role: str
    path: Path  # resolved: no symbolic link, no `..`
    sha256: str  # its version (shared/manifest.py: adapter_sha256)
    rank: int
    modules: frozenset[str]  # the modules its weights change (PEFT's names, e.g. base_model.model.…q_proj)


def check_role(role: str) -> str:
    """A role's name: kev, laya (their adapter replaced), or a new one (it takes one of the worker's spare blocks,
    KEVLAYA_MODEL__SPARE_ROLES)."""
    if role == "auto" or not re.fullmatch(ROLE_NAME_PATTERN, role):
        raise AdapterRefused("lora_name", f"{role!r} cannot name a role: lower-case letters, digits, `-` and `_`, "
                             "starting with a letter, at most 32 characters, and not `auto` (the cascade)")
    return role


def check_adapter(role: str, lora_path: str, settings: Settings) -> CheckedAdapter:
    """The adapter at `lora_path` as `role` would serve it, or AdapterRefused naming why."""
    check_role(role)
    root = Path(settings.model.adapter_root).resolve()
    path = Path(lora_path).resolve()  # symbolic links and `..` resolved before the root is compared
    if not path.is_relative_to(root):
        raise AdapterRefused("lora_path", f"{lora_path} resolves to {path}, outside the allowed directory {root} "
                             "(KEVLAYA_MODEL__ADAPTER_ROOT)")
    if not path.is_dir():
        raise AdapterRefused("lora_path", f"{lora_path} is not a directory")
    missing = [name for name in (ADAPTER_CONFIG, WEIGHTS) if not (path / name).is_file()]
    if missing:
        raise AdapterRefused("lora_path", f"{lora_path} is missing {' and '.join(missing)} (weights are loaded at run "
                             f"time from {WEIGHTS} only)")
    if settings.model.verify_manifests and (problems := verify_manifest(path)):
        raise AdapterRefused("lora_path", f"{lora_path} failed verification: {'; '.join(problems)}")
    config = _config(path)
    _check_kind(config)
    _check_base(path, settings)
    try:  # the worker reads it to settle each job: a broken one would fail them all
        read_calibration(path)
    except CalibrationError as exc:
        raise AdapterRefused("lora_path", f"its calibration cannot be read: {exc}") from None
    shapes = _check_weights(path)
    modules = frozenset(name for name, _ in shapes)
    rank = max((shape[0] for name, shape in shapes if name.endswith(".lora_A")), default=0)
    allowed_rank = max_rank(role, settings)
    if rank > allowed_rank or (config.get("r") or 0) > allowed_rank:
        raise AdapterRefused("lora_path", f"its rank {max(rank, config.get('r') or 0)} is larger than the "
                             f"{allowed_rank} role {role} can take in place (KEVLAYA_MODEL__ADAPTER_MAX_RANK, or its "
                             "configured adapter's rank)")
    supported = served_modules(settings)
    if unsupported := {m.removesuffix(".lora_A").removesuffix(".lora_B") for m in modules} - supported:
        names = sorted({m.rsplit(".", 1)[-1] for m in unsupported})
        raise AdapterRefused("lora_path", f"its target modules {', '.join(names)} are not supported: the worker's "
                             "per-row LoRA holds only the modules its configured adapters change "
                             f"({', '.join(sorted({m.rsplit('.', 1)[-1] for m in supported}))})")
    return CheckedAdapter(role, path, adapter_sha256(path), rank, frozenset(
        m.removesuffix(".lora_A").removesuffix(".lora_B") for m in modules))


def _config(path: Path) -> dict[str, Any]:
    try:
        config = json.loads((path / ADAPTER_CONFIG).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AdapterRefused("lora_path", f"{ADAPTER_CONFIG} cannot be read: {exc}") from None
    if not isinstance(config, dict):
        raise AdapterRefused("lora_path", f"{ADAPTER_CONFIG} is not a JSON object")
    return config


def _check_kind(config: dict[str, Any]) -> None:
    """Only plain LoRA adds a product the per-row kernel computes; the rest would change the base's output."""
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterRefused("lora_path", f"it is a {config.get('peft_type')} adapter; only LoRA is served")
    for key in ("use_dora", "lora_bias", "fan_in_fan_out"):
        if config.get(key):
            raise AdapterRefused("lora_path", f"{ADAPTER_CONFIG} sets {key}, which the per-row LoRA does not apply")
    for key in ("modules_to_save", "rank_pattern", "alpha_pattern"):
        if config.get(key):
            raise AdapterRefused("lora_path", f"{ADAPTER_CONFIG} sets {key}, which is not supported at run time")
    if not isinstance(config.get("r"), int) or not isinstance(config.get("lora_alpha"), (int, float)):
        raise AdapterRefused("lora_path", f"{ADAPTER_CONFIG} has no integer `r` and numeric `lora_alpha`")


def _check_base(path: Path, settings: Settings) -> None:
    try:
        base = base_directory(settings.model.base, settings.model.cache_dir)
    except BaseSourceError as exc:
        raise AdapterRefused("lora_path", f"the running base cannot be read to compare: {exc}") from None
    if not (base / "config.json").is_file():
        raise AdapterRefused("lora_path", f"the base {settings.model.base} is not prepared yet (kevlaya models prepare)")
    if reason := base_mismatch(path, base):
        raise AdapterRefused("lora_path", f"it is for another base than the running one ({settings.model.base}): "
                             f"{reason}")


def safetensors_header(file: Path) -> tuple[dict[str, Any], int]:
    """The file's tensor table and where its data begins (the format: an 8-byte length, then that much JSON)."""
    try:
        with file.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > _HEADER_MAX:
                raise ValueError(f"a header of {length} bytes")
            header = json.loads(f.read(length))
    except (OSError, struct.error, ValueError) as exc:
        raise AdapterRefused("lora_path", f"{file.name} cannot be read as safetensors: {exc}") from None
    header.pop("__metadata__", None)
    return header, 8 + length


def _module(key: str) -> str:
    """`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight` → `…q_proj.lora_A`."""
    return key.removesuffix(".weight")


def _check_weights(path: Path) -> list[tuple[str, tuple[int, ...]]]:
    """(module, shape) of each LoRA matrix; refuses other tensors, odd shapes and any NaN or infinity."""
    file = path / WEIGHTS
    header, start = safetensors_header(file)
    data = np.memmap(file, dtype=np.uint8, mode="r")
    found = []
    for key, entry in sorted(header.items()):
        module, shape = _module(key), tuple(entry.get("shape", ()))
        if not module.endswith((".lora_A", ".lora_B")) or len(shape) != 2:
            raise AdapterRefused("lora_path", f"{WEIGHTS} holds {key} {list(shape)}, not a LoRA A or B matrix")
        first, last = entry["data_offsets"]
        raw = data[start + first:start + last]
        if entry["dtype"] == "BF16":  # numpy has no bfloat16: all exponent bits set is infinity or NaN
            bad = bool(np.any((raw.view(np.uint16) & 0x7F80) == 0x7F80))
        elif entry["dtype"] in _NUMPY:
            bad = not bool(np.all(np.isfinite(raw.view(_NUMPY[entry["dtype"]]))))
        else:
            raise AdapterRefused("lora_path", f"{WEIGHTS}: {key} is {entry['dtype']}, not a float type")
        if raw.size != math.prod(shape) * np.dtype(_NUMPY.get(entry["dtype"], np.uint16)).itemsize:
            raise AdapterRefused("lora_path", f"{WEIGHTS}: {key} holds fewer bytes than its shape")
        if bad:
            raise AdapterRefused("lora_path", f"{WEIGHTS}: {key} holds NaN or infinite weights")
        found.append((module, shape))
    if not found:
        raise AdapterRefused("lora_path", f"{WEIGHTS} holds no LoRA weights")
    return found


def _configured_modules(path: Path) -> set[str]:
    header, _ = safetensors_header(path / WEIGHTS)
    return {_module(key).removesuffix(".lora_A").removesuffix(".lora_B") for key in header}


def served_modules(settings: Settings) -> set[str]:
    """The modules the worker's per-row LoRA holds: those the configured adapters change (its start loads them)."""
    modules: set[str] = set()
    for role in ADAPTERS:
        path = Path(settings.adapter_profile(role).path)
        if (path / WEIGHTS).is_file():
            modules |= _configured_modules(path)
    return modules


def max_rank(role: str, settings: Settings) -> int:
    """The rank block the worker sizes for `role` at start: the setting, or the configured adapter's rank if larger;
    a spare block, which a new role takes, is as wide as the widest of Kev's and Laya's."""
    if role not in ADAPTERS:
        return max(max_rank(configured_role, settings) for configured_role in ADAPTERS)
    try:
        configured = json.loads((Path(settings.adapter_profile(role).path) / ADAPTER_CONFIG).read_text()).get("r", 0)
    except (OSError, ValueError):
        configured = 0
    return max(settings.model.adapter_max_rank, configured or 0)
