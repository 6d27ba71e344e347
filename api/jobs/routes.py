"""`/v1/jobs`: submit, batch submit, get, wait, list, cancel and delete (docs/architecture.md §8, §16)."""

from __future__ import annotations

import uuid
from typing import Annotated

from fastapi import APIRouter, Depends, Header, Query, Response, status
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import StreamingResponse
from sqlalchemy import and_, or_, select
from sqlalchemy.orm import Session

from api.http.deps import SessionDep, SettingsDep, reject_unknown_query_parameters
from api.http.errors import AUTH_ERRORS, ApiError, error_responses
from api.jobs.cursors import decode_cursor, encode_cursor
from api.jobs.deletion import delete_jobs
from api.jobs.events import job_event_stream
from api.jobs.intake import IntakeDep, not_a_role
from api.jobs.lookup import get_visible, visible_to
from api.jobs.presenters import jobs_out
from api.jobs.waiting import wait_finished
from api.keys.auth import CurrentKey, SubmitterKey
from api.keys.caps import HeldStream, long_polls, streams
from shared import lifecycle
from shared.adapter_assignments import is_role
from shared.db import one_writer
from shared.models import Job, JobStatus
from shared.schemas import (
    JobAccepted,
    JobBatchAccepted,
    JobBatchCreate,
    JobCreate,
    JobDeleted,
    JobOut,
    JobPage,
    RequestedAdapter,
)

router = APIRouter(prefix="/v1/jobs", tags=["jobs"], dependencies=[Depends(reject_unknown_query_parameters)])

JobStatusName = Annotated[str | None, Query(pattern="^(queued|running|succeeded|failed|cancelled)$")]


_LOCATION = {"Location": {"description": "the job's URL", "schema": {"type": "string"}}}
_SUBMIT_RESPONSES = {
    200: {"model": JobAccepted, "headers": _LOCATION,
          "description": "A job with this idempotency key exists already: that job"},
    202: {"headers": _LOCATION, "description": "Stored and queued"},
    **error_responses(400, 413, 422, *AUTH_ERRORS),
}


# The submit routes are `async`: they run on the event loop and hand their rows to the process's job writer
# (api/jobs/writer.py), which commits the submits that arrive together as one; no thread or database connection
# is held per request.
@router.post("", status_code=status.HTTP_202_ACCEPTED, response_model=JobAccepted, responses=_SUBMIT_RESPONSES)
async def submit_job(request: JobCreate, key: SubmitterKey, intake: IntakeDep, response: Response) -> JobAccepted:
    intake.check(request)
    [accepted] = await intake.store(key, [request])
    if not accepted.created:
        response.status_code = status.HTTP_200_OK
    response.headers["Location"] = f"/v1/jobs/{accepted.id}"
    return accepted.answer()


@router.post("/batch", status_code=status.HTTP_202_ACCEPTED, response_model=JobBatchAccepted,
             responses=error_responses(400, 413, 422, *AUTH_ERRORS))
async def submit_jobs(request: JobBatchCreate, key: SubmitterKey, intake: IntakeDep) -> JobBatchAccepted:
    limit = intake.settings.limits.batch_submit
    if len(request.jobs) > limit:
        raise ApiError(422, "invalid_request", f"jobs: {len(request.jobs)} jobs, the limit is {limit}")

    def check_each() -> None:
        for index, item in enumerate(request.jobs):
            intake.check(item, field_prefix=f"jobs.{index}.")

    await run_in_threadpool(check_each)  # up to limits.batch_submit prompts to count: not on the event loop
    stored = await intake.store(key, request.jobs)
    return JobBatchAccepted(jobs=[accepted.answer() for accepted in stored])


@router.get("", response_model=JobPage, responses=error_responses(400, 422, *AUTH_ERRORS))
def list_jobs(key: CurrentKey, session: SessionDep,
              status_: Annotated[JobStatusName, Query(alias="status")] = None,
              adapter: Annotated[RequestedAdapter | None, Query()] = None,
              limit: Annotated[int, Query(ge=1, le=200)] = 50,
              cursor: Annotated[str | None, Query()] = None) -> JobPage:
    if adapter is not None and adapter != "auto" and not is_role(session, adapter):
        raise not_a_role("adapter", adapter)
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


@router.get("/{job_id}", response_model=JobOut, responses=error_responses(404, 422, *AUTH_ERRORS))
def get_job(job_id: uuid.UUID, key: CurrentKey, session: SessionDep) -> JobOut:
    return jobs_out(session, [get_visible(session, key, job_id)])[0]


