"""The job ledger as the worker sees it: snapshot the queue, claim a batch atomically with a lease,
renew leases; every status change itself goes through `shared.lifecycle` (docs/architecture.md §3)."""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta, timezone

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from shared import lifecycle
from shared.lifecycle import JobOutcome
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
    jobs = lifecycle.claim(session, ids, batch.id, worker, lease_s)
    batch.size = len(jobs)
    if not jobs:  # another worker was faster: leave no empty batch behind
        session.delete(batch)
    return batch, sorted(jobs, key=lambda j: (j.created_at, str(j.id)))


def renew_leases(session: Session, batch_id: uuid.UUID, lease_s: float) -> int:
    return session.execute(
        update(Job).where(Job.batch_id == batch_id, Job.status == JobStatus.RUNNING, Job.lease_owner.is_not(None))
        .values(lease_expires_at=_now() + timedelta(seconds=lease_s))
    ).rowcount


def requeue_expired(session: Session, max_attempts: int) -> list[uuid.UUID]:
    """Jobs whose worker stopped renewing their lease go back to the queue (or fail at `max_attempts`)."""
    return lifecycle.expire_leases(session, max_attempts)


def stale_queued_adapters(session: Session, older_than_s: float) -> list[str]:
    """Adapters with queued jobs waiting longer than `older_than_s` (their wake-up may be lost)."""
    cutoff = _now() - timedelta(seconds=older_than_s)
    return list(session.scalars(
        select(Job.adapter).where(Job.status == JobStatus.QUEUED, Job.created_at < cutoff).distinct()
    ).all())


def finish_job(session: Session, job: Job, batch_id: uuid.UUID, outcome: JobOutcome) -> bool:
    """Write the outcome only if this batch still holds the job's lease (and settle an `auto` parent);
    False when the lease was lost."""
    return lifecycle.finish(session, job, batch_id, outcome)
