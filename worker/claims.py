"""The job ledger as the worker sees it: snapshot the queue, claim a batch atomically with a lease,
renew and expire leases, and finish jobs only while still holding their lease (DESIGN §3)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from shared.models import Batch, Job, JobStatus
from worker.scheduler import BatchPlan, QueueSnapshot


def _now() -> datetime:
    return datetime.now(timezone.utc)


def queue_snapshot(session: Session, now: datetime | None = None) -> QueueSnapshot:
    now = now or _now()
    rows = session.execute(
        select(Job.adapter, func.count(), func.min(Job.created_at))
        .where(Job.status == JobStatus.QUEUED).group_by(Job.adapter)
    ).all()
    queued, oldest = {}, {}
    for adapter, count, first in rows:
        if first.tzinfo is None:  # aggregate results bypass the column type on SQLite
            first = datetime.fromisoformat(str(first)).replace(tzinfo=timezone.utc)
        queued[adapter], oldest[adapter] = count, (now - first).total_seconds() * 1000
    return QueueSnapshot(queued=queued, oldest_wait_ms=oldest)


def claim_batch(session: Session, plan: BatchPlan, worker: str, lease_s: float) -> tuple[Batch, list[Job]]:
    """Move up to `plan.limit` queued jobs of the planned adapters to `running`, atomically.

    The batch row is written first, so on SQLite this transaction already holds the write lock before it
    reads; on PostgreSQL `FOR UPDATE SKIP LOCKED` lets concurrent workers take disjoint rows. (A single
    UPDATE ... IN (SELECT ... LIMIT) is not enough there: the planner may run the subquery more than once.)"""
    now = _now()
    batch = Batch(id=uuid.uuid4(), adapters=",".join(plan.adapters), mixed=plan.mixed, worker=worker, started_at=now)
    session.add(batch)
    session.flush()
    ids = session.scalars(
        select(Job.id)
        .where(Job.status == JobStatus.QUEUED, Job.adapter.in_(plan.adapters))
        .order_by(Job.created_at, Job.id)
        .limit(plan.limit)
        .with_for_update(skip_locked=True)
    ).all()
    jobs = session.scalars(
        update(Job)
        .where(Job.id.in_(ids), Job.status == JobStatus.QUEUED)
        .values(status=JobStatus.RUNNING, batch_id=batch.id, lease_owner=worker,
                lease_expires_at=now + timedelta(seconds=lease_s), started_at=now, attempts=Job.attempts + 1)
        .returning(Job),
        execution_options={"synchronize_session": False},
    ).all()
    batch.size = len(jobs)
    if not jobs:  # another worker was faster: leave no empty batch behind
        session.delete(batch)
    return batch, sorted(jobs, key=lambda j: (j.created_at, str(j.id)))


def renew_leases(session: Session, batch_id: uuid.UUID, lease_s: float) -> int:
    return session.execute(
        update(Job).where(Job.batch_id == batch_id, Job.status == JobStatus.RUNNING)
        .values(lease_expires_at=_now() + timedelta(seconds=lease_s))
    ).rowcount


def requeue_expired(session: Session, max_attempts: int) -> list[uuid.UUID]:
    """Jobs whose worker stopped renewing their lease (killed mid-batch) go back to the queue, unless
    they have already been tried `max_attempts` times: a job that kills its worker must not loop."""
    now = _now()
    expired = (Job.status == JobStatus.RUNNING, Job.lease_expires_at < now)
    session.execute(
        update(Job).where(*expired, Job.attempts >= max_attempts)
        .values(status=JobStatus.FAILED, error_code="internal", finished_at=now, lease_owner=None,
                lease_expires_at=None,
                error_message=f"the worker stopped {max_attempts} times while running this job")
    )
    return list(session.scalars(
        update(Job).where(*expired)
        .values(status=JobStatus.QUEUED, lease_owner=None, lease_expires_at=None)
        .returning(Job.id)
    ).all())


def stale_queued_adapters(session: Session, older_than_s: float) -> list[str]:
    """Adapters with queued jobs waiting longer than `older_than_s` (their wake-up may be lost)."""
    cutoff = _now() - timedelta(seconds=older_than_s)
    return list(session.scalars(
        select(Job.adapter).where(Job.status == JobStatus.QUEUED, Job.created_at < cutoff).distinct()
    ).all())


@dataclass
class JobOutcome:
    status: str  # succeeded | failed
    result_text: str | None = None
    decision: dict[str, Any] | None = None
    error_code: str | None = None
    error_message: str | None = None
    switch_ms: float | None = None
    prefill_ms: float | None = None
    decode_ms: float | None = None
    first_token_ms: float | None = None  # from the start of its batch to its first token
    prompt_tokens: int | None = None
    completion_tokens: int | None = None


def finish_job(session: Session, job: Job, batch_id: uuid.UUID, outcome: JobOutcome) -> bool:
    """Write the outcome only if this batch still holds the job's lease: a job re-run after a lease
    expiry can never end up with two results. Returns False when the lease was lost."""
    now = _now()
    queue_ms = (job.started_at - job.created_at).total_seconds() * 1000
    return session.execute(
        update(Job)
        .where(Job.id == job.id, Job.batch_id == batch_id, Job.status == JobStatus.RUNNING)
        .values(
            status=outcome.status, result_text=outcome.result_text, decision=outcome.decision,
            error_code=outcome.error_code, error_message=outcome.error_message,
            switch_ms=outcome.switch_ms, prefill_ms=outcome.prefill_ms, decode_ms=outcome.decode_ms,
            prompt_tokens=outcome.prompt_tokens, completion_tokens=outcome.completion_tokens,
            queue_ms=queue_ms,
            ttft_ms=None if outcome.first_token_ms is None else queue_ms + outcome.first_token_ms,
            total_ms=(now - job.created_at).total_seconds() * 1000,
            finished_at=now, lease_owner=None, lease_expires_at=None,
        )
    ).rowcount == 1
