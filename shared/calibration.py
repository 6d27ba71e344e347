"""An adapter's confidence calibration (docs/architecture.md §9): how its decision probability becomes a confidence.

A decision's confidence is the probability the model gave to the tokens that wrote it. A model can be cautious or
over-sure, so each adapter may carry `calibration.json`, written by `kevlaya models calibrate` from its answers to
validation scenarios: the confidence is then `sigmoid(slope * ln p + intercept)` (Platt scaling on the answer's
log-probability), the slope and intercept that make "right" and "wrong" likeliest on those answers. The intercept
lets a role whose probabilities say little (a small base reading a domain it never saw) be as sure as it is right on
average, which a slope alone cannot. Files with only an `exponent`, from before intercepts, still mean
`p ** exponent`. A fit happens once, offline, and changes no decision and no ranking: the slope is positive, so the
likelier of two answers stays the more confident.
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
# The slopes and intercepts a fit may return: beyond these, a few answers would decide it, not the model.
EXPONENT_RANGE = (0.001, 20.0)
INTERCEPT_RANGE = (-50.0, 50.0)


class CalibrationError(ValueError):
    """A calibration file that cannot be used; the message names the file and what is wrong."""


def _log_sigmoid(z: float) -> float:
    return -math.log1p(math.exp(-z)) if z >= 0 else z - math.log1p(math.exp(z))


@dataclass(frozen=True)
class Calibration:
    exponent: float = 1.0  # the slope on the log-probability (1 and no intercept: the probability as the model gave it)
    intercept: float | None = None  # None: the probability raised to the exponent (files from before intercepts)

    def log_odds(self, probability: float) -> tuple[float, float]:
        """ln(confidence) and ln(1 - confidence), without losing precision at either end."""
        log_p = self.exponent * math.log(max(probability, 1e-300))
        if self.intercept is None:
            return log_p, math.log(-math.expm1(min(log_p, -1e-12)))
        z = log_p + self.intercept
        return _log_sigmoid(z), _log_sigmoid(-z)

    def confidence(self, probability: float) -> float:
        return math.exp(self.log_odds(probability)[0])

    def describe(self) -> str:
        """How a probability becomes a confidence, in a log line's words."""
        if self.intercept is None:
            return f"p ** {self.exponent:g}"
        return f"sigmoid({self.exponent:g} ln p {'+' if self.intercept >= 0 else '-'} {abs(self.intercept):g})"

    def to_dict(self) -> dict[str, float]:
        return {"exponent": self.exponent} | ({} if self.intercept is None else {"intercept": self.intercept})


def log_loss(probabilities: Sequence[float], correct: Sequence[bool], calibration: Calibration) -> float:
    """Mean negative log-likelihood of the outcomes when each answer is right with its calibrated confidence."""
    total = 0.0
    for p, right in zip(probabilities, correct, strict=True):
        log_right, log_wrong = calibration.log_odds(p)
        total -= log_right if right else log_wrong
    return total / len(probabilities)


def fit_calibration(probabilities: Sequence[float], correct: Sequence[bool]) -> Calibration:
    """The slope and intercept that minimise the log-loss of right/wrong on these answers: a logistic regression on
    the log-probability, convex, solved by Newton's method with a backtracking line search, the slope kept positive
    (within EXPONENT_RANGE) so that no ranking changes."""
    if not probabilities:
        raise ValueError("no answers to fit a calibration on")
    if not all(0 < p <= 1 for p in probabilities):
        raise ValueError("every probability must be within (0, 1]")
    xs = [math.log(p) for p in probabilities]
    ys = [1.0 if right else 0.0 for right in correct]
    (low, high), (b_low, b_high) = EXPONENT_RANGE, INTERCEPT_RANGE

    def clamp(a: float, b: float) -> Calibration:
        return Calibration(exponent=min(max(a, low), high), intercept=min(max(b, b_low), b_high))

    current = Calibration(exponent=1.0, intercept=0.0)
    loss = log_loss(probabilities, correct, current)
    for _ in range(100):
        ga = gb = haa = hab = hbb = 0.0
        for x, y in zip(xs, ys, strict=True):
            c = 1 / (1 + math.exp(-min(max(current.exponent * x + current.intercept, -500), 500)))
            ga, gb = ga + (c - y) * x, gb + (c - y)
            w = c * (1 - c) + 1e-9
            haa, hab, hbb = haa + w * x * x, hab + w * x, hbb + w
        det = haa * hbb - hab * hab
        if det <= 0:
            break
        da, db = (hbb * ga - hab * gb) / det, (haa * gb - hab * ga) / det
        step = 1.0
        while step > 1e-6:
            trial = clamp(current.exponent - step * da, current.intercept - step * db)
            trial_loss = log_loss(probabilities, correct, trial)
            if trial_loss <= loss:
                break
            step /= 2
        else:
            break
        moved = abs(trial.exponent - current.exponent) + abs(trial.intercept - current.intercept)
        current, loss = trial, trial_loss
        if moved < 1e-9:
            break
    return Calibration(exponent=round(current.exponent, 6), intercept=round(current.intercept, 6))


def read_calibration(adapter_dir: Path) -> Calibration:
    """The adapter's calibration, or none (the probability as the model gave it) when it has no calibration file."""
    path = Path(adapter_dir) / CALIBRATION_FILE
    if not path.is_file():
        return Calibration()
    try:
        fields = json.loads(path.read_text(encoding="utf-8"))
        exponent, intercept = fields["exponent"], fields.get("intercept")
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as exc:
        raise CalibrationError(f"{path}: not a calibration (a JSON object with an `exponent`): {exc}") from exc
    for name, value, (low, high) in (("exponent", exponent, EXPONENT_RANGE), ("intercept", intercept, INTERCEPT_RANGE)):
        if value is None and name == "intercept":
            continue
        if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
            raise CalibrationError(f"{path}: `{name}` must be a number within [{low}, {high}], not {value!r}")
    return Calibration(exponent=float(exponent), intercept=None if intercept is None else float(intercept))


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
    partial.write_text(json.dumps(calibration.to_dict() | report, indent=2) + "\n", encoding="utf-8")
    partial.replace(path)
    for directory in covering:
        write_manifest(directory)
    adapter_calibration.cache_clear()
    return path
