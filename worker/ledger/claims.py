"""The job ledger as the worker sees it: snapshot the queue, claim jobs atomically with a lease, renew leases,
record a claim group's figures; every status change itself goes through `shared.lifecycle` (docs/architecture.md
§3)."""

from __future__ import annotations

import os
import socket
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from shared import lifecycle
from shared.clock import db_now, elapsed_ms
from shared.models import ApiKey, ClaimGroup, Job, JobStatus, Priority
from worker.ledger.fair_share import KeyQueue, KeyTurns, share_slots

MIN_WEIGHT = 0.01  # a weight set to 0 by hand in the database still gets a turn now and then


def worker_name() -> str:
    """This process as a lease owner and in heartbeats: host:pid."""
    return f"{socket.gethostname()}:{os.getpid()}"


def dead_owners_here(session: Session) -> list[str]:
    """Lease owners of running jobs that were processes of this host and are gone (a killed worker or pool child):
    their leases need not be waited out. A pid taken again by another process reads as alive: its jobs wait for
    their leases, as before."""
    prefix = f"{socket.gethostname()}:"
    owners = session.scalars(select(Job.lease_owner).where(Job.status == JobStatus.RUNNING,
                                                           Job.lease_owner.startswith(prefix)).distinct()).all()
    return [owner for owner in owners if not _alive(int(owner.removeprefix(prefix)))]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


@dataclass(frozen=True)
class QueueSnapshot:
    """What is waiting, per adapter: how many interactive jobs and how long the oldest has waited, and how many
    lines of file batches (they wait behind the interactive jobs, so their waits set no bound)."""

    queued: dict[str, int]
    oldest_wait_ms: dict[str, float]
    batch_lines: dict[str, int] = field(default_factory=dict)

    def waiting(self) -> list[str]:
        """Adapters with interactive jobs queued, the longest-waiting first."""
        return sorted((a for a, n in self.queued.items() if n > 0), key=lambda a: -self.oldest_wait_ms[a])

    def has_work(self) -> bool:
        return any(self.queued.values()) or any(self.batch_lines.values())


@dataclass(frozen=True)
class GroupFigures:
    """What a claim group's `batches` row records once its last job is stored."""

    prefill_ms: float
    decode_ms: float
    tokens: int
    peak_vram_bytes: int | None


def queue_snapshot(session: Session, now: datetime | None = None) -> QueueSnapshot:
    now = now or db_now(session)
    rows = session.execute(
        select(Job.adapter, Job.priority, func.count(), func.min(Job.created_at))
        .where(Job.status == JobStatus.QUEUED).group_by(Job.adapter, Job.priority)
    ).all()
    queued, oldest, batch_lines = {}, {}, {}
    for adapter, priority, count, first in rows:
        if priority != Priority.INTERACTIVE:
            batch_lines[adapter] = batch_lines.get(adapter, 0) + count
            continue
        queued[adapter], oldest[adapter] = count, elapsed_ms(now, _aware(first))
    return QueueSnapshot(queued=queued, oldest_wait_ms=oldest, batch_lines=batch_lines)


def claim_group(session: Session, adapter: str, limit: int, worker: str, lease_s: float,
                turns: KeyTurns | None = None, spare: int = 0) -> tuple[ClaimGroup, list[Job]]:
    """Move up to `limit` queued jobs of `adapter` to `running`, atomically, as one claim group: interactive jobs
    first, then the lines of file batches, and within each the keys in turn (`fair_share.share_slots`), each
    key's oldest jobs first. `turns` is this worker's memory of whom it served last (None: ties go to the oldest
    job); `spare` of the `limit` slots are only for keys that hold none.

    The group's row is written first, so on SQLite this transaction already holds the write lock before it
    reads; on PostgreSQL `FOR UPDATE SKIP LOCKED` lets concurrent workers take disjoint rows (a key's jobs another
    worker holds are skipped, and the claim is that much smaller). A single UPDATE ... IN (SELECT ... LIMIT) is
    not enough there: the planner may run the subquery more than once."""
    group = ClaimGroup(id=uuid.uuid4(), adapters=adapter, worker=worker, started_at=db_now(session))
    session.add(group)
    session.flush()
    ids: list[uuid.UUID] = []
    for priority, key, count in share_slots(key_queues(session, adapter), limit, turns, spare):
        ids += session.scalars(
            select(Job.id)
            .where(Job.status == JobStatus.QUEUED, Job.adapter == adapter, Job.priority == priority,
                   Job.api_key_id.is_(None) if key is None else Job.api_key_id == key)
            .order_by(Job.created_at, Job.id)
            .limit(count)
            .with_for_update(skip_locked=True)
        ).all()
    jobs = lifecycle.claim(session, ids, group.id, worker, lease_s)
    group.size = len(jobs)
    if not jobs:  # another worker was faster: leave no empty group behind
        session.delete(group)
    elif turns is not None:
        turns.served({job.api_key_id for job in jobs})
    return group, sorted(jobs, key=lambda j: (j.created_at, str(j.id)))


