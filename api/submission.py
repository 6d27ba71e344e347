"""Submitting and looking up jobs on behalf of an API key: shared by the jobs and chat routes."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from datetime import datetime, timezone

from fastapi.concurrency import run_in_threadpool
from sqlalchemy import ColumnElement, select, true
from sqlalchemy.orm import Session

from api.errors import ApiError
from api.presenters import jobs_out
from api.waiting import notices
from shared.db import new_session
from shared.models import ApiKey, Job, JobStatus
from shared.queue import QueueUnavailable, ping_queue, publish_wakeup
from shared.schemas import JobCreate, JobOut
from shared.settings import Settings, get_settings

log = logging.getLogger("kevlaya.api")


def check_limits(request: JobCreate, settings: Settings, field_prefix: str = "") -> None:
    if request.prompt_chars() > settings.max_prompt_chars:
        raise ApiError(422, "invalid_request",
                       f"{field_prefix}input: prompt has {request.prompt_chars()} characters, "
                       f"the limit is {settings.max_prompt_chars}")
    tokens = request.params.max_new_tokens
    if tokens is not None and tokens > settings.max_new_tokens_limit:
        raise ApiError(422, "invalid_request",
                       f"{field_prefix}params.max_new_tokens: {tokens} is over the limit of {settings.max_new_tokens_limit}")


def new_job(request: JobCreate, key: ApiKey) -> Job:
    # `auto` is a cascade that starts with Laya (DESIGN §8).
    adapter = "laya" if request.adapter == "auto" else request.adapter
    return Job(
        id=uuid.uuid4(),
        adapter=adapter,
        requested_adapter=request.adapter,
        status=JobStatus.QUEUED,
        input=request.input if isinstance(request.input, str) else request.input.model_dump(),
        params=request.params.model_dump(exclude_none=True),
        meta=request.metadata,
        idempotency_key=request.idempotency_key,
        api_key_id=key.id,
        created_at=datetime.now(timezone.utc),
    )


def existing_job(session: Session, key: ApiKey, idempotency_key: str | None) -> Job | None:
    if idempotency_key is None:
        return None
    return session.scalar(
        select(Job).where(Job.api_key_id == key.id, Job.idempotency_key == idempotency_key)
    )


def enqueue(session: Session, jobs: list[Job]) -> None:
    """Check the broker, commit the rows, then publish their wake-ups.

    A broker that is down is found before anything is written (503, nothing stored). If it fails
    between the commit and a publish, the rows are durable and the worker's sweeper re-publishes them."""
    try:
        ping_queue()
    except QueueUnavailable as exc:
        raise ApiError(503, "queue_unavailable", f"the job queue is unavailable, nothing was stored: {exc}",
                       headers={"Retry-After": "5"}) from exc
    session.add_all(jobs)
    session.commit()
    for job in jobs:
        try:
            publish_wakeup(job.id, job.adapter)
        except QueueUnavailable:
            log.warning("job %s stored but its wake-up was not published; the sweeper will re-publish it", job.id)


def visible_to(key: ApiKey) -> ColumnElement[bool]:
    """Admin keys see every job; other keys see their own."""
    return true() if key.is_admin else Job.api_key_id == key.id


def get_visible(session: Session, key: ApiKey, job_id: uuid.UUID) -> Job:
    job = session.scalar(select(Job).where(Job.id == job_id, visible_to(key)))
    if job is None:
        raise ApiError(404, "not_found", f"job {job_id} not found")
    return job


async def wait_finished(key: ApiKey, job_id: uuid.UUID, timeout_s: float) -> JobOut:
    """The job as soon as it is finished, or as it stands when `timeout_s` has passed. While it waits it holds
    no database connection and no thread: it wakes on the job's "finished" notice, or re-checks every
    `KEVLAYA_WAIT_RECHECK_S` in case a notice was lost."""

    def read() -> JobOut:
        with new_session() as session:
            return jobs_out(session, [get_visible(session, key, job_id)])[0]

    deadline = time.monotonic() + timeout_s
    recheck_s = get_settings().wait_recheck_s
    with notices.watch(job_id) as finished:
        await notices.subscribed(timeout_s=min(1.0, timeout_s))
        job = await run_in_threadpool(read)
        while job.status not in JobStatus.FINISHED:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                await asyncio.wait_for(finished.wait(), min(remaining, recheck_s))
            except TimeoutError:
                pass
            finished.clear()
            job = await run_in_threadpool(read)
    return job
