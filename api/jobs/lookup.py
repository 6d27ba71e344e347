"""A job as an API key may see it: admin keys see every job, other keys their own; 404 for any other."""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from functools import partial

from fastapi.concurrency import run_in_threadpool
from sqlalchemy import ColumnElement, select, true
from sqlalchemy.orm import Session

from api.http.errors import ApiError
from api.jobs.presenters import jobs_out
from shared.db import new_session
from shared.models import ApiKey, Job
from shared.schemas import JobOut


def visible_to(key: ApiKey) -> ColumnElement[bool]:
    """Admin keys see every job; other keys see their own."""
    return true() if key.is_admin else Job.api_key_id == key.id


def get_visible(session: Session, key: ApiKey, job_id: uuid.UUID) -> Job:
    job = session.scalar(select(Job).where(Job.id == job_id, visible_to(key)))
    if job is None:
        raise ApiError(404, "not_found", f"job {job_id} not found")
    return job


def read_visible(key: ApiKey, job_id: uuid.UUID) -> JobOut:
    """The job as GET /v1/jobs/{id} shows it, in a session of its own (404 when the key may not see it)."""
    with new_session() as session:
        return jobs_out(session, [get_visible(session, key, job_id)])[0]


def visible_reader(key: ApiKey, job_id: uuid.UUID) -> Callable[[], Awaitable[JobOut]]:
    """`read_visible` in the thread pool: how a stream that follows the job reads it again."""
    return partial(run_in_threadpool, read_visible, key, job_id)
