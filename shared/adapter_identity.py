"""What identifies a loaded adapter (docs/architecture.md §10): its version, the SHA-256 of its config and weights
(`shared.manifest.adapter_sha256`), and what it is beside it. Read from its directory alone: the worker's model room
describes each adapter it loads without touching the database (`shared.adapter_versions` records it)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from shared.calibration import CALIBRATION_FILE
from shared.manifest import ADAPTER_CONFIG, adapter_sha256


@dataclass(frozen=True)
class AdapterIdentity:
    name: str  # what it is served as: kev, laya
    sha256: str  # its version
    rank: int | None  # adapter_config.json's `r`
    target_modules: list[str] | str | None  # adapter_config.json's: names (sorted), or a pattern
    base: str  # the base it was checked against, as KEVLAYA_MODEL__BASE names it
    calibrated: bool  # whether it has a calibration.json


def describe_adapter(name: str, directory: Path, base: str) -> AdapterIdentity:
    """The adapter in `directory`, served as `name` on `base`."""
    directory = Path(directory)
    config = json.loads((directory / ADAPTER_CONFIG).read_text(encoding="utf-8"))
    targets = config.get("target_modules")
    return AdapterIdentity(name=name, sha256=adapter_sha256(directory), rank=config.get("r"),
                           target_modules=sorted(targets) if isinstance(targets, list) else targets, base=base,
                           calibrated=(directory / CALIBRATION_FILE).is_file())