@router.get("/{job_id}/wait", response_model=JobOut, responses=error_responses(404, 422, *AUTH_ERRORS))
async def wait_for_job(job_id: uuid.UUID, key: CurrentKey, session: SessionDep, settings: SettingsDep,
                       timeout: Annotated[float | None, Query(gt=0, description="seconds; default 30 "
                                                              "(or the configured maximum, if lower)")] = None) -> JobOut:
    """Long-poll: answers as soon as the job is finished, or with its current state at the timeout."""
    timeout = min(30.0, settings.limits.wait_timeout_s) if timeout is None else timeout
    if timeout > settings.limits.wait_timeout_s:
        raise ApiError(422, "invalid_request", f"timeout: at most {settings.limits.wait_timeout_s} seconds")
    session.close()  # the key was checked; the wait must not hold a pooled connection
    with long_polls.hold(key.id, settings.connections.long_polls_per_key):
        return await wait_finished(key, job_id, timeout)


@router.get("/{job_id}/events", response_class=StreamingResponse,
            responses={200: {"content": {"text/event-stream": {}}, "description": "Server-Sent Events: `status`, "
                             "`delta`, `resync` and a last `done` carrying the job as GET /v1/jobs/{id} returns "
                             "it"}, **error_responses(404, 422, *AUTH_ERRORS)})
async def job_events(job_id: uuid.UUID, key: CurrentKey, session: SessionDep, settings: SettingsDep,
                     last_event_id: Annotated[str | None, Header(description="resume after this event")] = None,
                     ) -> StreamingResponse:
    """The job's progress as it happens (docs/architecture.md §8, Events); resumable with `Last-Event-ID`."""
    job = jobs_out(session, [get_visible(session, key, job_id)])[0]
    session.close()  # the stream must not hold a pooled connection
    stream = job_event_stream(key, job, last_event_id, settings)  # a bad Last-Event-ID is refused first
    return HeldStream(stream, streams.take(key.id, settings.connections.streams_per_key))


def _stage_refused(job: Job, job_id: uuid.UUID) -> None:
    if job.parent_job_id is not None:
        raise ApiError(409, "conflict", f"job {job_id} is a stage of `auto` job {job.parent_job_id}; "
                       "it cannot be cancelled or deleted on its own")


def _cancelled(session: Session, job: Job, refusal: str) -> JobOut:
    """Cancel a queued job and answer it as it now stands (its waiters see it end); 409 with `refusal` else."""
    with one_writer(session):
        cancelled = lifecycle.cancel(session, job.id)
        session.commit()
    session.refresh(job)
    if not cancelled:
        raise ApiError(409, "conflict", f"job {job.id} is {job.status}; {refusal}")
    return jobs_out(session, [job])[0]


@router.post("/{job_id}/cancel", response_model=JobOut, responses=error_responses(404, 409, 422, *AUTH_ERRORS))
def cancel_job(job_id: uuid.UUID, key: CurrentKey, session: SessionDep) -> JobOut:
    """A queued job is cancelled; one that has started or finished is left as it is (409). Unlike DELETE, which
    deletes a finished job, a client that only wants a job stopped cannot lose its answer by asking too late."""
    job = get_visible(session, key, job_id)
    _stage_refused(job, job_id)
    return _cancelled(session, job, "only a queued job can be cancelled")


@router.delete("/{job_id}", response_model=JobOut | JobDeleted,
               responses=error_responses(404, 409, 422, *AUTH_ERRORS))
def cancel_or_delete_job(job_id: uuid.UUID, key: CurrentKey, session: SessionDep) -> JobOut | JobDeleted:
    """A queued job is cancelled (answered as it now stands: its waiters see it end); a finished one is deleted
    with its `auto` stages, and its bytes no longer count against the key's quota (docs/architecture.md §16). A
    running job: 409, delete it once it has finished."""
    job = get_visible(session, key, job_id)
    _stage_refused(job, job_id)
    if job.status in JobStatus.FINISHED:
        if job.file_batch_id is not None:
            raise ApiError(409, "conflict", f"job {job_id} is a line of a batch; it goes with the batch "
                           "(DELETE /v1/batches/{id})")
        with one_writer(session):
            deleted = delete_jobs(session, Job.id == job_id, Job.status.in_(JobStatus.FINISHED))
            session.commit()
        if not deleted:
            raise ApiError(404, "not_found", f"job {job_id} not found")
        return JobDeleted(id=job_id)
    return _cancelled(session, job, "a queued job can be cancelled and a finished one deleted, a running one "
                      "neither: delete it once it has finished")
