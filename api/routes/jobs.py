"""`/v1/jobs`: submit, batch submit, get, wait, list, cancel (DESIGN §8)."""

from __future__ import annotations

import uuid
from typing import Annotated

from fastapi import APIRouter, Query, Response, status
from sqlalchemy import and_, or_, select

from api.deps import CurrentKey, SessionDep, SettingsDep
from api.errors import ApiError
from api.presenters import decode_cursor, encode_cursor, job_accepted, jobs_out
from api.submission import check_limits, enqueue, existing_job, get_visible, new_job, visible_to, wait_finished
from shared import lifecycle
from shared.models import Job
from shared.schemas import (
    JobAccepted,
    JobBatchAccepted,
    JobBatchCreate,
    JobCreate,
    JobOut,
    JobPage,
    RequestedAdapter,
)

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])

JobStatusName = Annotated[str | None, Query(pattern="^(queued|running|succeeded|failed|cancelled)$")]


@router.post("", status_code=status.HTTP_202_ACCEPTED, response_model=JobAccepted)
def submit_job(request: JobCreate, key: CurrentKey, session: SessionDep, settings: SettingsDep,
               response: Response) -> JobAccepted:
    check_limits(request, settings)
    existing = existing_job(session, key, request.idempotency_key)
    if existing is not None:
        response.status_code = status.HTTP_200_OK
        response.headers["Location"] = f"/v1/jobs/{existing.id}"
        return job_accepted(existing)
    job = new_job(request, key)
    enqueue(session, [job])
    response.headers["Location"] = f"/v1/jobs/{job.id}"
    return job_accepted(job)


@router.post("/batch", status_code=status.HTTP_202_ACCEPTED, response_model=JobBatchAccepted)
def submit_jobs(request: JobBatchCreate, key: CurrentKey, session: SessionDep,
                settings: SettingsDep) -> JobBatchAccepted:
    if len(request.jobs) > settings.max_batch_submit:
        raise ApiError(422, "invalid_request",
                       f"jobs: {len(request.jobs)} jobs, the limit is {settings.max_batch_submit}")
    for index, item in enumerate(request.jobs):
        check_limits(item, settings, field_prefix=f"jobs.{index}.")
    accepted: list[Job] = []
    new: list[Job] = []
    seen: dict[str, Job] = {}
    for item in request.jobs:
        job = seen.get(item.idempotency_key) if item.idempotency_key else None
        job = job or existing_job(session, key, item.idempotency_key)
        if job is None:
            job = new_job(item, key)
            new.append(job)
        if item.idempotency_key:
            seen[item.idempotency_key] = job
        accepted.append(job)
    if new:
        enqueue(session, new)
    return JobBatchAccepted(jobs=[job_accepted(j) for j in accepted])


@router.get("", response_model=JobPage)
def list_jobs(key: CurrentKey, session: SessionDep,
              status_: Annotated[JobStatusName, Query(alias="status")] = None,
              adapter: Annotated[RequestedAdapter | None, Query()] = None,
              limit: Annotated[int, Query(ge=1, le=200)] = 50,
              cursor: Annotated[str | None, Query()] = None) -> JobPage:
    query = select(Job).where(visible_to(key))
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
    return JobPage(jobs=jobs_out(session, list(page)), next_cursor=next_cursor)


@router.get("/{job_id}", response_model=JobOut)
def get_job(job_id: uuid.UUID, key: CurrentKey, session: SessionDep) -> JobOut:
    return jobs_out(session, [get_visible(session, key, job_id)])[0]


@router.get("/{job_id}/wait", response_model=JobOut)
async def wait_for_job(job_id: uuid.UUID, key: CurrentKey, session: SessionDep, settings: SettingsDep,
                       timeout: Annotated[float, Query(gt=0)] = 30.0) -> JobOut:
    """Long-poll: answers as soon as the job is finished, or with its current state at the timeout."""
    if timeout > settings.max_wait_timeout_s:
        raise ApiError(422, "invalid_request", f"timeout: at most {settings.max_wait_timeout_s} seconds")
    session.close()  # the key was checked; the wait must not hold a pooled connection
    return await wait_finished(key, job_id, timeout)


@router.delete("/{job_id}", response_model=JobOut)
def cancel_job(job_id: uuid.UUID, key: CurrentKey, session: SessionDep) -> JobOut:
    job = get_visible(session, key, job_id)
    if job.parent_job_id is not None:
        raise ApiError(409, "conflict", f"job {job_id} is a stage of `auto` job {job.parent_job_id}; "
                       "it cannot be cancelled on its own")
    cancelled = lifecycle.cancel(session, job_id)
    session.commit()
    session.refresh(job)
    if not cancelled:
        raise ApiError(409, "conflict", f"job {job_id} is {job.status}; only a queued job can be cancelled")
    return jobs_out(session, [job])[0]
