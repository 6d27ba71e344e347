"""Turning `jobs` rows into API responses."""

from __future__ import annotations

import re
import uuid
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from shared.models import Job
from shared.schemas import JobError, JobOut, JobResult, JobStage, JobTimings, JobTokens

_SURROGATE = re.compile("[\ud800-\udfff]")


def readable(value: Any) -> Any:
    """`value` with lone surrogates replaced by U+FFFD: rows stored before input was checked for them must still
    be readable (a JSON answer cannot carry them)."""
    if isinstance(value, str):
        return _SURROGATE.sub("\ufffd", value)
    if isinstance(value, dict):
        return {readable(k): readable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [readable(v) for v in value]
    return value


def _result(job: Job) -> JobResult | None:
    if job.result_text is None and job.decision is None:
        return None
    return JobResult(text=readable(job.result_text), decision=readable(job.decision), finish_reason=job.finish_reason,
                     logprobs=readable(job.logprobs))


def _error(job: Job) -> JobError | None:
    return JobError(code=job.error_code, message=job.error_message) if job.error_code else None


def _timings(job: Job) -> JobTimings:
    return JobTimings(queue_ms=job.queue_ms, prefill_ms=job.prefill_ms,
                      ttft_ms=job.ttft_ms, decode_ms=job.decode_ms, total_ms=job.total_ms)


def _tokens(job: Job) -> JobTokens:
    return JobTokens(prompt=job.prompt_tokens, completion=job.completion_tokens)


def job_out(job: Job, children: list[Job] | None = None) -> JobOut:
    stages = None
    if children:
        stages = [JobStage(id=c.id, adapter=c.adapter, adapter_version=c.adapter_version, status=c.status,
                           result=_result(c), error=_error(c), timings=_timings(c), tokens=_tokens(c))
                  for c in sorted(children, key=lambda c: (c.adapter != "laya", c.created_at))]
    return JobOut(
        id=job.id,
        status=job.status,
        adapter=job.adapter,
        requested_adapter=job.requested_adapter,
        answered_by=job.answered_by,
        adapter_version=job.adapter_version,
        input=readable(job.input),
        params=job.params,
        metadata=readable(job.meta),
        result=_result(job),
        error=_error(job),
        timings=_timings(job),
        tokens=_tokens(job),
        attempts=job.attempts,
        batch_id=job.batch_id,
        parent_job_id=job.parent_job_id,
        cascade=stages,
        created_at=job.created_at,
        started_at=job.started_at,
        finished_at=job.finished_at,
    )


def children_of(session: Session, jobs: list[Job]) -> dict[uuid.UUID, list[Job]]:
    """Cascade stages of the `auto` jobs among `jobs`, in one query."""
    parents = [j.id for j in jobs if j.requested_adapter == "auto" and j.parent_job_id is None]
    found: dict[uuid.UUID, list[Job]] = {}
    if parents:
        for child in session.scalars(select(Job).where(Job.parent_job_id.in_(parents))):
            found.setdefault(child.parent_job_id, []).append(child)
    return found


def jobs_out(session: Session, jobs: list[Job]) -> list[JobOut]:
    children = children_of(session, jobs)
    return [job_out(job, children.get(job.id)) for job in jobs]
