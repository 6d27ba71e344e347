"""Turning `jobs` rows into API responses, and cursors into keyset positions."""

from __future__ import annotations

import base64
import json
import uuid
from datetime import datetime

from shared.models import Job
from shared.schemas import JobAccepted, JobError, JobOut, JobResult, JobTimings, JobTokens


def job_out(job: Job) -> JobOut:
    finished_with_result = job.result_text is not None or job.decision is not None
    return JobOut(
        id=job.id,
        status=job.status,
        adapter=job.adapter,
        requested_adapter=job.requested_adapter,
        input=job.input,
        params=job.params,
        metadata=job.meta,
        result=JobResult(text=job.result_text, decision=job.decision) if finished_with_result else None,
        error=JobError(code=job.error_code, message=job.error_message) if job.error_code else None,
        timings=JobTimings(
            queue_ms=job.queue_ms, switch_ms=job.switch_ms, prefill_ms=job.prefill_ms,
            decode_ms=job.decode_ms, total_ms=job.total_ms,
        ),
        tokens=JobTokens(prompt=job.prompt_tokens, completion=job.completion_tokens),
        attempts=job.attempts,
        batch_id=job.batch_id,
        parent_job_id=job.parent_job_id,
        created_at=job.created_at,
        started_at=job.started_at,
        finished_at=job.finished_at,
    )


def job_accepted(job: Job) -> JobAccepted:
    return JobAccepted(id=job.id, status=job.status, adapter=job.requested_adapter, created_at=job.created_at)


def encode_cursor(job: Job) -> str:
    raw = json.dumps([job.created_at.isoformat(), str(job.id)]).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(cursor: str) -> tuple[datetime, uuid.UUID]:
    """Raises ValueError on anything that is not a cursor this API issued."""
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        created_at, job_id = json.loads(raw)
        return datetime.fromisoformat(created_at), uuid.UUID(job_id)
    except Exception as exc:
        raise ValueError("cursor is not one returned by this API") from exc
