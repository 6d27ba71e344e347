"""`kevlaya eval` end to end on a tiny model: every mode runs through the real runtime and the report
is consistent with its own per-scenario answers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from modellab.decision_data import write_dataset
from modellab.evaluation import Answer, calibration, summarize


def test_eval_command_writes_a_consistent_report(tiny_model, tmp_path: Path):
    data = write_dataset(tmp_path / "data", n_train=4, n_val=2, n_test=6, seed=1)
    env = {**os.environ, "KEVLAYA_MODEL__BASE": str(tiny_model["base"]), "KEVLAYA_KEV__PATH": str(tiny_model["kev"]),
           "KEVLAYA_LAYA__PATH": str(tiny_model["laya"]), "KEVLAYA_MODEL__DEVICE": "cpu",
           "KEVLAYA_KEV__MAX_NEW_TOKENS": "12", "KEVLAYA_LAYA__MAX_NEW_TOKENS": "6"}
    out = tmp_path / "results"
    run = subprocess.run([sys.executable, "-m", "cli", "eval", "--scenarios", str(data["test_scenarios"]),
                          "--out", str(out), "--batch-size", "4", "--compare-precision"], env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "mode" in run.stdout and "auto" in run.stdout
    report = json.loads((out / "results.json").read_text())
    assert (out / "results.png").stat().st_size > 1000
    assert report["command"].startswith("kevlaya eval") and report["scenarios"] == 6
    for mode, summary in report["modes"].items():
        answers = report["answers"][mode]
        assert len(answers) == 6
        assert summary["accuracy"] == sum(a["correct"] for a in answers) / 6
        assert summary["mean_completion_tokens"] > 0 and summary["mean_latency_ms"] > 0
        if mode != "base":  # under the decision grammar: a decision, when there is one, is an option offered
            assert all(a["offered"] for a in answers if a["decision"] is not None)
            assert summary["offered_rate"] == summary["valid_json_rate"]
            assert sum(summary["failures"].values()) == sum(a["decision"] is None for a in answers)
    # random weights are never sure of a decision (even one their grammar completes), so the cascade escalates
    # everything and pays for both
    assert report["modes"]["auto"]["escalation_rate"] == 1.0
    # on the CPU the configured run is fp32; the comparison loads the same model with an NF4 base
    comparison = report["precision_comparison"]
    assert comparison["reference"] == "fp32" and set(comparison["agreement"]) == {"laya", "kev"}
    assert all(0 <= value <= 1 for value in comparison["agreement"].values())
    assert comparison["reference_modes"]["kev"] == report["modes"]["kev"]
    laya, kev, auto = (report["answers"][m] for m in ("laya", "kev", "auto"))
    for cascaded, first, second in zip(auto, laya, kev, strict=True):
        assert cascaded["latency_ms"] == pytest.approx(first["latency_ms"] + second["latency_ms"])


def test_summary_and_calibration_on_known_answers():
    answers = [Answer(id=str(i), label="A", decision="A" if i < 3 else "B", confidence=c, correct=i < 3,
                      latency_ms=float(10 * (i + 1)), completion_tokens=5)
               for i, c in enumerate([0.95, 0.9, 0.92, 0.15, 0.1])]
    report = summarize("laya", answers)
    assert report.accuracy == 0.6 and report.valid_json_rate == 1.0
    assert report.mean_latency_ms == 30.0 and report.p95_latency_ms == 50.0
    calib = calibration(answers)
    # the confident answers are right and the unsure ones wrong: well calibrated, small ECE
    assert calib["n"] == 5 and calib["ece"] < 0.15
    assert {tuple(b["bin"]) for b in calib["bins"]} == {(0.9, 1.0), (0.1, 0.2)}


@pytest.mark.parametrize("command", [("eval",), ("models", "calibrate", "--no-write")])
@pytest.mark.parametrize(("content", "named"), [
    ('{"id": "a", "scenario": {"options": []}}\nnot json\n', "bad.jsonl:1: not a scenario row"),
    ('\n{"id": "a"}\n', "bad.jsonl:2: not a scenario row"),
    ("\n\n", "bad.jsonl: no scenarios"),
])
def test_a_scenarios_file_that_is_not_one_is_refused_in_one_line(tmp_path: Path, command: tuple[str, ...],
                                                                 content: str, named: str):
    """Both commands read the scenarios before loading a model, and name the file and line of the first bad row."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text(content)
    out = ("--out", str(tmp_path / "out")) if command == ("eval",) else ()
    run = subprocess.run([sys.executable, "-m", "cli", *command, "--scenarios", str(bad), *out],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and named in run.stderr, run.stderr[-2000:]
    assert "Traceback" not in run.stderr and not (tmp_path / "out").exists()


def test_a_batch_size_that_runs_out_of_gpu_memory_is_refused_in_one_line(tiny_model, tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch):
    """Rows that do not fit the VRAM budget (as 200 of Kev's did on a 6 GB budget) name --batch-size and what to do,
    not a CUDA traceback, and write no report."""
    import torch
    from typer.testing import CliRunner

    from cli.main import app
    from modellab import evaluation
    from shared.settings import get_settings

    data = write_dataset(tmp_path / "data", n_train=4, n_val=2, n_test=2, seed=1)
    for name, value in {"KEVLAYA_MODEL__BASE": tiny_model["base"], "KEVLAYA_KEV__PATH": tiny_model["kev"],
                        "KEVLAYA_LAYA__PATH": tiny_model["laya"], "KEVLAYA_MODEL__DEVICE": "cpu"}.items():
        monkeypatch.setenv(name, str(value))
    get_settings.cache_clear()

    def out_of_memory(*args: object, **kwargs: object) -> None:
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 76.00 MiB.")

    monkeypatch.setattr(evaluation, "run_evaluation", out_of_memory)
    out = tmp_path / "results"
    result = CliRunner().invoke(app, ["eval", "--scenarios", str(data["test_scenarios"]), "--out", str(out),
                                      "--modes", "laya", "--batch-size", "200"])
    get_settings.cache_clear()
    assert result.exit_code == 2, result.output
    assert "error: --batch-size 200" in result.output and "smaller --batch-size" in result.output
    assert "Traceback" not in result.output and not out.exists()
