"""An adapter's confidence calibration (docs/architecture.md §9): the exponent its decision probability is raised to.

A decision's confidence is the probability the model gave to the tokens that wrote it. A model can be cautious or
over-sure, so each adapter may carry `calibration.json`, written by `kevlaya models calibrate` from its answers to
validation scenarios: the confidence is then `probability ** exponent`, the exponent that makes "right" and "wrong"
likeliest on those answers (temperature scaling, applied to the answer's log-probability). The exponent is fitted
once, offline, and changes no decision and no ranking: the likelier of two answers stays the more confident.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from shared.manifest import MANIFEST_NAME, verify_manifest, write_manifest

CALIBRATION_FILE = "calibration.json"
# The exponents a fit may return: beyond these, a few answers would decide it, not the model.
EXPONENT_RANGE = (0.05, 20.0)


class CalibrationError(ValueError):
    """A calibration file that cannot be used; the message names the file and what is wrong."""


@dataclass(frozen=True)
class Calibration:
    exponent: float = 1.0  # 1: the probability as the model gave it

    def confidence(self, probability: float) -> float:
        return probability ** self.exponent


def log_loss(probabilities: Sequence[float], correct: Sequence[bool], calibration: Calibration) -> float:
    """Mean negative log-likelihood of the outcomes when each answer is right with its calibrated confidence."""
    total = 0.0
    for p, right in zip(probabilities, correct, strict=True):
        log_p = calibration.exponent * math.log(max(p, 1e-300))
        # log(1 - e^x) without losing precision when e^x is close to 1
        total -= log_p if right else math.log(-math.expm1(min(log_p, -1e-12)))
    return total / len(probabilities)


def fit_calibration(probabilities: Sequence[float], correct: Sequence[bool]) -> Calibration:
    """The exponent that minimises the log-loss of right/wrong on these answers. The loss is convex in the
    exponent, so a golden-section search on its logarithm finds the minimum."""
    if not probabilities:
        raise ValueError("no answers to fit a calibration on")
    if not all(0 < p <= 1 for p in probabilities):
        raise ValueError("every probability must be within (0, 1]")
    low, high = (math.log(bound) for bound in EXPONENT_RANGE)
    ratio = (math.sqrt(5) - 1) / 2
    for _ in range(80):
        first, second = high - ratio * (high - low), low + ratio * (high - low)
        if (log_loss(probabilities, correct, Calibration(math.exp(first)))
                <= log_loss(probabilities, correct, Calibration(math.exp(second)))):
            high = second
        else:
            low = first
    return Calibration(exponent=round(math.exp((low + high) / 2), 4))


def read_calibration(adapter_dir: Path) -> Calibration:
    """The adapter's calibration, or none (exponent 1) when it has no calibration file."""
    path = Path(adapter_dir) / CALIBRATION_FILE
    if not path.is_file():
        return Calibration()
    try:
        exponent = json.loads(path.read_text(encoding="utf-8"))["exponent"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as exc:
        raise CalibrationError(f"{path}: not a calibration (a JSON object with an `exponent`): {exc}") from exc
    low, high = EXPONENT_RANGE
    if isinstance(exponent, bool) or not isinstance(exponent, int | float) or not low <= exponent <= high:
        raise CalibrationError(f"{path}: `exponent` must be a number within [{low}, {high}], not {exponent!r}")
    return Calibration(exponent=float(exponent))


@lru_cache
def adapter_calibration(adapter_dir: str) -> Calibration:
    """`read_calibration`, read once per directory (a worker settles every job of the adapter with it)."""
    return read_calibration(Path(adapter_dir))


def write_calibration(adapter_dir: Path, calibration: Calibration, report: dict[str, Any]) -> Path:
    """Write the adapter's calibration file (the exponent and how it was fitted), then the manifests that cover it
    (the adapter's, and its parent's as the demo model has), so the adapter still verifies. A manifest that does
    not match before the write refuses it: a calibration never vouches for files changed since their manifest."""
    adapter_dir = Path(adapter_dir)
    covering = [d for d in (adapter_dir, adapter_dir.parent) if (d / MANIFEST_NAME).is_file()]
    for directory in covering:
        if problems := verify_manifest(directory):
            raise CalibrationError(f"{directory} does not match its {MANIFEST_NAME} ({'; '.join(problems)}): "
                                   "not calibrating a changed model")
    path = adapter_dir / CALIBRATION_FILE
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps({"exponent": calibration.exponent, **report}, indent=2) + "\n", encoding="utf-8")
    partial.replace(path)
    for directory in covering:
        write_manifest(directory)
    adapter_calibration.cache_clear()
    return path
