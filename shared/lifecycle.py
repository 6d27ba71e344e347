"""Every change of a job's status, in one place (docs/architecture.md §3).

    queued  → running            claim (with a lease)
    queued  → cancelled          cancel (a file batch's lines: cancelled or expired with it)
    running → succeeded | failed finish, while the finishing batch still holds the lease
    running → queued | failed    lease expired (the worker died), failed once `max_attempts` is reached
    running → queued             release: the worker gives a job back unrun (not counted as an attempt)
    running → running            escalate: an `auto` job gives up its lease and waits for its Kev stage

A stage that reaches a final state settles its `auto` parent in the same transaction, whatever path it took
there (a finished batch, a failed batch, an expired lease). `repair` finds the jobs no path will touch again
(running without a lease, parents waiting on a finished stage) and settles or re-queues them.

Each final state is announced on Redis after its transaction commits (`shared.notify`), so waiters wake up.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import ColumnElement, and_, case, event, exists, literal, or_, select, update
from sqlalchemy.orm import InstrumentedAttribute, Session, aliased

from shared import usage
from shared.clock import db_now, elapsed_ms
from shared.models import Job, JobStatus, UTCDateTime
from shared.notify import publish_finished

log = logging.getLogger("kevlaya.lifecycle")

QUEUED, RUNNING = JobStatus.QUEUED, JobStatus.RUNNING
SUCCEEDED, FAILED, CANCELLED = JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED

TRANSITIONS: dict[str, frozenset[str]] = {
    QUEUED: frozenset({RUNNING, CANCELLED}),
    RUNNING: frozenset({SUCCEEDED, FAILED, QUEUED, RUNNING}),
    SUCCEEDED: frozenset(),
    FAILED: frozenset(),
    CANCELLED: frozenset(),
}

_FINISHED_KEY = "kevlaya.finished_jobs"


class IllegalTransition(ValueError):
    """A status change the state machine does not allow (a bug in the caller)."""


@dataclass
class JobOutcome:
    status: str  # succeeded | failed
    result_text: str | None = None
    decision: dict[str, Any] | None = None
    error_code: str | None = None
    error_message: str | None = None
    finish_reason: str | None = None  # stop | length, for an answer the model wrote
    logprobs: list[dict[str, Any]] | None = None  # per token, when the job asked for them
    prefill_ms: float | None = None
    decode_ms: float | None = None
    first_token_ms: float | None = None  # from the start of its batch to its first token
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    adapter_version: str | None = None  # the sha256 of the adapter whose weights wrote the answer, if any did


def _not_before(moment: datetime, earlier: InstrumentedAttribute[datetime]) -> ColumnElement[datetime]:
    """`moment`, or the row's `earlier` time where that lies after it. Two processes carry the database's clock
    forward each on its own (shared/clock.py), so the worker's reading can fall a few ms before the API's; a
    job's times must still run in order, and its queue time never be negative."""
    return case((earlier > literal(moment, UTCDateTime()), earlier), else_=literal(moment, UTCDateTime()))


def _move(session: Session, source: str, target: str, *where: ColumnElement[bool], **values: Any) -> list[Job]:
    """One conditional UPDATE `source → target`; returns the rows that moved (none when another writer won)."""
    if target not in TRANSITIONS[source]:
        raise IllegalTransition(f"a job cannot go from {source} to {target}")
    outcome_bytes = usage.result_bytes(values) if target in JobStatus.FINISHED else 0
    if outcome_bytes:  # the outcome is stored on the row: its key is charged for it (shared/usage.py)
        values["stored_bytes"] = Job.stored_bytes + outcome_bytes
    moved = list(session.scalars(
        update(Job).where(Job.status == source, *where).values(status=target, **values).returning(Job),
        execution_options={"synchronize_session": False, "populate_existing": True},
    ).all())
    for job in moved:
        usage.charge(session, job.api_key_id, outcome_bytes)
    if target in JobStatus.FINISHED and moved:
        _announce_after_commit(session, [job.id for job in moved])
        for job in moved:
            if job.parent_job_id is not None:
                settle_parent(session, job.parent_job_id)
    return moved


# -- the transitions ------------------------------------------------------------------------------------------

def claim(session: Session, ids: Iterable[uuid.UUID], batch_id: uuid.UUID, worker: str, lease_s: float) -> list[Job]:
    """queued → running for `ids` still queued, leased to `worker` for `lease_s`."""
    now = db_now(session)
    return _move(session, QUEUED, RUNNING, Job.id.in_(list(ids)),
                 batch_id=batch_id, lease_owner=worker, lease_expires_at=now + timedelta(seconds=lease_s),
                 started_at=_not_before(now, Job.created_at), attempts=Job.attempts + 1)