def claimable(session: Session, adapter: str, limit: int, turns: KeyTurns | None = None, spare: int = 0) -> int:
    """How many jobs `claim_group` would take now, read without writing: a look that would take none (every key
    with queued jobs holds a slot and only spare slots are free) leaves the write lock alone."""
    return sum(n for _, _, n in share_slots(key_queues(session, adapter), limit, turns, spare))


def key_queues(session: Session, adapter: str) -> list[KeyQueue]:
    """Each key's queued jobs of `adapter` per priority, with the slots it holds there (its leased running jobs;
    an `auto` job waiting for its Kev stage holds none) and its weight."""
    queued = session.execute(
        select(Job.api_key_id, Job.priority, func.count(), func.min(Job.created_at))
        .where(Job.status == JobStatus.QUEUED, Job.adapter == adapter).group_by(Job.api_key_id, Job.priority)
    ).all()
    if not queued:
        return []
    held = dict(((key, priority), n) for key, priority, n in session.execute(
        select(Job.api_key_id, Job.priority, func.count())
        .where(Job.status == JobStatus.RUNNING, Job.adapter == adapter, Job.lease_owner.is_not(None))
        .group_by(Job.api_key_id, Job.priority)
    ).all())
    weights = key_weights(session, {key for key, *_ in queued if key is not None})
    return [KeyQueue(priority=priority, key=key, queued=count, held=held.get((key, priority), 0),
                     oldest=_aware(first), weight=max(weights.get(key, 1.0), MIN_WEIGHT))
            for key, priority, count, first in queued]


def key_weights(session: Session, keys: set[uuid.UUID]) -> dict[uuid.UUID, float]:
    """The keys' `share_weight`s that are not 1."""
    if not keys:
        return {}
    return dict(session.execute(
        select(ApiKey.id, ApiKey.share_weight).where(ApiKey.id.in_(keys), ApiKey.share_weight != 1.0)
    ).all())


def _aware(moment: datetime | str) -> datetime:
    """Aggregate results bypass the column type on SQLite: a naive UTC time, or its text."""
    if isinstance(moment, str):
        moment = datetime.fromisoformat(moment)
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=timezone.utc)


def close_group(session: Session, group_id: uuid.UUID, figures: GroupFigures) -> None:
    session.query(ClaimGroup).filter(ClaimGroup.id == group_id).update({
        ClaimGroup.prefill_ms: figures.prefill_ms, ClaimGroup.decode_ms: figures.decode_ms,
        ClaimGroup.tokens: figures.tokens, ClaimGroup.peak_vram_bytes: figures.peak_vram_bytes,
        ClaimGroup.finished_at: db_now(session),
    })


def renew_leases(session: Session, group_id: uuid.UUID, lease_s: float) -> int:
    """Renew the leases of the group's running jobs. Rows another transaction holds are skipped, not waited for
    (PostgreSQL): the result writer is finishing them, and a renewal that locked some rows and waited for the
    writer's while the writer waited for those was a deadlock; a skipped row is renewed at the next turn."""
    held = (select(Job.id).where(Job.batch_id == group_id, Job.status == JobStatus.RUNNING,
                                 Job.lease_owner.is_not(None)).with_for_update(skip_locked=True))
    return session.execute(
        update(Job).where(Job.id.in_(held.scalar_subquery()), Job.status == JobStatus.RUNNING)
        .values(lease_expires_at=db_now(session) + timedelta(seconds=lease_s))
    ).rowcount


def stale_queued_adapters(session: Session, older_than_s: float) -> list[str]:
    """Adapters with queued jobs waiting longer than `older_than_s` (their wake-up may be lost)."""
    cutoff = db_now(session) - timedelta(seconds=older_than_s)
    return list(session.scalars(
        select(Job.adapter).where(Job.status == JobStatus.QUEUED, Job.created_at < cutoff).distinct()
    ).all())
