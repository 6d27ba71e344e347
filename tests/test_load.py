"""`kevlaya load` at a small bound: real API, Redis and worker processes; its drain report must say exactly once."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from modellab.bench.load import require_loopback, write_figures
from tests.conftest import free_port

pytestmark = pytest.mark.integration


def test_load_submits_then_drains_every_job_exactly_once(redis_server, tmp_path: Path) -> None:  # noqa: ANN001
    out = tmp_path / "load.json"
    command = [os.sys.executable, "-m", "cli", "load", "--warmup", "16", "--singles", "60", "--batches", "3",
               "--batch-size",
               "50", "--concurrency", "8", "--time-limit", "30", "--drain-timeout", "120",
               "--workdir", str(tmp_path / "work"), "--redis-url", redis_server.url, "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["warmup"]["accepted_jobs"] == 16  # apart from the figures, but drained and checked too
    assert result["single"]["accepted_jobs"] == 60 and result["batch"]["accepted_jobs"] == 150
    assert result["single"]["errors"] == {} and result["batch"]["errors"] == {}
    assert result["single"]["p99_ms"] >= result["single"]["p50_ms"] > 0 and result["single"]["submits_per_s"] > 0
    drain = result["drain"]
    assert drain["jobs"] == 226 and drain["pending"] == 0 and drain["exactly_once"] is True
    assert set(drain["problems"].values()) == {0}
    assert "exactly once: yes" in done.stdout  # the table, printed last
    # the API's own count of its commits during each phase, beside the latencies they explain
    writes = result["single"]["database_writes"]
    assert 1 <= writes["commits"] <= 60 and 0 <= writes["over_50ms"] <= writes["commits"]
    assert f"single: {writes['commits']} database commits" in done.stdout


def test_a_phase_counts_its_own_commits_and_the_slow_ones() -> None:
    """From two scrapes of the API's write-time histogram (cumulative buckets): only what happened between."""
    inf = float("inf")
    before = {0.01: 5.0, 0.05: 7.0, 0.25: 8.0, inf: 8.0}
    after = {0.01: 15.0, 0.05: 17.0, 0.25: 20.0, inf: 20.0}  # 12 more: 10 under 10 ms, 2 between 50 and 250 ms
    assert write_figures(before, after) == {"commits": 12, "over_50ms": 2, "slowest_at_most_s": 0.25}
    assert write_figures(after, {**after, inf: 21.0}) == {"commits": 1, "over_50ms": 1, "slowest_at_most_s": None}
    assert write_figures(after, after) == {"commits": 0, "over_50ms": 0, "slowest_at_most_s": None}


@pytest.mark.parametrize("url", ["http://10.0.0.5:8000", "http://example.com", "redis://192.168.1.2:6379/0"])
def test_load_refuses_anything_but_loopback(url: str) -> None:
    with pytest.raises(ValueError, match="loopback"):
        require_loopback(url)
    require_loopback("http://127.0.0.1:8000")
    require_loopback("http://localhost:8000")
    require_loopback("postgresql+psycopg://postgres@[::1]:5432/x")


@contextmanager
def floor_server(app: str) -> Iterator[str]:
    """The load floor (modellab/bench/load_floor.py) served by uvicorn; yields its URL."""
    import time

    import httpx

    port = free_port()
    server = subprocess.Popen([os.sys.executable, "-m", "uvicorn", f"modellab.bench.load_floor:{app}", "--port",
                               str(port), "--log-level", "warning"])
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1)
                break
            except httpx.TransportError:
                time.sleep(0.2)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.terminate()
        server.wait(10)


def run_load_command(*args: str, out: Path) -> dict:
    done = subprocess.run([os.sys.executable, "-m", "cli", "load", *args, "--no-drain", "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("app", ["app", "sync_app"])
def test_the_load_floor_answers_as_the_submit_routes_do(app: str, tmp_path: Path) -> None:
    """The floor (modellab/bench/load_floor.py) takes the load generator's requests and answers them as the API
    does, so its figures are the same measurement minus everything the service does."""
    with floor_server(app) as url:
        result = run_load_command("--url", url, "--singles", "40", "--batches", "2", "--batch-size", "20",
                                  out=tmp_path / "floor.json")
    assert (result["single"]["accepted_jobs"], result["batch"]["accepted_jobs"]) == (40, 40)
    assert result["single"]["errors"] == {} and result["batch"]["errors"] == {}


def test_at_a_rate_submits_go_out_on_schedule_and_count_their_wait(tmp_path: Path) -> None:
    """Open loop: 60 submits at 40/s take 1.5 s however fast the API answers, and one that waited for a free
    connection counts that wait: with one connection and all 60 due at once, the n-th waits for n answers."""
    with floor_server("app") as url:
        paced = run_load_command("--url", url, "--warmup", "0", "--singles", "60", "--rate", "40", "--batches", "0",
                                 out=tmp_path / "paced.json")["single"]
        # one warm-up submit first: on one connection a slow first answer (a fresh client's first request, a busy
        # machine) is in every later wait, and the waits' growth, which this checks, was a smaller part of them
        behind = run_load_command("--url", url, "--warmup", "1", "--singles", "60", "--rate", "100000",
                                  "--concurrency", "1", "--batches", "0", out=tmp_path / "behind.json")["single"]
        closed = run_load_command("--url", url, "--warmup", "0", "--singles", "60", "--concurrency", "1",
                                  "--batches", "0", out=tmp_path / "closed.json")["single"]
    assert paced["offered_rate_per_s"] == 40 and paced["accepted_jobs"] == 60
    assert 1.45 <= paced["seconds"] <= 2.5 and paced["p50_ms"] < 100
    assert closed["offered_rate_per_s"] is None
    # All 60 due at once on one connection: the n-th waits for n answers, so the median waited about half the run
    # and the last nearly all of it. Measured within the run: a busy machine changes how long an answer takes from
    # one run to the next (the closed loop's median, one answer, is about 1/60 of its run).
    assert behind["p50_ms"] > 0.25 * behind["seconds"] * 1000 and behind["max_ms"] > 0.75 * behind["seconds"] * 1000
    assert behind["max_ms"] > 1.2 * behind["p50_ms"]
    assert closed["p50_ms"] < 0.1 * closed["seconds"] * 1000