def finish(session: Session, job: Job, batch_id: uuid.UUID, outcome: JobOutcome) -> bool:
    """running → succeeded | failed, only while `batch_id` holds the lease: a job re-run after its lease
    expired can never end up with two results. False when the lease was lost."""
    if outcome.status not in (SUCCEEDED, FAILED):
        raise IllegalTransition(f"a job cannot finish as {outcome.status}")
    now = max(db_now(session), job.started_at)  # see _not_before
    queue_ms = elapsed_ms(job.started_at, job.created_at)
    return bool(_move(
        session, RUNNING, outcome.status, Job.id == job.id, Job.batch_id == batch_id, Job.lease_owner.is_not(None),
        answered_by=job.adapter, result_text=outcome.result_text, decision=outcome.decision,
        error_code=outcome.error_code, error_message=outcome.error_message, finish_reason=outcome.finish_reason,
        logprobs=outcome.logprobs, adapter_version=outcome.adapter_version,
        prefill_ms=outcome.prefill_ms, decode_ms=outcome.decode_ms,
        prompt_tokens=outcome.prompt_tokens, completion_tokens=outcome.completion_tokens,
        queue_ms=queue_ms,
        ttft_ms=None if outcome.first_token_ms is None else queue_ms + outcome.first_token_ms,
        total_ms=elapsed_ms(now, job.created_at),
        finished_at=now, lease_owner=None, lease_expires_at=None,
    ))


def release(session: Session, ids: Iterable[uuid.UUID], batch_id: uuid.UUID) -> list[uuid.UUID]:
    """running → queued for jobs this batch still holds: the worker dropped their rows to free memory, so the
    attempt does not count. Returns the released."""
    return [job.id for job in _move(session, RUNNING, QUEUED, Job.id.in_(list(ids)), Job.batch_id == batch_id,
                                    Job.lease_owner.is_not(None), lease_owner=None, lease_expires_at=None,
                                    attempts=Job.attempts - 1)]


def escalate(session: Session, parent: Job, batch_id: uuid.UUID) -> bool:
    """running (leased) → running (waiting): the `auto` job gives up its lease, so expiry never re-queues it;
    its Kev stage settles it. False when this batch no longer holds the lease."""
    return bool(_move(session, RUNNING, RUNNING, Job.id == parent.id, Job.batch_id == batch_id,
                      Job.lease_owner.is_not(None), lease_owner=None, lease_expires_at=None))


def cancel(session: Session, job_id: uuid.UUID) -> bool:
    """queued → cancelled. False when the job is no longer queued."""
    return bool(_move(session, QUEUED, CANCELLED, Job.id == job_id,
                      finished_at=_not_before(db_now(session), Job.created_at)))


def cancel_many(session: Session, ids: Iterable[uuid.UUID], error_code: str, error_message: str) -> list[uuid.UUID]:
    """queued → cancelled for those of `ids` still queued, with the reason (a file batch cancelled or expired)."""
    return [job.id for job in _move(session, QUEUED, CANCELLED, Job.id.in_(list(ids)),
                                    finished_at=_not_before(db_now(session), Job.created_at),
                                    error_code=error_code, error_message=error_message)]


def expire_leases(session: Session, max_attempts: int) -> list[uuid.UUID]:
    """Jobs whose worker stopped renewing their lease (killed mid-batch) go back to the queue, unless they
    were tried `max_attempts` times already: a job that kills its worker must not loop. Returns the re-queued."""
    return _requeue_orphans(session, max_attempts, Job.lease_expires_at < db_now(session))


def requeue_dead_owners(session: Session, owners: list[str], max_attempts: int) -> list[uuid.UUID]:
    """The running jobs of lease owners known to be dead (a worker process that is gone) go back to the queue at
    once, as an expired lease would later. Returns the re-queued."""
    return _requeue_orphans(session, max_attempts, Job.lease_owner.in_(owners)) if owners else []


def _requeue_orphans(session: Session, max_attempts: int, orphaned: ColumnElement[bool]) -> list[uuid.UUID]:
    failed = _fail_orphans(session, max_attempts, orphaned)
    if failed:
        log.warning("failed %d job(s) whose worker stopped %d times: %s", len(failed), max_attempts,
                    ", ".join(str(j.id) for j in failed))
    return [job.id for job in _move(session, RUNNING, QUEUED, orphaned, lease_owner=None, lease_expires_at=None)]


def _fail_orphans(session: Session, max_attempts: int, *where: ColumnElement[bool]) -> list[Job]:
    return _move(session, RUNNING, FAILED, *where, Job.attempts >= max_attempts,
                 error_code="internal", finished_at=_not_before(db_now(session), Job.started_at),
                 lease_owner=None, lease_expires_at=None,
                 answered_by=Job.adapter,
                 error_message=f"the worker stopped {max_attempts} times while running this job")


