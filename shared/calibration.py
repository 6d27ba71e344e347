"""An adapter's confidence calibration (docs/architecture.md §9): how its decision probability becomes a confidence.

A decision's confidence is the probability p the model gave to the tokens that wrote it. A model can be cautious or
over-sure, so each adapter may carry `calibration.json`, written by `kevlaya models calibrate` from its answers to
validation scenarios: the confidence is then `sigmoid(exponent * ln p + linear * p + intercept)`, the weights that
make "right" and "wrong" likeliest on those answers (a logistic regression on the probability and its logarithm;
Platt scaling of either alone is a special case). Both are needed for a small base reading a domain it never saw:
its right answers spread from p = 10^-19 to 0.97, so the logarithm alone ranks a long tail it cannot tell apart and
keeps the few near-certain answers from looking certain, and p alone cannot tell the tail's orders of magnitude.
Files with an `exponent` and no `intercept`, from before, still mean `p ** exponent`. A fit happens once, offline, and
changes no decision and no ranking: both weights are positive, so the likelier of two answers stays the more
confident.
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
# The weights a fit may return: beyond these, a few answers would decide it, not the model. The exponent's floor is
# above 0 so that confidence always grows with the probability.
EXPONENT_RANGE = (0.0001, 20.0)
LINEAR_RANGE = (0.0, 50.0)
INTERCEPT_RANGE = (-50.0, 50.0)


class CalibrationError(ValueError):
    """A calibration file that cannot be used; the message names the file and what is wrong."""


def _log_sigmoid(z: float) -> float:
    return -math.log1p(math.exp(-z)) if z >= 0 else z - math.log1p(math.exp(z))


@dataclass(frozen=True)
class Calibration:
    exponent: float = 1.0  # the weight of ln p (1, no intercept: the probability as the model gave it)
    intercept: float | None = None  # None: the probability raised to the exponent (files from before intercepts)
    linear: float = 0.0  # the weight of p itself

    def log_odds(self, probability: float) -> tuple[float, float]:
        """ln(confidence) and ln(1 - confidence), without losing precision at either end."""
        log_p = self.exponent * math.log(max(probability, 1e-300))
        if self.intercept is None:
            return log_p, math.log(-math.expm1(min(log_p, -1e-12)))
        z = log_p + self.linear * probability + self.intercept
        return _log_sigmoid(z), _log_sigmoid(-z)

    def confidence(self, probability: float) -> float:
        return math.exp(self.log_odds(probability)[0])

    def describe(self) -> str:
        """How a probability becomes a confidence, in a log line's words."""
        if self.intercept is None:
            return f"p ** {self.exponent:g}"
        return f"sigmoid({self.exponent:g} ln p + {self.linear:g} p {'+' if self.intercept >= 0 else '-'} " \
               f"{abs(self.intercept):g})"

    def to_dict(self) -> dict[str, float]:
        if self.intercept is None:
            return {"exponent": self.exponent}
        return {"exponent": self.exponent, "linear": self.linear, "intercept": self.intercept}


def log_loss(probabilities: Sequence[float], correct: Sequence[bool], calibration: Calibration) -> float:
    """Mean negative log-likelihood of the outcomes when each answer is right with its calibrated confidence."""
    total = 0.0
    for p, right in zip(probabilities, correct, strict=True):
        log_right, log_wrong = calibration.log_odds(p)
        total -= log_right if right else log_wrong
    return total / len(probabilities)


def fit_calibration(probabilities: Sequence[float], correct: Sequence[bool]) -> Calibration:
    """The weights that minimise the log-loss of right/wrong on these answers: a logistic regression on (ln p, p),
    convex, solved by Newton's method with a backtracking line search, each weight kept within its range (a weight
    held at its bound leaves the Newton system while the gradient pushes it outward)."""
    if not probabilities:
        raise ValueError("no answers to fit a calibration on")
    if not all(0 < p <= 1 for p in probabilities):
        raise ValueError("every probability must be within (0, 1]")
    import numpy as np

    bounds = np.array((EXPONENT_RANGE, LINEAR_RANGE, INTERCEPT_RANGE))
    p = np.asarray(probabilities, dtype=np.float64)
    x = np.stack([np.log(p), p, np.ones_like(p)], axis=1)  # what each weight multiplies
    y = np.asarray(correct, dtype=np.float64)

    def calibration(theta: np.ndarray) -> Calibration:
        a, b, c = np.clip(theta, bounds[:, 0], bounds[:, 1]).tolist()
        return Calibration(exponent=a, linear=b, intercept=c)

    current = calibration(np.array([1.0, 0.0, 0.0]))
    loss = log_loss(probabilities, correct, current)
    for _ in range(200):
        theta = np.array([current.exponent, current.linear, current.intercept])
        c = 1 / (1 + np.exp(-np.clip(x @ theta, -500, 500)))
        grad, hess = x.T @ (c - y), (x * (c * (1 - c) + 1e-9)[:, None]).T @ x
        free = ~(((theta <= bounds[:, 0]) & (grad > 0)) | ((theta >= bounds[:, 1]) & (grad < 0)))
        step = np.zeros(3)
        try:
            step[free] = np.linalg.solve(hess[np.ix_(free, free)], grad[free])
        except np.linalg.LinAlgError:
            break
        scale = 1.0
        while scale > 1e-8:
            trial = calibration(theta - scale * step)
            trial_loss = log_loss(probabilities, correct, trial)
            if trial_loss <= loss:
                break
            scale /= 2
        else:
            break
        moved = abs(trial.exponent - current.exponent) + abs(trial.linear - current.linear) + \
            abs(trial.intercept - current.intercept)
        current, loss = trial, trial_loss
        if moved < 1e-10:
            break
    return Calibration(exponent=round(current.exponent, 6), linear=round(current.linear, 6),
                       intercept=round(current.intercept, 6))


def read_calibration(adapter_dir: Path) -> Calibration:
    """The adapter's calibration, or none (the probability as the model gave it) when it has no calibration file."""
    path = Path(adapter_dir) / CALIBRATION_FILE
    if not path.is_file():
        return Calibration()
    try:
        fields = json.loads(path.read_text(encoding="utf-8"))
        weights = {"exponent": fields["exponent"], "intercept": fields.get("intercept"), "linear": fields.get("linear")}
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as exc:
        raise CalibrationError(f"{path}: not a calibration (a JSON object with an `exponent`): {exc}") from exc
    ranges = {"exponent": EXPONENT_RANGE, "intercept": INTERCEPT_RANGE, "linear": LINEAR_RANGE}
    for name, value in weights.items():
        low, high = ranges[name]
        if value is None and name != "exponent":
            continue
        if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
            raise CalibrationError(f"{path}: `{name}` must be a number within [{low}, {high}], not {value!r}")
    if weights["intercept"] is None:
        if weights["linear"] is not None:
            raise CalibrationError(f"{path}: `linear` needs an `intercept`")
        return Calibration(exponent=float(weights["exponent"]))
    return Calibration(exponent=float(weights["exponent"]), intercept=float(weights["intercept"]),
                       linear=float(weights["linear"] or 0.0))


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
