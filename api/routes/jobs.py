"""`/v1/jobs`: submit, batch submit, get, wait, list, cancel (DESIGN §8)."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from datetime import datetime, timezone
from typing import Annotated

from fastapi import APIRouter, Query, Response, status
from fastapi.concurrency import run_in_threadpool
from sqlalchemy import ColumnElement, and_, or_, select, true, update
from sqlalchemy.orm import Session

from api.deps import CurrentKey, SessionDep, SettingsDep
from api.errors import ApiError
from api.presenters import decode_cursor, encode_cursor, job_accepted, job_out
from shared.db import new_session
from shared.models import ApiKey, Job, JobStatus
from shared.queue import QueueUnavailable, ping_queue, publish_wakeup
from shared.schemas import (
    JobAccepted,
    JobBatchAccepted,
    JobBatchCreate,
    JobCreate,
    JobOut,
    JobPage,
    RequestedAdapter,
)
from shared.settings import Settings

log = logging.getLogger("kevlaya.api")
router = APIRouter(prefix="/v1/jobs", tags=["jobs"])

JobStatusName = Annotated[str | None, Query(pattern="^(queued|running|succeeded|failed|cancelled)$")]


def _check_limits(request: JobCreate, settings: Settings, field_prefix: str = "") -> None:
    if request.prompt_chars() > settings.max_prompt_chars:
        raise ApiError(422, "invalid_request",
                       f"{field_prefix}input: prompt has {request.prompt_chars()} characters, "
                       f"the limit is {settings.max_prompt_chars}")
    tokens = request.params.max_new_tokens
    if tokens is not None and tokens > settings.max_new_tokens_limit:
        raise ApiError(422, "invalid_request",
                       f"{field_prefix}params.max_new_tokens: {tokens} is over the limit of {settings.max_new_tokens_limit}")


def _new_job(request: JobCreate, key: ApiKey) -> Job:
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


def _existing(session: Session, key: ApiKey, idempotency_key: str | None) -> Job | None:
    if idempotency_key is None:
        return None
    return session.scalar(
        select(Job).where(Job.api_key_id == key.id, Job.idempotency_key == idempotency_key)
    )


def _enqueue(session: Session, jobs: list[Job]) -> None:
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


def _visible(key: ApiKey) -> ColumnElement[bool]:
    """Admin keys see every job; other keys see their own."""
    return true() if key.is_admin else Job.api_key_id == key.id


def _get_visible(session: Session, key: ApiKey, job_id: uuid.UUID) -> Job:
    job = session.scalar(select(Job).where(Job.id == job_id, _visible(key)))
    if job is None:
        raise ApiError(404, "not_found", f"job {job_id} not found")
    return job


@router.post("", status_code=status.HTTP_202_ACCEPTED, response_model=JobAccepted)
def submit_job(request: JobCreate, key: CurrentKey, session: SessionDep, settings: SettingsDep,
               response: Response) -> JobAccepted:
    _check_limits(request, settings)
    existing = _existing(session, key, request.idempotency_key)
    if existing is not None:
        response.status_code = status.HTTP_200_OK
        response.headers["Location"] = f"/v1/jobs/{existing.id}"
        return job_accepted(existing)
    job = _new_job(request, key)
    _enqueue(session, [job])
    response.headers["Location"] = f"/v1/jobs/{job.id}"
    return job_accepted(job)


@router.post("/batch", status_code=status.HTTP_202_ACCEPTED, response_model=JobBatchAccepted)
def submit_jobs(request: JobBatchCreate, key: CurrentKey, session: SessionDep,
                settings: SettingsDep) -> JobBatchAccepted:
    if len(request.jobs) > settings.max_batch_submit:
        raise ApiError(422, "invalid_request",
                       f"jobs: {len(request.jobs)} jobs, the limit is {settings.max_batch_submit}")
    for index, item in enumerate(request.jobs):
        _check_limits(item, settings, field_prefix=f"jobs.{index}.")
    accepted: list[Job] = []
    new: list[Job] = []
    seen: dict[str, Job] = {}
    for item in request.jobs:
        job = seen.get(item.idempotency_key) if item.idempotency_key else None
        job = job or _existing(session, key, item.idempotency_key)
        if job is None:
            job = _new_job(item, key)
            new.append(job)
        if item.idempotency_key:
            seen[item.idempotency_key] = job
        accepted.append(job)
    if new:
        _enqueue(session, new)
    return JobBatchAccepted(jobs=[job_accepted(j) for j in accepted])


@router.get("", response_model=JobPage)
def list_jobs(key: CurrentKey, session: SessionDep,
              status_: Annotated[JobStatusName, Query(alias="status")] = None,
              adapter: Annotated[RequestedAdapter | None, Query()] = None,
              limit: Annotated[int, Query(ge=1, le=200)] = 50,
              cursor: Annotated[str | None, Query()] = None) -> JobPage:
    query = select(Job).where(_visible(key))
    if status_:
        query = query.where(Job.status == status_)
    if adapter == "auto":
        query = query.where(Job.requested_adapter == "auto")
    elif adapter:
        query = query.where(Job.adapter == adapter)
    if cursor:
        try:
            created_at, job_id = decode_cursor(cursor)
        except ValueError as exc:
            raise ApiError(400, "invalid_request", f"cursor: {exc}") from exc
        query = query.where(or_(Job.created_at < created_at, and_(Job.created_at == created_at, Job.id < job_id)))
    rows = session.scalars(query.order_by(Job.created_at.desc(), Job.id.desc()).limit(limit + 1)).all()
    page = rows[:limit]
    next_cursor = encode_cursor(page[-1]) if len(rows) > limit else None
    return JobPage(jobs=[job_out(j) for j in page], next_cursor=next_cursor)


@router.get("/{job_id}", response_model=JobOut)
def get_job(job_id: uuid.UUID, key: CurrentKey, session: SessionDep) -> JobOut:
    return job_out(_get_visible(session, key, job_id))


@router.get("/{job_id}/wait", response_model=JobOut)
async def wait_for_job(job_id: uuid.UUID, key: CurrentKey, settings: SettingsDep,
                       timeout: Annotated[float, Query(gt=0)] = 30.0) -> JobOut:
    """Long-poll: answers as soon as the job is finished, or with its current state at the timeout."""
    if timeout > settings.max_wait_timeout_s:
        raise ApiError(422, "invalid_request", f"timeout: at most {settings.max_wait_timeout_s} seconds")

    def read() -> Job:
        with new_session() as session:
            return _get_visible(session, key, job_id)

    deadline = time.monotonic() + timeout
    job = await run_in_threadpool(read)
    while job.status not in JobStatus.FINISHED and time.monotonic() < deadline:
        await asyncio.sleep(min(0.1, max(deadline - time.monotonic(), 0)))
        job = await run_in_threadpool(read)
    return job_out(job)


@router.delete("/{job_id}", response_model=JobOut)
def cancel_job(job_id: uuid.UUID, key: CurrentKey, session: SessionDep) -> JobOut:
    job = _get_visible(session, key, job_id)
    cancelled = session.execute(
        update(Job).where(Job.id == job_id, Job.status == JobStatus.QUEUED)
        .values(status=JobStatus.CANCELLED, finished_at=datetime.now(timezone.utc))
    ).rowcount
    session.commit()
    session.refresh(job)
    if not cancelled:
        raise ApiError(409, "conflict", f"job {job_id} is {job.status}; only a queued job can be cancelled")
    return job_out(job)