def settle_parent(session: Session, parent_id: uuid.UUID) -> bool:
    """An `auto` job waiting on its Kev stage takes that stage's final state (answered by kev); its timings and
    tokens are the sums over its stages. No-op (False) while the stage is unfinished or the parent is not waiting."""
    stages = session.scalars(
        select(Job).where(Job.parent_job_id == parent_id).order_by(Job.created_at)
        .execution_options(populate_existing=True)
    ).all()
    kev = [s for s in stages if s.adapter == "kev"]
    if not kev or kev[-1].status not in JobStatus.FINISHED:
        return False
    stage = kev[-1]
    status, error_code, error_message = stage.status, stage.error_code, stage.error_message
    if status == CANCELLED:  # a stage cannot be cancelled on its own; should it happen, the answer is missing
        status, error_code, error_message = FAILED, "internal", f"the Kev stage {stage.id} was cancelled"

    def total(field: str) -> float | None:
        values = [getattr(s, field) for s in stages if getattr(s, field) is not None]
        return sum(values) if values else None

    parent = session.scalar(select(Job).where(Job.id == parent_id))
    now = max([db_now(session), parent.created_at] + [s.finished_at for s in stages if s.finished_at])  # _not_before
    # The caller's first token of the answer it gets is the Kev stage's: count from the parent's creation.
    ttft_ms = (None if stage.ttft_ms is None
               else elapsed_ms(stage.created_at, parent.created_at) + stage.ttft_ms)
    settled = _move(
        session, RUNNING, status, Job.id == parent_id, Job.lease_owner.is_(None),
        answered_by=stage.adapter, result_text=stage.result_text, decision=stage.decision, error_code=error_code,
        error_message=error_message,
        finish_reason=stage.finish_reason, logprobs=stage.logprobs, adapter_version=stage.adapter_version,
        finished_at=now, total_ms=elapsed_ms(now, parent.created_at), ttft_ms=ttft_ms,
        prefill_ms=total("prefill_ms"), decode_ms=total("decode_ms"),
        prompt_tokens=total("prompt_tokens"), completion_tokens=total("completion_tokens"),
    )
    if settled:
        log.info("job %s: settled as %s by its Kev stage %s", parent_id, status, stage.id)
    return bool(settled)


@dataclass
class Repair:
    requeued: list[uuid.UUID]
    settled: list[uuid.UUID]


def repair(session: Session, max_attempts: int) -> Repair:
    """The sweeper's check: every `running` job must hold a live lease or wait on an unfinished stage.

    Expired leases are re-queued (or failed at `max_attempts`); a parent whose Kev stage has finished is
    settled; a running job with no lease and nothing to wait for is re-queued (or failed)."""
    requeued = expire_leases(session, max_attempts)
    stage = aliased(Job)
    waiting = and_(Job.status == RUNNING, or_(Job.lease_owner.is_(None), Job.lease_expires_at.is_(None)))
    parents = session.scalars(
        select(Job.id).where(waiting, exists().where(
            stage.parent_job_id == Job.id, stage.adapter == "kev", stage.status.in_(JobStatus.FINISHED)))
    ).all()
    settled = [parent_id for parent_id in parents if settle_parent(session, parent_id)]
    if settled:
        log.warning("settled %d `auto` job(s) left waiting on a finished stage: %s",
                    len(settled), ", ".join(map(str, settled)))
    unfinished_stage = exists().where(stage.parent_job_id == Job.id, stage.status.not_in(JobStatus.FINISHED))
    kev_stage = exists().where(stage.parent_job_id == Job.id, stage.adapter == "kev")
    stranded = (waiting, ~unfinished_stage, ~kev_stage)
    again: list[uuid.UUID] = []
    candidates = session.scalars(select(Job.id).where(*stranded)).all()
    if candidates:
        # Lock, then look again in a new statement: an escalation that was committing meanwhile has added
        # its stages by then (a statement's snapshot would not show them on PostgreSQL).
        locked = session.scalars(select(Job.id).where(Job.id.in_(candidates), waiting).with_for_update()).all()
        confirmed = (Job.id.in_(session.scalars(select(Job.id).where(Job.id.in_(locked), *stranded)).all()),)
        _fail_orphans(session, max_attempts, *confirmed)
        again = [j.id for j in _move(session, RUNNING, QUEUED, *confirmed, lease_owner=None, lease_expires_at=None)]
    if again:
        log.warning("re-queued %d running job(s) that held no lease: %s", len(again), ", ".join(map(str, again)))
    return Repair(requeued=requeued + again, settled=settled)


# -- "job finished" notices, sent only once the transaction that finished the jobs has committed -------------

def _announce_after_commit(session: Session, job_ids: list[uuid.UUID]) -> None:
    session.info.setdefault(_FINISHED_KEY, set()).update(job_ids)


@event.listens_for(Session, "after_commit")
def _publish_finished(session: Session) -> None:
    finished = session.info.pop(_FINISHED_KEY, None)
    if finished:
        publish_finished(finished)


@event.listens_for(Session, "after_rollback")
def _forget_finished(session: Session) -> None:
    session.info.pop(_FINISHED_KEY, None)
