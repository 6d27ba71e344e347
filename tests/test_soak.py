"""`kevlaya soak` for a quarter of a minute: real Redis, API and worker processes on the demo model; every job must
end exactly once, each process of the API and the worker must be sampled, and the figures and the plot written."""

from __future__ import annotations

import json
import os
import subprocess
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest

from modellab.bench.load import drain_problems
from modellab.bench.soak import growth_figures

pytestmark = pytest.mark.integration

PROCESSES = {"api", "api/api.jobs.writer_process", "worker", "worker/child"}


def test_a_short_soak_runs_every_job_once_and_samples_the_api_and_the_worker(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    command = [os.sys.executable, "-m", "cli", "soak", "--minutes", "0.25", "--jobs", "200", "--sample-every", "1",
               "--warmup-minutes", "0.05", "--workdir", str(tmp_path / "work"), "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["command"].startswith("kevlaya soak --minutes 0.25") and result["database"] == "SQLite"

    jobs = result["jobs"]
    assert jobs["submitted"] == jobs["accepted"] == jobs["succeeded"] > 0 and jobs["failed"] == 0
    assert jobs["submit_errors"] == {} and jobs["batch_requests"] >= 1  # single and batch submits
    assert result["exactly_once"] is True and set(result["drain"]["problems"].values()) == {0}
    assert result["drain"]["stage_rows"] > 0  # `auto` jobs escalated, and their stages were counted right

    samples, warmup_s = result["samples"], result["config"]["warmup_s"]
    assert all(PROCESSES <= set(s["rss_mib"]) for s in samples)
    assert all({"queued", "running", "succeeded", "submitted"} <= set(s) for s in samples)
    assert samples[-1]["queued"] == samples[-1]["running"] == 0 and samples[-1]["submitted"] == jobs["accepted"]
    assert min(s["t_s"] for s in samples if s["t_s"] >= warmup_s) - warmup_s < 1.0  # one sample ends the warm-up
    assert set(result["memory"]) >= PROCESSES
    for label in PROCESSES:
        memory = result["memory"][label]
        assert memory["samples_after_warmup"] >= 2 and memory["rss_warmup_end_mib"] > 0
        assert memory["growth_pct"] <= memory["max_growth_pct"] and isinstance(memory["slope_mib_per_hour"], float)
        assert memory["median_of"] >= 1 and isinstance(memory["growth_median_pct"], float)
        assert memory["restarted_after_warmup"] is False and memory["cpu_share_after_warmup"] >= 0
    assert result["memory"]["worker/child"]["cpu_share_after_warmup"] > 0  # the child that holds the model ran
    assert isinstance(result["targets"]["memory_flat"], bool)
    assert isinstance(result["backlog"]["kept_up"], bool) and result["backlog"]["queued_max"] >= 0

    plot = Path(result["plot"])
    assert plot == out.with_suffix(".png") and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = done.stdout.strip().splitlines()
    assert table[0].startswith("soak on SQLite") and table[-1].startswith("memory flat")
    assert table[-1].endswith("yes" if result["targets"]["memory_flat"] else "NO")
    assert any(line.startswith("exactly once: yes") for line in table)


def test_growth_is_measured_from_the_end_of_the_warm_up() -> None:
    """A warm-up spike is left out; growth is the end against the warm-up's end, the slope fits every point after."""
    rss = [100, 180, 100, 101, 102, 103, 104, 110]  # one sample each minute; warm-up: the first two minutes
    samples = [{"t_s": 60.0 * i, "rss_mib": {"api": v}, "pids": {"api": 7}, "cpu_s": {"api": 3.0 * i}}
               for i, v in enumerate(rss)]
    figures = growth_figures(samples, "api", warmup_s=120)
    assert figures["samples_after_warmup"] == 6 and figures["rss_warmup_end_mib"] == 100
    assert figures["growth_pct"] == figures["max_growth_pct"] == 10.0
    assert 100 < figures["slope_mib_per_hour"] < 200 and figures["cpu_share_after_warmup"] == 0.05
    # the medians of the first and the last three samples: 101 and 104, so the last sample alone does not decide
    assert (figures["median_of"], figures["growth_median_pct"]) == (3, 2.97)
    assert growth_figures(samples[:3], "api", warmup_s=120)["samples_after_warmup"] == 1  # too few: no figures
    assert "growth_pct" not in growth_figures(samples[:3], "api", warmup_s=120)


def test_an_escalated_auto_job_is_one_job_and_its_kev_stage_one_run() -> None:
    group, kev_group = "g1", "g2"
    batches = {group: SimpleNamespace(size=2, finished_at=1), kev_group: SimpleNamespace(size=1, finished_at=1)}

    def row(id_: str, adapter: str, batch: str, parent: str | None = None) -> SimpleNamespace:
        return SimpleNamespace(id=id_, status="succeeded", attempts=1, batch_id=batch, parent_job_id=parent,
                               adapter=adapter)

    rows = [row("plain", "kev", group), row("auto", "laya", group), row("laya-stage", "laya", group, "auto"),
            row("kev-stage", "kev", kev_group, "auto")]
    once = Counter({"plain": 1, "auto": 1})
    checked = drain_problems(rows, batches, ["plain", "auto"], once)
    assert checked["exactly_once"] is True and checked["stage_rows"] == 2
    twice = drain_problems([*rows, row("kev-again", "kev", kev_group, "auto")], batches, ["plain", "auto"], once)
    assert twice["exactly_once"] is False
    assert twice["problems"]["stage_more_than_once"] == 1 and twice["problems"]["runs_minus_jobs"] == -1
    # A Batch API file's line, run in a group of its own, is a run but no submit: neither stored-not-accepted nor
    # a run unaccounted for (a chaos soak sends both).
    batches["g3"] = SimpleNamespace(size=1, finished_at=1)
    line = SimpleNamespace(**vars(row("line-1", "laya", "g3")), file_batch_id="file-batch")
    with_line = drain_problems([*rows, line], batches, ["plain", "auto"], once)
    assert with_line["exactly_once"] is True and with_line["stage_rows"] == 2, with_line["problems"]


def test_a_soak_with_no_room_for_its_warm_up_and_two_samples_is_refused(tmp_path: Path) -> None:
    done = subprocess.run([os.sys.executable, "-m", "cli", "soak", "--minutes", "0.1", "--sample-every", "10",
                           "--workdir", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "two samples after it" in " ".join(done.stderr.replace("│", " ").split())


def test_the_sampler_skips_a_sample_while_the_database_is_away_and_goes_on() -> None:
    """A chaos soak takes the database away: the sample of that moment is skipped, not the rest of the run's
    (the sampler stopped at the first outage, and the memory figures of a PostgreSQL chaos run had one sample)."""
    from sqlalchemy.exc import OperationalError

    from modellab.bench.soak import Sampler

    class Counts:
        calls = 0

        def read(self) -> dict[str, int]:
            Counts.calls += 1
            if Counts.calls == 2:
                raise OperationalError("SELECT", {}, Exception("terminating connection (injected by the test)"))
            return {"queued": 0, "running": 0, "succeeded": Counts.calls, "failed": 0}

    announcements = SimpleNamespace(collect=lambda: None)
    sampler = Sampler({"api": os.getpid()}, Counts(), lambda: 0, announcements, every_s=0.05, warmup_s=0).start()
    import time

    deadline = time.monotonic() + 10
    while len(sampler.samples) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    sampler.halt()
    assert sampler.error is None and sampler.missed == 1 and len(sampler.samples) >= 3
