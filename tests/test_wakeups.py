"""Wake-ups published off the request path (api/jobs/wakeups.py), against a real Redis: submits that arrive while
one is being published ride on the next one, each adapter's jobs are covered, and a failure does not stop it."""

from __future__ import annotations

import threading
import uuid

import redis

from shared.models import Job
from shared.queue import QueueUnavailable, publish_wakeup
from tests.conftest import sqlite_writers_fail_when_locked


def jobs(adapter: str, count: int) -> list[Job]:
    return [Job(id=uuid.uuid4(), adapter=adapter) for _ in range(count)]


def test_jobs_noted_during_a_publish_share_the_next_wake_ups(service_env):
    from api.jobs.wakeups import WakeupPublisher

    queue = redis.Redis.from_url(service_env["KEVLAYA_REDIS__URL"])
    published: list[tuple[uuid.UUID | None, str]] = []
    first_in_flight, release = threading.Event(), threading.Event()

    def publish(job_id, adapter):  # noqa: ANN001, ANN202
        published.append((job_id, adapter))
        if len(published) == 1:  # hold the first publish while more submits arrive
            first_in_flight.set()
            release.wait(10)
        publish_wakeup(job_id, adapter)

    publisher = WakeupPublisher(max_batch=16, publish=publish, waiting=lambda: 0)  # as if workers take each at once
    first = jobs("laya", 1)
    publisher.note(first)
    assert first_in_flight.wait(10)
    later_kev, later_laya = jobs("kev", 40), jobs("laya", 3)
    for job in later_kev + later_laya:  # 43 submits, one by one, while the first wake-up is on its way
        publisher.note([job])
    release.set()
    assert publisher.flush(10)
    # one for the first job, then one per 16 Kev jobs (a worker drains the queue, 16 at a time) and one for Laya
    assert published == [(first[0].id, "laya"), (later_kev[0].id, "kev"), (later_kev[16].id, "kev"),
                         (later_kev[32].id, "kev"), (later_laya[0].id, "laya")]
    assert queue.llen("kevlaya.jobs") == 5  # really on the broker


def test_a_wake_up_still_waiting_in_the_broker_covers_new_jobs(service_env):
    """While the workers are busy, wake-ups wait in the broker; each drains the whole queue when a worker takes
    it, so new jobs need only the wake-ups that are not already waiting."""
    from api.jobs.wakeups import WakeupPublisher

    queue = redis.Redis.from_url(service_env["KEVLAYA_REDIS__URL"])
    publisher = WakeupPublisher(max_batch=16)

    def after(noted: list[Job]) -> int:
        publisher.note(noted)
        assert publisher.flush(10)
        return queue.llen("kevlaya.jobs")

    assert after(jobs("laya", 1)) == 1
    assert after(jobs("kev", 3)) == 1  # the waiting one covers them
    assert after(jobs("kev", 40)) == 3  # three batches to run, one wake-up waiting: two more
    queue.delete("kevlaya.jobs")  # the workers took them
    assert after(jobs("kev", 1)) == 1


def test_a_failed_publish_leaves_the_publisher_serving(service_env):
    from api.jobs.wakeups import WakeupPublisher

    attempts: list[str] = []

    def publish(job_id, adapter):  # noqa: ANN001, ANN202
        attempts.append(adapter)
        if len(attempts) == 1:
            raise QueueUnavailable("message broker unavailable (injected by the test)")
        if len(attempts) == 2:
            raise RuntimeError("an unexpected failure (injected by the test)")
        publish_wakeup(job_id, adapter)

    publisher = WakeupPublisher(max_batch=16, publish=publish)
    for adapter in ("kev", "laya", "kev"):
        publisher.note(jobs(adapter, 1))
        assert publisher.flush(10)
    assert attempts == ["kev", "laya", "kev"]
    assert redis.Redis.from_url(service_env["KEVLAYA_REDIS__URL"]).llen("kevlaya.jobs") == 1


def test_concurrent_submits_on_sqlite_take_turns_at_writing_instead_of_retrying(service_env, monkeypatch):
    """SQLite takes one writer at a time; its busy handler makes the others retry after sleeps of up to 100 ms,
    which made the slowest submits under load take a second. With the busy handler off (a writer that finds
    the database locked fails at once), 16 threads submitting at once all succeed: they queue on the process's
    writer lock instead (shared/db.py: one_writer)."""
    from sqlalchemy import func, select

    from api.jobs.submission import enqueue
    from api.jobs.wakeups import WakeupPublisher
    from shared import db

    if not sqlite_writers_fail_when_locked():
        return
    publisher = WakeupPublisher(max_batch=16, publish=lambda job_id, adapter: None)
    errors: list[Exception] = []
    start = threading.Barrier(16)

    def submit(n: int) -> None:
        start.wait()
        for i in range(10):
            try:
                with db.new_session() as session:
                    enqueue(session, [Job(id=uuid.uuid4(), adapter="kev", requested_adapter="kev",
                                          input=f"job {n}.{i}", params={})], publisher)
            except Exception as exc:  # "database is locked" without the writer lock
                errors.append(exc)

    threads = [threading.Thread(target=submit, args=(n,)) for n in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert errors == []
    with db.new_session() as session:
        assert session.scalar(select(func.count()).select_from(Job)) == 160
