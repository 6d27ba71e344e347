"""/v1/stats on SQLite and PostgreSQL: every figure checked against values computed here in Python from the
rows the test stored; the window parser; admin-only access."""

from __future__ import annotations

import math
import random
import uuid
from datetime import datetime, timedelta, timezone

import pytest
from sqlalchemy.orm import Session

from shared.db import get_engine, session_scope
from shared.keys import create_key
from shared.models import ClaimGroup, Job
from shared.stats import LATENCIES, Window, compute_stats, parse_window
from tests.conftest import AUTH


def percentile(values: list[float], p: float) -> float:
    """The documented definition, written independently of the SQL: linear between closest ranks."""
    ordered = sorted(values)
    h = p * (len(ordered) - 1)
    low = math.floor(h)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (h - low) * (ordered[high] - ordered[low])


def stored_rows(now: datetime) -> tuple[list[Job], list[ClaimGroup]]:
    rng = random.Random(7)
    jobs, batches = [], []
    for i in range(120):
        adapter = ("kev", "laya")[i % 2]
        status = rng.choices(["succeeded", "failed", "queued", "cancelled"], [0.7, 0.15, 0.1, 0.05])[0]
        done = status in ("succeeded", "failed")
        timings = {column: round(rng.lognormvariate(4, 1.2), 3) if done else None for column in LATENCIES.values()}
        jobs.append(Job(adapter=adapter, requested_adapter=adapter, status=status, input="x", params={},
                        error_code=rng.choice(["invalid_output", "out_of_memory", "numerical_error"])
                        if status == "failed" else None,
                        created_at=now - timedelta(seconds=rng.uniform(1, 500)),
                        completion_tokens=rng.randint(1, 50) if done else None, **timings))
    # outside the window: must not count
    jobs.append(Job(adapter="kev", requested_adapter="kev", status="succeeded", input="x", params={},
                    created_at=now - timedelta(hours=2), queue_ms=1e9, ttft_ms=1e9, decode_ms=1e9, total_ms=1e9))
    # auto: one answered by Laya, one escalated (its parent is not a run; its two stages are), one queued
    answered = Job(adapter="laya", requested_adapter="auto", status="succeeded", input="x", params={},
                   created_at=now - timedelta(seconds=30), total_ms=5.0)
    escalated = Job(id=uuid.uuid4(), adapter="laya", requested_adapter="auto", status="succeeded", input="x",
                    params={}, created_at=now - timedelta(seconds=20), total_ms=1e8)
    stage = Job(adapter="laya", requested_adapter="laya", status="succeeded", input="x", params={},
                parent_job_id=escalated.id, created_at=escalated.created_at, total_ms=7.0)
    kev = Job(adapter="kev", requested_adapter="kev", status="succeeded", input="x", params={},
              parent_job_id=escalated.id, created_at=now - timedelta(seconds=10), total_ms=9.0)
    waiting = Job(adapter="laya", requested_adapter="auto", status="queued", input="x", params={},
                  created_at=now - timedelta(seconds=5))
    jobs += [answered, escalated, stage, kev, waiting]
    # two workers' claim groups, plus one mixed batch an older version wrote
    for k, (adapters, size, tokens, worker) in enumerate([
            ("kev", 4, 40, "w:1"), ("kev", 2, 10, "w:1"), ("laya", 8, 64, "w:1"), ("kev", 6, 30, "w:1"),
            ("kev,laya", 3, 12, "w:1"), ("laya", 1, 5, "c:2"), ("kev", 1, 20, "c:2"), ("laya", 1, 5, "c:2")]):
        batches.append(ClaimGroup(adapters=adapters, size=size, worker=worker, tokens=tokens, prefill_ms=10.0,
                                  decode_ms=90.0, started_at=now - timedelta(seconds=100 - k * 10)))
    return jobs, batches


def expected_runs(jobs: list[Job], since: datetime) -> list[Job]:
    parents = {j.parent_job_id for j in jobs if j.parent_job_id}
    return [j for j in jobs if j.created_at >= since
            and not (j.requested_adapter == "auto" and j.parent_job_id is None and j.id in parents)]


def test_stats_match_values_computed_from_the_rows(client, database_url):
    now = datetime.now(timezone.utc)
    jobs, batches = stored_rows(now)
    with session_scope() as session:
        session.add_all(batches)
        session.flush()
        session.add_all([j for j in jobs if j.parent_job_id is None])
        session.flush()
        session.add_all([j for j in jobs if j.parent_job_id is not None])

    response = client.get("/v1/stats", params={"window": "15m"}, headers=AUTH)
    assert response.status_code == 200, response.text
    stats = response.json()
    since = datetime.fromisoformat(stats["window"]["since"])
    runs = expected_runs(jobs, since)
    assert stats["window"]["seconds"] == 900 and stats["window_name"] == "15m"
    for adapter in ("kev", "laya"):
        mine = [j for j in runs if j.adapter == adapter]
        got = stats["adapters"][adapter]
        for status in ("queued", "succeeded", "failed", "cancelled", "running"):
            assert got["jobs"][status] == sum(j.status == status for j in mine), (adapter, status)
        for code in ("invalid_output", "out_of_memory", "numerical_error"):
            assert got["failures"][code] == sum(j.error_code == code for j in mine)
        assert got["failures"]["timeout"] == 0
        for metric, column in LATENCIES.items():
            values = [getattr(j, column) for j in mine if getattr(j, column) is not None]
            figures = got["latency_ms"][metric]
            assert figures["count"] == len(values)
            for p in (0.5, 0.95, 0.99):
                assert figures[f"p{round(p * 100)}"] == pytest.approx(percentile(values, p), rel=1e-9), (metric, p)
    kev, laya = stats["adapters"]["kev"], stats["adapters"]["laya"]
    assert (kev["batches"], laya["batches"]) == (4, 3)
    assert kev["mean_batch_size"] == pytest.approx(13 / 4) and kev["mean_batch_occupancy"] == pytest.approx(13 / 64)
    assert kev["completion_tokens_per_s"] == pytest.approx(100 / 0.4)
    assert stats["mixed_batches"]["batches"] == 1
    assert stats["auto"] == {"jobs": 3, "decided": 2, "escalated": 1, "escalation_rate": 0.5}


