"""The job state machine on SQLite and PostgreSQL: every path to a stage's final state settles its `auto`
parent, the sweeper repairs what no path will touch again, and each final state is announced once."""

from __future__ import annotations

import threading
import uuid
from collections import Counter
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from sqlalchemy import select, update

from shared import lifecycle
from shared.db import session_scope
from shared.lifecycle import IllegalTransition, JobOutcome
from shared.models import Job, JobStatus
from shared.settings import Settings
from tests.conftest import Notices
from tests.test_claims import add_jobs
from worker.ledger.cascade import escalate
from worker.ledger.claims import claim_group


@pytest.fixture
def notices(service_env):
    collector = Notices(service_env["KEVLAYA_REDIS__URL"])
    yield collector
    collector.close()


def escalated_auto_job() -> tuple[uuid.UUID, uuid.UUID]:
    """An `auto` job whose Laya stage was unsure: the parent waits, its Kev stage is queued."""
    with session_scope() as session:
        parent = Job(adapter="laya", requested_adapter="auto", input="Options: A cost 1; B cost 2.", params={})
        session.add(parent)
    with session_scope() as session:
        batch, [claimed] = claim_group(session, "laya", 100, "w1", lease_s=30)
        laya = JobOutcome(status=JobStatus.SUCCEEDED, result_text="not sure", prompt_tokens=5, completion_tokens=3,
                          prefill_ms=1.0, decode_ms=2.0)
        kev = escalate(session, claimed, batch.id, laya)
    return parent.id, kev.id


def row(job_id: uuid.UUID) -> Job:
    with session_scope() as session:
        return session.get(Job, job_id)


def expire_all_leases() -> None:
    with session_scope() as session:
        session.execute(update(Job).where(Job.lease_expires_at.is_not(None))
                        .values(lease_expires_at=datetime.now(timezone.utc) - timedelta(seconds=1)))


def test_a_kev_stage_that_fails_settles_its_parent(service_env, tiny_model: dict[str, Path], notices):
    from worker.engine.loop import Engine
    from worker.model.loading import load_model

    parent_id, kev_id = escalated_auto_job()
    with session_scope() as session:  # stored params the worker cannot use fail the Kev stage
        session.execute(update(Job).where(Job.id == kev_id).values(params={"temperature": "warm"}))
    settings = Settings(_env_file=None, model={"base": str(tiny_model["base"]), "device": "cpu"},
                        kev={"path": str(tiny_model["kev"])}, laya={"path": str(tiny_model["laya"])})
    engine = Engine(load_model(settings), settings)
    try:
        assert engine.drain(30) == 1
    finally:
        engine.decoder.close()

    kev, parent = row(kev_id), row(parent_id)
    assert kev.status == "failed" and kev.error_code == "invalid_input" and "TypeError" in kev.error_message
    assert parent.status == "failed" and parent.error_code == kev.error_code
    assert parent.error_message == kev.error_message and parent.finished_at is not None
    assert parent.completion_tokens == 3  # the Laya stage's tokens still count
    assert notices.collect() == Counter({str(kev_id): 1, str(parent_id): 1})


def test_a_kev_stage_that_exhausts_its_attempts_settles_its_parent(service_env, notices):
    parent_id, kev_id = escalated_auto_job()
    for _ in range(3):
        with session_scope() as session:
            claim_group(session, "kev", 100, "w-dies", lease_s=30)
        expire_all_leases()
        with session_scope() as session:
            lifecycle.expire_leases(session, max_attempts=3)

    kev, parent = row(kev_id), row(parent_id)
    assert kev.status == "failed" and kev.attempts == 3 and "stopped 3 times" in kev.error_message
    assert parent.status == "failed" and parent.error_code == "internal" and parent.lease_owner is None
    assert notices.collect() == Counter({str(kev_id): 1, str(parent_id): 1})


