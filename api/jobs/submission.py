"""Storing the jobs of a submit on behalf of an API key: each request resolved to its job (a new one, or the one
its idempotency key names), the quotas admitted, the rows inserted and their wake-up published. Used by the job
writer (api/jobs/writer.py) for every submit route."""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import insert, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from api.http.errors import RETRY_AFTER_S, ApiError
from api.jobs.wakeups import WakeupPublisher
from api.keys.quotas import Admission
from shared import usage
from shared.clock import db_now
from shared.db import one_writer
from shared.models import ApiKey, Job, JobStatus, Priority
from shared.queue import QueueUnavailable, ping_queue
from shared.schemas import JobAccepted, JobCreate
from shared.settings import get_settings

log = logging.getLogger("kevlaya.api")


def new_job(request: JobCreate, key: ApiKey, now: datetime) -> Job:
    # `auto` is a cascade that starts with Laya (docs/architecture.md §8).
    adapter = "laya" if request.adapter == "auto" else request.adapter
    job = Job(
        id=uuid.uuid4(),
        adapter=adapter,
        requested_adapter=request.adapter,
        status=JobStatus.QUEUED,
        input=request.input if isinstance(request.input, str) else request.input.model_dump(),
        params=request.params.model_dump(exclude_none=True),
        meta=request.metadata,
        idempotency_key=request.idempotency_key,
        api_key_id=key.id,
        created_at=now,
        priority=Priority.INTERACTIVE,
        **request.row_columns(),
    )
    job.stored_bytes = usage.request_bytes(vars(job))  # what it charges its key (api/keys/quotas.py)
    return job


def existing_job(session: Session, key: ApiKey, idempotency_key: str | None) -> Job | None:
    if idempotency_key is None:
        return None
    return session.scalar(
        select(Job).where(Job.api_key_id == key.id, Job.idempotency_key == idempotency_key)
    )


def check_queue() -> None:
    """A broker that is down is found before anything is written: 503, nothing stored."""
    try:
        ping_queue()
    except QueueUnavailable as exc:
        # The broker's error names its host and port: log it, do not show it.
        log.error("submit refused: %s", exc)
        raise ApiError(503, "queue_unavailable", "the job queue is unavailable, nothing was stored; retry later",
                       headers={"Retry-After": RETRY_AFTER_S}) from exc


def insert_rows(session: Session, jobs: list[Job]) -> None:
    """Insert the rows of new jobs, in the caller's write transaction. A bulk insert, not the unit of work: its
    bookkeeping cost more than the insert itself, and the objects are only read afterwards, to answer the submit."""
    session.execute(insert(Job), [{column: value for column, value in vars(job).items() if column[0] != "_"}
                                  for job in jobs])


def insert_jobs(session: Session, jobs: list[Job]) -> None:
    """Admit (each key's quotas, api/keys/quotas.py), insert and commit the rows of new jobs; the ApiError of a quota
    they would pass stores none of them."""
    with one_writer(session):
        by_key: dict[uuid.UUID | None, list[Job]] = {}
        for job in jobs:
            by_key.setdefault(job.api_key_id, []).append(job)
        admission = Admission(session, [key_id for key_id in by_key if key_id is not None], get_settings())
        for key_id, key_jobs in by_key.items():
            if refused := admission.take_jobs(key_id, key_jobs):
                session.rollback()
                raise refused
        insert_rows(session, jobs)
        session.commit()


def enqueue(session: Session, jobs: list[Job], wakeups: WakeupPublisher) -> None:
    """Check the broker, commit the rows, then have their wake-up published (api/jobs/wakeups.py).

    If the broker fails between the commit and the publish, the rows are durable and the worker's sweeper
    re-publishes them."""
    check_queue()
    insert_jobs(session, jobs)
    wakeups.note(jobs)


Stored = tuple[Job, bool]  # a request's job, and whether it was created now


@dataclass(frozen=True, slots=True)
class Accepted:
    """What a submit learns of each of its jobs from the job writer: few fields, cheap to send between processes."""

    id: uuid.UUID
    status: str
    requested_adapter: str
    created_at: datetime
    created: bool  # stored by this submit; else found by its idempotency key

    @classmethod
    def of(cls, stored: Stored) -> Accepted:
        job, created = stored
        return cls(job.id, job.status, job.requested_adapter, job.created_at, created)

    def answer(self) -> JobAccepted:
        return JobAccepted(id=self.id, status=self.status, adapter=self.requested_adapter, created_at=self.created_at)


def resolve(session: Session, key: ApiKey, requests: list[JobCreate],
            seen: dict[tuple[uuid.UUID, str], Job] | None = None) -> tuple[list[Stored], list[Job]]:
    """Each request's job (an existing one for a known idempotency key, else a new one), and the new ones.
    `seen` carries the idempotency keys met so far across several calls (one unit of api/jobs/writer.py)."""
    resolved: list[Stored] = []
    new: list[Job] = []
    seen = {} if seen is None else seen
    for item in requests:
        known = (key.id, item.idempotency_key) if item.idempotency_key else None
        job = seen.get(known) if known else None
        created = job is not None and job in new
        if job is None:
            job = existing_job(session, key, item.idempotency_key)
        if job is None:
            job, created = new_job(item, key, db_now(session)), True
            new.append(job)
        if known:
            seen[known] = job
        resolved.append((job, created))
    return resolved, new


def store_jobs(session: Session, key: ApiKey, requests: list[JobCreate], wakeups: WakeupPublisher) -> list[Stored]:
    """Store and enqueue the jobs of `requests` on their own; returns each request's job and whether it was
    created now.

    Two submits racing with one idempotency key both miss the lookup; the loser's insert then hits the
    unique constraint, and it answers with the winner's job instead of an error."""
    attempts = 3
    for attempt in range(attempts):
        resolved, new = resolve(session, key, requests)
        if not new:
            return resolved
        try:
            enqueue(session, new, wakeups)
            return resolved
        except IntegrityError:
            session.rollback()
            if attempt == attempts - 1 or not any(r.idempotency_key for r in requests):
                raise
            log.info("idempotency key raced with another submit; answering with the stored job")
    raise AssertionError("unreachable")