@pytest.mark.parametrize("database_url", ["postgresql"], indirect=True)  # percentile_cont is PostgreSQL's
def test_window_function_percentiles_equal_percentile_cont(service_env, database_url):
    """The SQLite form run on PostgreSQL gives what PostgreSQL's own percentile_cont gives."""
    now = datetime.now(timezone.utc)
    jobs, batches = stored_rows(now)
    with session_scope() as session:
        session.add_all([j for j in jobs if j.parent_job_id is None])
        session.flush()
        session.add_all([j for j in jobs if j.parent_job_id is not None])
    with Session(get_engine()) as session:
        window = Window.last(timedelta(minutes=15))
        native = compute_stats(session, window, 16)["adapters"]
        portable = compute_stats(session, window, 16, portable=True)["adapters"]
    for adapter in ("kev", "laya"):
        for metric in LATENCIES:
            for p in ("p50", "p95", "p99"):
                assert portable[adapter]["latency_ms"][metric][p] == pytest.approx(
                    native[adapter]["latency_ms"][metric][p], rel=1e-9)


def test_stats_need_an_admin_key_and_a_valid_window(client):
    with session_scope() as session:
        _, plain = create_key(session, "reader")
    assert client.get("/v1/stats").status_code == 401
    forbidden = client.get("/v1/stats", headers={"Authorization": f"Bearer {plain}"})
    assert forbidden.status_code == 403 and forbidden.json()["error"]["code"] == "forbidden"
    assert client.get("/v1/stats/live", headers={"Authorization": f"Bearer {plain}"}).status_code == 403
    for bad in ("15", "15x", "m", "-5m", "0s", "1.5h", "400d"):
        response = client.get("/v1/stats", params={"window": bad}, headers=AUTH)
        assert response.status_code == 422, bad
        assert response.json()["error"]["message"].startswith("window:"), bad
    empty = client.get("/v1/stats", params={"window": "30s"}, headers=AUTH).json()
    assert empty["adapters"]["kev"]["jobs"]["succeeded"] == 0 and empty["auto"]["escalation_rate"] is None
    live = client.get("/v1/stats/live", headers=AUTH).json()
    assert live["queue_depth"] == {"kev": 0, "laya": 0} and live["batches"] == []


@pytest.mark.parametrize(("text", "seconds"), [("30s", 30), ("15m", 900), ("2h", 7200), ("1d", 86400)])
def test_parse_window(text, seconds):
    assert parse_window(text).total_seconds() == seconds


def test_a_batch_whose_worker_stopped_is_shown_as_abandoned_where_it_stored_its_last_job(client, database_url):
    """A batch closes with its last job, so one cut by a killed worker stays open for good; the timeline must not
    draw it as running until it scrolls away. Open with a job still running: running. Open with nothing running
    in it (one job stored before the kill, one given back to the queue): abandoned, ending at the stored one."""
    now = datetime.now(timezone.utc)
    closed, running, cut = (ClaimGroup(id=uuid.uuid4(), adapters="kev", size=2, worker=f"w:{i}",
                                       started_at=now - timedelta(seconds=60 - i)) for i in range(3))
    closed.finished_at = now - timedelta(seconds=50)
    stored_at = now - timedelta(seconds=40)

    def job(group: ClaimGroup, status: str, finished_at: datetime | None = None) -> Job:
        return Job(adapter="kev", requested_adapter="kev", status=status, input="x", params={}, batch_id=group.id,
                   created_at=now - timedelta(seconds=70), finished_at=finished_at)

    with session_scope() as session:
        session.add_all([closed, running, cut])
        session.flush()
        session.add_all([job(closed, "succeeded", closed.finished_at), job(running, "running"),
                         job(running, "succeeded", stored_at), job(cut, "succeeded", stored_at), job(cut, "queued")])

    batches = {b["worker"]: b for b in client.get("/v1/stats/live", headers=AUTH).json()["batches"]}
    assert [batches[w]["abandoned"] for w in ("w:0", "w:1", "w:2")] == [False, False, True]
    assert batches["w:2"]["finished_at"] is None
    assert datetime.fromisoformat(batches["w:2"]["last_stored_at"]) == stored_at
