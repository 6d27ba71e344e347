"""An adapter's confidence calibration: fitted on validation answers, written beside the adapter with its manifests,
applied by the worker to every decision of the adapter, and refused when broken."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from sqlalchemy import select

from shared.calibration import (
    CALIBRATION_FILE,
    Calibration,
    CalibrationError,
    fit_calibration,
    log_loss,
    read_calibration,
    write_calibration,
)
from shared.db import session_scope
from shared.manifest import verify_manifest, write_manifest
from shared.models import Job
from shared.settings import Settings

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "models" / "demo"


@pytest.mark.parametrize(("exponent", "linear", "intercept"),
                         [(0.4, 0.0, 0.0), (1.0, 0.0, 2.0), (2.5, 0.0, -0.5), (0.05, 0.0, 0.7), (0.0001, 4.0, -0.5)])
def test_the_fit_finds_the_weights_the_outcomes_were_drawn_with(exponent: float, linear: float, intercept: float):
    """Answers right with confidence sigmoid(exponent ln p + linear p + intercept): the fit recovers the curve. The
    fourth is a role whose probabilities say little (nearly flat, right two times in three), the last one whose
    near-certain answers are right and whose others are a coin toss whatever their order of magnitude."""
    rng = random.Random(7)
    truth = Calibration(exponent=exponent, linear=linear, intercept=intercept)
    probabilities = [rng.uniform(0.001, 1.0) for _ in range(20_000)]
    correct = [rng.random() < truth.confidence(p) for p in probabilities]
    fitted = fit_calibration(probabilities, correct)
    assert max(abs(fitted.confidence(p) - truth.confidence(p)) for p in (0.001, 0.01, 0.1, 0.3, 0.6, 0.9, 1.0)) < 0.03


def test_the_probability_and_its_logarithm_each_calibrate_what_the_other_cannot():
    """Right 60 % of the time below p = 0.5 whatever the order of magnitude, 97 % above: the fit reports the
    near-certain answers as near-certain, which the logarithm alone cannot, and the tail as a coin toss, which an
    exponent alone cannot; its log-loss beats both."""
    rng = random.Random(3)
    probabilities = [10 ** -rng.uniform(0, 12) if rng.random() < 0.7 else rng.uniform(0.5, 1.0) for _ in range(5_000)]
    correct = [rng.random() < (0.97 if p > 0.5 else 0.6) for p in probabilities]
    fitted = fit_calibration(probabilities, correct)
    assert fitted.confidence(0.95) > 0.9 and abs(fitted.confidence(1e-9) - 0.6) < 0.05
    log_alone = min((Calibration(exponent=a / 100, intercept=b / 10) for a in range(1, 60, 2) for b in range(-10, 30)),
                    key=lambda c: log_loss(probabilities, correct, c))
    exponent_alone = min((Calibration(exponent=e / 100) for e in range(1, 200)),
                         key=lambda c: log_loss(probabilities, correct, c))
    assert log_loss(probabilities, correct, fitted) < log_loss(probabilities, correct, log_alone) - 0.01
    assert log_loss(probabilities, correct, fitted) < log_loss(probabilities, correct, exponent_alone) - 0.01


def test_confidence_grows_with_the_probability_whatever_the_fit():
    rng = random.Random(5)
    probabilities = [rng.uniform(0.001, 1.0) for _ in range(2_000)]
    correct = [rng.random() < 0.5 for _ in probabilities]  # no signal at all: the fit must still keep every order
    fitted = fit_calibration(probabilities, correct)
    grid = [i / 100 for i in range(1, 101)]
    assert all(fitted.confidence(a) < fitted.confidence(b) for a, b in zip(grid, grid[1:]))


def test_a_calibration_file_from_before_intercepts_still_means_the_probability_to_the_exponent(tmp_path: Path):
    (tmp_path / CALIBRATION_FILE).write_text('{"exponent": 0.5, "fitted_on": "val.jsonl"}')
    assert read_calibration(tmp_path).confidence(0.25) == pytest.approx(0.5)


def test_a_fit_needs_answers_with_a_probability():
    with pytest.raises(ValueError, match="no answers"):
        fit_calibration([], [])
    with pytest.raises(ValueError, match="within"):
        fit_calibration([0.0, 0.5], [False, True])


def test_an_adapter_without_a_calibration_file_reports_the_probability_as_it_is(tmp_path: Path):
    assert read_calibration(tmp_path) == Calibration()
    assert Calibration().confidence(0.37) == 0.37


@pytest.mark.parametrize(("content", "named"), [
    ("{not json", "not a calibration"),
    ('{"fitted_on": "x"}', "not a calibration"),
    ('[0.5]', "not a calibration"),
    ('{"exponent": "0.5"}', "`exponent` must be a number"),
    ('{"exponent": true}', "`exponent` must be a number"),
    ('{"exponent": 0}', "`exponent` must be a number"),
    ('{"exponent": 1000}', "`exponent` must be a number"),
    ('{"exponent": 0.5, "intercept": "1"}', "`intercept` must be a number"),
    ('{"exponent": 0.5, "intercept": 99}', "`intercept` must be a number"),
    ('{"exponent": 0.5, "intercept": 0, "linear": -1}', "`linear` must be a number"),
    ('{"exponent": 0.5, "linear": 1}', "`linear` needs an `intercept`"),
])
def test_a_broken_calibration_file_is_refused_naming_the_file(tmp_path: Path, content: str, named: str):
    (tmp_path / CALIBRATION_FILE).write_text(content)
    with pytest.raises(CalibrationError, match=named) as raised:
        read_calibration(tmp_path)
    assert str(tmp_path / CALIBRATION_FILE) in str(raised.value)


def _adapter_with_manifests(root: Path) -> Path:
    """A model directory with a manifest over an adapter that has its own, as the demo model is laid out."""
    adapter = root / "laya"
    adapter.mkdir(parents=True)
    (adapter / "adapter_model.safetensors").write_bytes(b"weights")
    write_manifest(adapter)
    (root / "BUILD.json").write_text("{}")
    write_manifest(root)
    return adapter


def test_writing_a_calibration_keeps_the_adapter_and_its_parent_verified(tmp_path: Path):
    adapter = _adapter_with_manifests(tmp_path)
    fitted = Calibration(exponent=0.5, linear=2.0, intercept=-0.25)
    written = write_calibration(adapter, fitted, {"fitted_on": "val.jsonl"})
    assert json.loads(written.read_text()) == {"exponent": 0.5, "linear": 2.0, "intercept": -0.25,
                                               "fitted_on": "val.jsonl"}
    assert verify_manifest(adapter) == [] and verify_manifest(tmp_path) == []
    assert read_calibration(adapter) == fitted
    assert {p.name for p in adapter.iterdir()} == {CALIBRATION_FILE, "MANIFEST.sha256", "adapter_model.safetensors"}


@pytest.mark.parametrize("changed", ["laya/adapter_model.safetensors", "BUILD.json"])
def test_a_calibration_is_not_written_over_files_changed_since_their_manifest(tmp_path: Path, changed: str):
    """Writing the manifests again would vouch for the changed file: the write is refused and nothing is written."""
    adapter = _adapter_with_manifests(tmp_path)
    (tmp_path / changed).write_bytes(b"swapped")
    with pytest.raises(CalibrationError, match="checksum mismatch"):
        write_calibration(adapter, Calibration(exponent=0.5), {})
    assert not (adapter / CALIBRATION_FILE).exists()
    assert verify_manifest(tmp_path) != []


@pytest.fixture
def demo_copy(tmp_path: Path) -> Path:
    copy = tmp_path / "demo"
    shutil.copytree(DEMO, copy)
    for adapter in ("kev", "laya"):  # start uncalibrated, whatever the shipped model carries
        (copy / adapter / CALIBRATION_FILE).unlink(missing_ok=True)
        write_manifest(copy / adapter)
    write_manifest(copy)
    return copy


def _demo_settings(model: Path) -> Settings:
    return Settings(_env_file=None, model={"base": str(model / "base"), "device": "cpu"}, engine={"max_batch": 4},
                    kev={"path": str(model / "kev")}, laya={"path": str(model / "laya")})


def _laya_confidences(model: Path) -> list[tuple[str, float]]:
    """Laya's decision and confidence for three stored jobs, served by the worker's engine on `model`."""
    from modellab.decision_data import Scenario, render_prompt
    from worker.engine.loop import Engine
    from worker.model.loading import load_model

    scenarios = [json.loads(line) for line in (DEMO / "val_scenarios.jsonl").read_text().splitlines()[:3]]
    with session_scope() as session:
        session.query(Job).delete()
        jobs = [Job(id=uuid.uuid4(), adapter="laya", requested_adapter="laya",
                    input=render_prompt(Scenario.from_dict(row["scenario"])),
                    params={"output": "decision", "temperature": 0})
                for row in scenarios]
        session.add_all(jobs)
        order = [job.id for job in jobs]
    settings = _demo_settings(model)
    engine = Engine(load_model(settings), settings)
    try:
        assert engine.drain(60) == 3
    finally:
        engine.decoder.close()
    with session_scope() as session:
        stored = {job.id: job for job in session.scalars(select(Job))}
        return [(stored[i].decision["decision"], stored[i].decision["confidence"]) for i in order]


def test_the_worker_reports_each_decision_at_its_adapters_calibration(service_env, demo_copy: Path):
    """The same jobs on the same adapter, before and after it is calibrated: the same decisions, each confidence
    the probability raised to the exponent."""
    before = _laya_confidences(demo_copy)
    write_calibration(demo_copy / "laya", Calibration(exponent=0.5), {})
    after = _laya_confidences(demo_copy)
    assert [d for d, _ in after] == [d for d, _ in before]
    for (_, raw), (_, calibrated) in zip(before, after, strict=True):
        assert calibrated == pytest.approx(raw ** 0.5, abs=2e-4)  # both rounded to 4 places
    assert any(calibrated > raw for (_, raw), (_, calibrated) in zip(before, after, strict=True))


def test_jobs_claimed_before_a_new_calibration_are_settled_with_their_versions(service_env, demo_copy: Path,
                                                                             monkeypatch: pytest.MonkeyPatch):
    """A new version written into the adapter's own directory brings its own calibration (a reload in place):
    the rows claimed before it are settled with the calibration of the weights that answered them, not with the
    file the directory holds by the time each is stored."""
    from worker.engine import writer

    before = _laya_confidences(demo_copy)
    settle, rewritten = writer.settle_job, []

    def settle_after_a_new_calibration(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        if not rewritten:  # between the claim and the first result stored
            rewritten.append(write_calibration(demo_copy / "laya", Calibration(exponent=0.5), {}))
        return settle(*args, **kwargs)

    monkeypatch.setattr(writer, "settle_job", settle_after_a_new_calibration)
    assert _laya_confidences(demo_copy) == before and rewritten


def test_a_worker_refuses_an_adapter_whose_calibration_is_broken(demo_copy: Path):
    from worker.model.loading import load_model

    (demo_copy / "laya" / CALIBRATION_FILE).write_text('{"exponent": -1}')
    write_manifest(demo_copy / "laya")
    loaded = load_model(_demo_settings(demo_copy))
    assert loaded.adapters == {"kev"}
    assert "broken calibration" in loaded.refusal("laya") and CALIBRATION_FILE in loaded.refusal("laya")


def _calibrate(model: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(model.parent), "KEVLAYA_MODEL__DEVICE": "cpu",
           "KEVLAYA_MODEL__BASE": str(model / "base"), "KEVLAYA_KEV__PATH": str(model / "kev"),
           "KEVLAYA_LAYA__PATH": str(model / "laya")}
    return subprocess.run([sys.executable, "-m", "cli", "models", "calibrate", "--scenarios",
                           str(model / "val_scenarios.jsonl"), *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)


def test_calibrate_fits_laya_on_validation_answers_and_writes_it_beside_the_adapter(demo_copy: Path):
    """The fit lowers the calibration error and the log-loss on the answers it was fitted on, keeps every ranking
    (a positive slope), and is written with how it was made."""
    result = _calibrate(demo_copy, "--adapters", "laya", "--limit", "200", "--batch-size", "50")
    assert result.returncode == 0, result.stderr[-3000:]
    written = json.loads((demo_copy / "laya" / CALIBRATION_FILE).read_text())
    assert 0 < written["exponent"] <= 20 and 0 <= written["linear"] <= 50 and -50 <= written["intercept"] <= 50
    assert written["answers"] == 200 and written["ece_after"] < written["ece_before"]
    assert written["log_loss_after"] < written["log_loss_before"]
    assert written["command"].startswith("kevlaya models calibrate")
    fitted = Calibration(exponent=written["exponent"], linear=written["linear"], intercept=written["intercept"])
    assert f"laya: confidence {fitted.describe()} over 200 answers" in result.stdout
    assert not (demo_copy / "kev" / CALIBRATION_FILE).exists()
    assert verify_manifest(demo_copy / "laya") == [] and verify_manifest(demo_copy) == []


def test_calibrate_refuses_bad_arguments_in_one_line(demo_copy: Path):
    for args, message in ((("--adapters", "bob"), "--adapters takes"),
                          (("--scenarios", str(demo_copy / "missing.jsonl")), "no scenarios at")):
        result = _calibrate(demo_copy, *args)
        assert result.returncode != 0 and message in result.stderr and "Traceback" not in result.stderr
    assert not (demo_copy / "laya" / CALIBRATION_FILE).exists()
