"""Fair share per key with real processes (API → Redis → worker → SQL, loopback), on SQLite and PostgreSQL: a key
with 2,048 queued jobs delays another key's single Laya job by one claim round at most (docs/architecture.md §3)."""

from __future__ import annotations

import statistics

import httpx
import pytest
from sqlalchemy import func, select

from shared.db import session_scope
from shared.keys import create_key
from shared.models import Job
from tests.conftest import TEXT, start_worker, wait_until

pytestmark = pytest.mark.integration

BACKLOG = 2048
PROMPT = "Option A costs 3, option B costs 5. Pick."


def key_client(api: httpx.Client, name: str) -> httpx.Client:
    with session_scope() as session:
        _, plain = create_key(session, name)
    return httpx.Client(base_url=api.base_url, headers={"Authorization": f"Bearer {plain}"}, timeout=60)


def one_job(client: httpx.Client) -> tuple[float, float]:
    """A single Laya job's wait for a slot and its time from creation to finish (its stored `queue_ms` and
    `total_ms`); inf when it had not finished after 20 s (it queued behind the backlog)."""
    submitted = client.post("/v1/jobs", json={"adapter": "laya", "input": PROMPT,
                                              "params": {**TEXT, "max_new_tokens": 8}})
    assert submitted.status_code == 202, submitted.text
    job = client.get(f"/v1/jobs/{submitted.json()['id']}/wait", params={"timeout": 20}).json()
    if job["status"] != "succeeded":
        return float("inf"), float("inf")
    return job["timings"]["queue_ms"], job["timings"]["total_ms"]


def p95(values: list[float]) -> float:
    return sorted(values)[max(0, round(0.95 * len(values)) - 1)]


def test_a_keys_2048_queued_jobs_delay_another_keys_laya_job_by_one_claim_round_at_most(env, api, start_process):
    start_worker(start_process, env, api)
    heavy, light = key_client(api, "heavy"), key_client(api, "light")
    try:
        for _ in range(3):  # warm up: the first jobs load and compile what later ones reuse
            one_job(light)
        idle = [one_job(light)[1] for _ in range(10)]

        for start in range(0, BACKLOG, 256):
            response = heavy.post("/v1/jobs/batch", json={"jobs": [
                {"adapter": "laya", "input": f"{PROMPT} Case {start + i}.", "params": {**TEXT, "max_new_tokens": 64}}
                for i in range(256)]})
            assert response.status_code == 202, response.text

        def running() -> int:
            with session_scope() as session:
                return session.scalar(select(func.count()).select_from(Job).where(Job.status == "running"))

        wait_until(running, 60, interval=0.05, what="the backlog to take the slots")
        loaded = []
        for _ in range(20):
            loaded.append(one_job(light))
            if loaded[-1][0] == float("inf"):
                break
        with session_scope() as session:
            still_queued = session.scalar(select(func.count()).select_from(Job).where(Job.status == "queued"))
    finally:
        heavy.close()
        light.close()

    assert still_queued > 0, "the backlog ran out before the last measurement: the test measured nothing"
    # The backlog delays the job by one claim round at most: its wait for a slot (the next look at the queue, inside
    # a step of the backlog's rows) stays within twice an idle job's whole time; before keys took turns it waited
    # for the whole backlog. Its decode under load also pays for the rows beside it and the worker's other work
    # (docs/architecture.md §3), which a busy 2-core machine makes noisy, so the total is only checked to end.
    idle_ms = statistics.median(idle)
    waits, totals = [w for w, _ in loaded], [t for _, t in loaded]
    seen = f"idle {sorted(round(t) for t in idle)}, loaded waits {sorted(waits)}, totals {sorted(totals)}"
    assert p95(waits) <= 2 * idle_ms, seen
    assert max(totals) < float("inf"), seen
