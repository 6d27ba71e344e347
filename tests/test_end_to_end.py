"""The whole path for real: HTTP API process → Redis → Celery worker process (transformers + peft on a
tiny model) → SQL, on SQLite and on PostgreSQL."""

from __future__ import annotations

import signal

import pytest
from sqlalchemy import func, select

from shared.db import session_scope
from shared.models import ClaimGroup, Job
from tests.conftest import TEXT, start_worker, submit, wait_finished, wait_until

pytestmark = pytest.mark.integration

def test_forty_alternating_jobs_all_succeed_each_claim_group_on_one_adapter(env, api, start_process):
    job_ids = [submit(api, "kev" if i % 2 == 0 else "laya", f"Option A costs {i}, option B costs {40 - i}. Pick.",
                      max_new_tokens=8)
               for i in range(40)]
    start_worker(start_process, env, api)  # every job was queued before the worker existed
    jobs = wait_finished(api, job_ids)

    assert [j["status"] for j in jobs] == ["succeeded"] * 40, [j["error"] for j in jobs]
    for job in jobs:
        assert isinstance(job["result"]["text"], str)
        assert job["tokens"]["prompt"] > 0 and 1 <= job["tokens"]["completion"] <= 8
        timings = job["timings"]
        assert all(timings[k] is not None and timings[k] >= 0 for k in ("queue_ms", "prefill_ms", "decode_ms", "total_ms"))
        assert timings["total_ms"] >= timings["queue_ms"]
        assert job["attempts"] == 1 and job["batch_id"] is not None
    with session_scope() as session:
        assert session.scalar(select(func.sum(ClaimGroup.size)).where(ClaimGroup.finished_at.is_not(None))) == 40
        groups = session.scalars(select(ClaimGroup)).all()
    assert {g.adapters for g in groups} == {"kev", "laya"}
    by_group = {}
    for job in jobs:  # jobs claimed together are of one adapter: a claim never mixes roles
        by_group.setdefault(job["batch_id"], set()).add(job["adapter"])
    assert all(len(adapters) == 1 for adapters in by_group.values())
    assert len(by_group) < 40  # consecutive queued jobs of an adapter are claimed together


def test_a_worker_killed_mid_batch_loses_nothing_and_runs_nothing_twice(env, api, start_process):
    worker = start_worker(start_process, env, api)
    response = api.post("/v1/jobs/batch", json={"jobs": [
        {"adapter": "kev", "input": f"Long analysis number {i}.", "params": {**TEXT, "max_new_tokens": 400}}
        for i in range(6)]})
    job_ids = [j["id"] for j in response.json()["jobs"]]

    def running_jobs():
        with session_scope() as session:
            return session.scalars(select(Job.id).where(Job.status == "running")).all()

    wait_until(running_jobs, 60, interval=0.02, what="a batch to start")
    worker.kill(signal.SIGKILL)
    with session_scope() as session:
        abandoned = session.execute(select(Job.id, Job.batch_id).where(Job.status == "running")).all()
    assert abandoned  # the kill really happened mid-batch
    killed = {str(job_id) for job_id, _ in abandoned}
    abandoned_batch = abandoned[0][1]

    start_worker(start_process, env, api)
    jobs = wait_finished(api, job_ids)
    assert [j["status"] for j in jobs] == ["succeeded"] * 6, [j["error"] for j in jobs]
    for job in jobs:
        assert job["attempts"] == (2 if job["id"] in killed else 1)
        assert job["batch_id"] != str(abandoned_batch)  # the result comes from the re-run, once
    with session_scope() as session:
        assert session.get(ClaimGroup, abandoned_batch).finished_at is None


def test_redis_down_gives_503_and_no_orphan_then_queued_jobs_run_when_it_returns(env, api, start_process, redis_server):
    queued = [submit(api, "laya", f"Decide {i}", max_new_tokens=4) for i in range(3)]
    redis_server.stop()  # no persistence: the wake-up messages of the queued jobs are lost with it
    try:
        response = api.post("/v1/jobs", json={"adapter": "kev", "input": "will not be stored"})
        assert response.status_code == 503
        assert response.json()["error"]["code"] == "queue_unavailable"
        with session_scope() as session:
            assert session.scalar(select(func.count()).select_from(Job)) == 3
    finally:
        redis_server.start()

    start_worker(start_process, env, api)  # the sweeper re-publishes the lost wake-ups
    assert [j["status"] for j in wait_finished(api, queued)] == ["succeeded"] * 3


def test_cancelled_before_it_runs_never_runs_and_a_finished_job_is_deleted(env, api, start_process):
    cancelled = submit(api, "kev", "cancel me")
    assert api.delete(f"/v1/jobs/{cancelled}").json()["status"] == "cancelled"
    start_worker(start_process, env, api)
    [done] = wait_finished(api, [submit(api, "kev", "run me", max_new_tokens=4)])
    assert done["status"] == "succeeded"

    deleted = api.delete(f"/v1/jobs/{done['id']}")
    assert deleted.status_code == 200 and deleted.json() == {"id": done["id"], "deleted": True}
    assert api.get(f"/v1/jobs/{done['id']}").status_code == 404
    job = api.get(f"/v1/jobs/{cancelled}").json()
    assert job["status"] == "cancelled" and job["attempts"] == 0 and job["batch_id"] is None and job["result"] is None


def test_wait_returns_as_soon_as_the_job_finishes(env, api, start_process):
    start_worker(start_process, env, api)
    job_id = submit(api, "laya", "quick one", max_new_tokens=4)
    waited = api.get(f"/v1/jobs/{job_id}/wait", params={"timeout": 30})
    assert waited.json()["status"] == "succeeded"
