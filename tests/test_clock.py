"""One clock for every process (shared/clock.py): a worker whose host clock is ten minutes off, beside a normal one,
claims no job whose lease is live, and every job's timestamps and timings come from the database's clock."""

from __future__ import annotations

import os
import signal
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
import time_machine
from sqlalchemy import select

from shared import clock
from shared.clock import db_now
from shared.db import session_scope
from shared.heartbeat import live_workers
from shared.models import ClaimGroup, Job, JobStatus
from tests.conftest import Notices, ServiceProcess, start_worker, submit, wait_finished, wait_until
from tests.test_faults import assert_every_job_ended_once, pool_child, worker_of

SKEW = timedelta(minutes=10)


@pytest.fixture
def notices(env):  # noqa: ANN001, ANN201
    collector = Notices(env["KEVLAYA_REDIS__URL"])
    yield collector
    collector.close()


def test_the_database_clock_ignores_this_process_clock(service_env):
    with session_scope() as session:
        true_now = db_now(session)
        with time_machine.travel(datetime.now(timezone.utc) + SKEW, tick=True):
            clock._readings.clear()  # read the database again, with this process's clock off
            moved = db_now(session)
            assert datetime.now(timezone.utc) - moved > SKEW - timedelta(seconds=5)
    assert abs(moved - true_now) < timedelta(seconds=5)


def test_times_handed_out_never_go_back_and_follow_the_database(service_env, monkeypatch):
    with session_scope() as session:
        monkeypatch.setattr(clock, "RESYNC_S", 0.0)  # read the database at every call
        readings = [db_now(session) for _ in range(200)]
    assert readings == sorted(readings)
    assert readings[-1] - readings[0] < timedelta(seconds=5)


def start_skewed_worker(start_process, env, api, offset: timedelta, log: Path) -> ServiceProcess:  # noqa: ANN001
    command = [os.sys.executable, str(Path(__file__).with_name("skewed_clock.py")), str(offset.total_seconds()),
               "worker"]
    process = ServiceProcess(command, env, log, stop_signal=signal.SIGKILL)
    start_process.started.append(process)
    wait_until(lambda: process.process.poll() is None and pool_child(process.process.pid), 60, interval=0.2,
               what="the skewed worker's pool child")
    return process


@pytest.mark.integration
@pytest.mark.parametrize("sign", [1, -1], ids=["ahead", "behind"])
def test_a_worker_ten_minutes_off_claims_no_live_lease_and_its_times_are_the_databases(
        env, api, start_process, notices, tmp_path, sign):
    """Ahead, its sweeper would see the other worker's leases as expired; behind, its own leases would be over as
    they are written: either way jobs would run twice. Both must hold leases at once, so each is tested."""
    env = {**env, "KEVLAYA_ENGINE__MAX_BATCH": "2"}
    with session_scope() as session:
        began = db_now(session)
    workers = [start_worker(start_process, env, api),
               start_skewed_worker(start_process, env, api, sign * SKEW, tmp_path / "skewed-worker.log")]
    names = []
    for worker in workers:
        wait_until(lambda: live_workers().get(worker_of(worker), {}).get("model_loaded"), 120, interval=0.5,
                   what=f"worker {worker.process.pid} to load its model")
        names.append(worker_of(worker))

    job_ids = [submit(api, "kev" if i % 2 else "laya", f"job {i}: weigh A against B.", max_new_tokens=120)
               for i in range(16)]

    def holders() -> set[str]:
        with session_scope() as session:
            return set(session.scalars(select(Job.lease_owner).where(
                Job.status == JobStatus.RUNNING, Job.lease_owner.is_not(None))).all())

    wait_until(lambda: holders() == set(names), 60, interval=0.02, what="both workers to hold leases at once")
    wait_finished(api, job_ids, timeout=300)
    rows = assert_every_job_ended_once(job_ids, notices)
    with session_scope() as session:
        ended = db_now(session)
        groups = {g.id: g for g in session.scalars(select(ClaimGroup)).all()}
    assert {g.worker for g in groups.values()} == set(names)

    mine = [row for row in rows if str(row.id) in set(job_ids)]
    for job in mine:
        assert job.attempts == 1, (job.id, "claimed again while its lease was live")
        assert began <= job.created_at <= job.started_at <= job.finished_at <= ended, job.id
        assert job.queue_ms == pytest.approx((job.started_at - job.created_at).total_seconds() * 1000, abs=1)
        assert job.total_ms == pytest.approx((job.finished_at - job.created_at).total_seconds() * 1000, abs=1)
        group = groups[job.batch_id]
        assert began <= group.started_at <= group.finished_at <= ended
    assert {uuid.UUID(j) for j in job_ids} == {job.id for job in mine}