def test_the_sweeper_settles_a_parent_left_waiting_and_requeues_a_running_job_without_a_lease(service_env,
                                                                                             notices):
    from worker.tasks import sweep

    parent_id, kev_id = escalated_auto_job()
    [stranded] = add_jobs(["kev"])
    with session_scope() as session:
        # Rows as a crash or older code could leave them: a stage finished behind the state machine's back,
        # and a running job that holds no lease and waits on nothing.
        session.execute(update(Job).where(Job.id == kev_id).values(
            status="succeeded", result_text="Kev's answer", finished_at=datetime.now(timezone.utc),
            prompt_tokens=7, completion_tokens=11))
        session.execute(update(Job).where(Job.id == stranded).values(status="running", attempts=1))
    waiting_parent, _ = escalated_auto_job()  # a parent waiting on an unfinished stage is left alone

    sweep()

    parent = row(parent_id)
    assert parent.status == "succeeded" and parent.result_text == "Kev's answer"
    assert parent.completion_tokens == 3 + 11 and parent.prompt_tokens == 5 + 7
    assert row(stranded).status == "queued" and row(stranded).lease_owner is None
    assert row(waiting_parent).status == "running"
    assert notices.collect() == Counter({str(parent_id): 1})
    sweep()  # nothing left to repair: no second notice, nothing changes
    assert notices.collect() == Counter({str(parent_id): 1})


def test_a_stranded_job_fails_once_it_has_used_its_attempts(service_env, notices):
    [job_id] = add_jobs(["laya"])
    with session_scope() as session:
        session.execute(update(Job).where(Job.id == job_id).values(status="running", attempts=3))
        repaired = lifecycle.repair(session, max_attempts=3)
    assert repaired.requeued == [] and row(job_id).status == "failed"
    assert notices.collect() == Counter({str(job_id): 1})


def test_only_allowed_transitions_happen(service_env, notices):
    [queued, running] = add_jobs(["kev", "laya"])
    with session_scope() as session:
        batch, [job] = claim_group(session, "laya", 100, "w1", lease_s=30)
    with session_scope() as session:
        assert not lifecycle.cancel(session, running)  # running: not cancellable
        assert lifecycle.cancel(session, queued)
        assert not lifecycle.cancel(session, queued)  # once only
        with pytest.raises(IllegalTransition):
            lifecycle.finish(session, job, batch.id, JobOutcome(status="cancelled"))
    with session_scope() as session:
        assert lifecycle.finish(session, job, batch.id, JobOutcome(status="succeeded", result_text="ok"))
        assert not lifecycle.finish(session, job, batch.id, JobOutcome(status="failed"))
    assert {j: row(j).status for j in (queued, running)} == {queued: "cancelled", running: "succeeded"}
    assert notices.collect() == Counter({str(queued): 1, str(running): 1})


def test_times_stamped_by_two_processes_never_give_a_negative_duration(service_env, notices):
    """The API stamps a job's creation and the worker its start and end, each on its own carried reading of the
    database's clock; the readings can differ by a resync's tolerance, so creation can lie just after the start.
    Every duration the worker writes is then 0, never negative (a probe's job_total of -99 ms was seen)."""
    ahead = datetime.now(timezone.utc) + timedelta(milliseconds=400)
    with session_scope() as session:
        parent = Job(adapter="laya", requested_adapter="auto", input="x", params={}, created_at=ahead)
        session.add(parent)
    plain = parent.id
    with session_scope() as session:
        batch, [claimed] = claim_group(session, "laya", 100, "w1", lease_s=30)
        kev = escalate(session, claimed, batch.id, JobOutcome(status="succeeded", result_text="unsure"))
    with session_scope() as session:
        stage = session.scalar(select(Job).where(Job.parent_job_id == plain, Job.adapter == "laya"))
        assert stage.queue_ms >= 0 and stage.total_ms >= 0
        batch, [kev_job] = claim_group(session, "kev", 100, "w1", lease_s=30)
    with session_scope() as session:
        assert lifecycle.finish(session, kev_job, batch.id, JobOutcome(status="succeeded", result_text="A",
                                                                      first_token_ms=5.0))
    for job in (row(kev.id), row(plain)):
        assert job.status == "succeeded", job.status
        assert job.queue_ms is None or job.queue_ms >= 0
        assert job.total_ms >= 0 and (job.ttft_ms is None or job.ttft_ms >= 0), (job.total_ms, job.ttft_ms)


