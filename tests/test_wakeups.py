"""Wake-ups published off the request path (api/wakeups.py), against a real Redis: submits that arrive while
one is being published ride on the next one, each adapter's jobs are covered, and a failure does not stop it."""

from __future__ import annotations

import threading
import uuid

import redis

from shared.models import Job
from shared.queue import QueueUnavailable, publish_wakeup


def jobs(adapter: str, count: int) -> list[Job]:
    return [Job(id=uuid.uuid4(), adapter=adapter) for _ in range(count)]


def test_jobs_noted_during_a_publish_share_the_next_wake_ups(service_env):
    from api.wakeups import WakeupPublisher

    queue = redis.Redis.from_url(service_env["KEVLAYA_REDIS_URL"])
    published: list[tuple[uuid.UUID | None, str]] = []
    first_in_flight, release = threading.Event(), threading.Event()

    def publish(job_id, adapter):  # noqa: ANN001, ANN202
        published.append((job_id, adapter))
        if len(published) == 1:  # hold the first publish while more submits arrive
            first_in_flight.set()
            release.wait(10)
        publish_wakeup(job_id, adapter)

    publisher = WakeupPublisher(max_batch=16, publish=publish)
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


def test_a_failed_publish_leaves_the_publisher_serving(service_env):
    from api.wakeups import WakeupPublisher

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
    assert redis.Redis.from_url(service_env["KEVLAYA_REDIS_URL"]).llen("kevlaya.jobs") == 1
