"""`kevlaya soak --chaos` for three minutes: real Redis, API and worker processes on the demo model while every kind
of fault arrives (worker and pool child SIGKILL, Redis restarted with and without its data, the database held, the
API SIGKILLed, two at once); no job may be lost or doubled, and no stream client may see a delta twice or miss one.
"""

from __future__ import annotations

import json
import os
import subprocess
from datetime import datetime, timedelta, timezone
from pathlib import Path
from types import SimpleNamespace

import pytest

from modellab.bench.chaos import SINGLE_FAULTS, Fault, fault_figures


@pytest.mark.integration
def test_three_minutes_of_faults_lose_and_double_nothing(tmp_path: Path) -> None:
    out = tmp_path / "chaos.json"
    command = [os.sys.executable, "-m", "cli", "soak", "--chaos", "--minutes", "3", "--rate", "6",
               "--fault-every", "12", "18", "--sample-every", "2", "--warmup-minutes", "0.1", "--seed", "7",
               "--workdir", str(tmp_path / "work"), "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    chaos = result["chaos"]
    assert all(chaos["targets"].values()), chaos["targets"]

    faults = chaos["faults"]
    assert {f["kind"] for f in faults} == set(SINGLE_FAULTS)  # the deck deals every kind
    assert any("two at once" in f["detail"] for f in faults)
    assert all(f["error"] is None and f["end_s"] >= f["start_s"] for f in faults)
    [cut] = [f for f in faults if f["kind"] == "api_kill_mid_upload"][:1]
    assert cut["detail"].endswith("the cut upload left no file")

    jobs = result["jobs"]
    assert jobs["accepted"] == jobs["succeeded"] > 0 and jobs["failed"] == 0
    problems = result["drain"]["problems"]
    assert problems["accepted_not_stored"] == problems["stored_not_accepted"] == problems["accepted_twice"] == 0
    assert chaos["by_fault"]["run_more_than_once_outside_a_fault"] == 0
    streams = chaos["streams"]
    assert streams["followed"] > 0 and streams["matched"] + streams["resynced"] >= streams["followed"]
    files = chaos["batch_files"]
    assert files["files"] >= 3 and files["lines_once"] == files["lines"] == files["files"] * 20
    assert result["plot"] and Path(result["plot"]).read_bytes()[:4] == b"\x89PNG"
    assert done.stdout.strip().splitlines()[-1].startswith("chaos: nothing lost or twice yes")


def test_a_job_run_twice_counts_against_the_service_unless_a_fault_took_its_worker() -> None:
    t0 = datetime(2026, 12, 7, 12, 0, tzinfo=timezone.utc)

    def at(s: float) -> datetime:
        return t0 + timedelta(seconds=s)

    faults = [Fault("worker_kill", 10.0, at(10).isoformat(), end_s=12.0),
              Fault("redis_restart", 40.0, at(40).isoformat(), end_s=43.0)]
    rows = [
        SimpleNamespace(attempts=2, created_at=at(8), started_at=at(14), finished_at=at(20)),  # killed mid-run
        SimpleNamespace(attempts=2, created_at=at(38), started_at=at(39), finished_at=at(45)),  # Redis: no rerun
        SimpleNamespace(attempts=2, created_at=at(60), started_at=at(61), finished_at=at(62)),  # no fault at all
        SimpleNamespace(attempts=1, created_at=at(9), started_at=at(9.5), finished_at=at(30)),  # in flight
    ]
    figures = fault_figures(faults, rows, lease_s=60, sweep_s=10)
    assert figures["run_more_than_once"] == 3 and figures["run_more_than_once_outside_a_fault"] == 2
    kill = figures["faults"][0]
    assert kill["in_flight"] == 1 and kill["in_flight_finished_within_s"] == 20.0
    assert kill["first_finish_after_end_s"] == 8.0