def test_a_jobs_times_run_in_order_though_another_process_stamped_its_creation_later(service_env, notices):
    """The API's carried reading of the database's clock can lie a few ms ahead of the worker's: the start, the
    end, a cancellation and a sweep's failure are still never stamped before the time they follow."""
    ahead = datetime.now(timezone.utc) + timedelta(milliseconds=400)
    with session_scope() as session:
        session.add_all(Job(adapter="laya", requested_adapter="laya", input=f"job {i}", params={}, created_at=ahead)
                        for i in range(2))
        session.add(Job(adapter="kev", requested_adapter="kev", input="to cancel", params={}, created_at=ahead))
    with session_scope() as session:
        batch, claimed = claim_group(session, "laya", 100, "w1", lease_s=30)
        cancelled = session.scalar(select(Job.id).where(Job.adapter == "kev"))
        assert lifecycle.cancel(session, cancelled)
    with session_scope() as session:
        session.execute(update(Job).where(Job.id == claimed[1].id)
                        .values(started_at=ahead + timedelta(milliseconds=400), attempts=9))
    with session_scope() as session:
        assert lifecycle.finish(session, claimed[0], batch.id, JobOutcome(status="succeeded", result_text="A"))
    expire_all_leases()
    with session_scope() as session:
        lifecycle.expire_leases(session, max_attempts=3)
    finished, failed, cancelled = row(claimed[0].id), row(claimed[1].id), row(cancelled)
    assert finished.created_at <= finished.started_at <= finished.finished_at, finished
    assert failed.status == "failed" and failed.started_at <= failed.finished_at
    assert cancelled.created_at <= cancelled.finished_at


def test_a_rolled_back_finish_announces_nothing(service_env, notices):
    add_jobs(["kev"])
    with session_scope() as session:
        batch, [job] = claim_group(session, "kev", 100, "w1", lease_s=30)
    with pytest.raises(RuntimeError), session_scope() as session:
        lifecycle.finish(session, job, batch.id, JobOutcome(status="succeeded"))
        raise RuntimeError("the commit never happens")
    assert row(job.id).status == "running"
    assert notices.collect() == Counter()


def test_concurrent_settlers_settle_a_parent_once(service_env, notices):
    parent_id, kev_id = escalated_auto_job()
    with session_scope() as session:
        batch, [kev] = claim_group(session, "kev", 100, "w1", lease_s=30)
    barrier = threading.Barrier(2)

    def finish_stage() -> None:
        barrier.wait()
        with session_scope() as session:
            lifecycle.finish(session, kev, batch.id, JobOutcome(status="succeeded", result_text="kev"))

    def sweeper() -> None:
        barrier.wait()
        for _ in range(20):
            with session_scope() as session:
                lifecycle.repair(session, max_attempts=3)

    threads = [threading.Thread(target=finish_stage), threading.Thread(target=sweeper)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert row(parent_id).status == "succeeded"
    assert notices.collect() == Counter({str(kev_id): 1, str(parent_id): 1})
    with session_scope() as session:
        assert session.scalars(select(Job.status).where(Job.status == "running")).all() == []


def test_the_jobs_of_a_dead_process_of_this_host_are_queued_again_without_waiting_out_their_leases(service_env):
    """A pool child that starts after a killed one gives the dead child's jobs back at once; a live process's jobs,
    and another host's (whose processes cannot be seen from here), keep their leases."""
    import os
    import socket
    import subprocess
    import sys

    from worker.ledger.claims import dead_owners_here

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    host = socket.gethostname()
    owners = {"dead": f"{host}:{int(gone.stdout)}", "alive": f"{host}:{os.getpid()}", "elsewhere": "elsewhere:1"}
    ids = {}
    with session_scope() as session:
        for name, owner in owners.items():
            job = Job(adapter="laya", requested_adapter="laya", input="x", params={}, status="running", attempts=1,
                      lease_owner=owner, lease_expires_at=datetime.now(timezone.utc) + timedelta(minutes=5))
            session.add(job)
            session.flush()
            ids[name] = job.id
    with session_scope() as session:
        assert dead_owners_here(session) == [owners["dead"]]
        requeued = lifecycle.requeue_dead_owners(session, dead_owners_here(session), max_attempts=3)
    assert requeued == [ids["dead"]]
    assert {name: row(job_id).status for name, job_id in ids.items()} == {
        "dead": "queued", "alive": "running", "elsewhere": "running"}
    assert row(ids["dead"]).lease_owner is None and row(ids["dead"]).attempts == 1  # the next claim counts it
