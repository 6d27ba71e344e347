"""What each API key stores: its `key_usage` row, kept in step with the rows it counts (docs/architecture.md §16).

A key's stored bytes are the sum of its jobs' `stored_bytes` (each job's request when stored, plus its result once
finished) and of its files' bytes. Whatever stores or deletes such a row calls `charge` in the same transaction;
the charges of a transaction are written just before it commits, one upsert per key in key order, so two
transactions never wait for each other's usage rows in opposite orders (PostgreSQL), and an admission that locked
a key's row (`lock`) sees every committed charge of that key."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable, Mapping
from typing import Any

from sqlalchemy import event, func, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from shared.models import AdapterAssignment, Job, JobStatus, KeyUsage, Priority
from shared.settings import ADAPTERS

_PENDING = "kevlaya.usage_charges"
REQUEST_FIELDS = ("input", "params", "meta", "idempotency_key", "response_request")
RESULT_FIELDS = ("result_text", "decision", "logprobs", "error_message")


def _size(value: Any) -> int:
    if value is None:
        return 0
    if isinstance(value, str):
        return len(value.encode())
    return len(json.dumps(value))  # as the JSON column stores it


def request_bytes(values: Mapping[str, Any]) -> int:
    """The bytes a new job's row stores for its request (input, params, metadata, idempotency key)."""
    return sum(_size(values.get(field)) for field in REQUEST_FIELDS)


def result_bytes(values: Mapping[str, Any]) -> int:
    """The bytes a finished job's row stores for its outcome (text, decision, log-probabilities, error message)."""
    return sum(_size(values.get(field)) for field in RESULT_FIELDS)


def charge(session: Session, key_id: uuid.UUID | None, delta: int) -> None:
    """Add `delta` bytes (negative: given back) to the key's usage when this transaction commits."""
    if key_id is None or not delta:
        return
    pending: dict[uuid.UUID, int] = session.info.setdefault(_PENDING, {})
    pending[key_id] = pending.get(key_id, 0) + delta


def give_back(session: Session, rows: Iterable[tuple[uuid.UUID | None, int]]) -> None:
    """Charge back what deleted rows (`(api_key_id, bytes)`, from a DELETE … RETURNING) charged."""
    for key_id, size in rows:
        charge(session, key_id, -int(size or 0))


def _upsert(session: Session) -> Any:
    return (postgresql.insert if session.get_bind().dialect.name == "postgresql" else sqlite.insert)(KeyUsage)


def lock(session: Session, key_ids: Iterable[uuid.UUID]) -> dict[uuid.UUID, KeyUsage]:
    """The keys' usage rows, made if missing and locked (`FOR UPDATE` on PostgreSQL; on SQLite the caller holds
    the one write lock) until this transaction ends, in key order."""
    ordered = sorted(set(key_ids))
    if not ordered:
        return {}
    session.execute(_upsert(session).values([{"api_key_id": key_id} for key_id in ordered])
                    .on_conflict_do_nothing(index_elements=["api_key_id"]))
    rows = session.scalars(select(KeyUsage).where(KeyUsage.api_key_id.in_(ordered)).order_by(KeyUsage.api_key_id)
                           .with_for_update().execution_options(populate_existing=True)).all()
    return {row.api_key_id: row for row in rows}


def queued_jobs(session: Session, key_id: uuid.UUID) -> int:
    """The key's interactive jobs waiting in the queue (batch lines are bounded by their files instead). Every role
    is named, so that the claim index is read (status, adapter, priority, key) rather than all queued jobs."""
    roles = {*ADAPTERS, *session.scalars(select(AdapterAssignment.role))}
    return session.scalar(select(func.count()).select_from(Job).where(
        Job.status == JobStatus.QUEUED, Job.adapter.in_(sorted(roles)), Job.priority == Priority.INTERACTIVE,
        Job.api_key_id == key_id)) or 0


def stored_bytes(session: Session, key_id: uuid.UUID) -> int:
    """The key's stored bytes as committed (no lock: a snapshot)."""
    return session.scalar(select(KeyUsage.stored_bytes).where(KeyUsage.api_key_id == key_id)) or 0


@event.listens_for(Session, "before_commit")
def _write_charges(session: Session) -> None:
    pending: dict[uuid.UUID, int] | None = session.info.pop(_PENDING, None)
    if not pending:
        return
    for key_id in sorted(pending):
        if pending[key_id]:
            upsert = _upsert(session).values(api_key_id=key_id, stored_bytes=pending[key_id])
            session.execute(upsert.on_conflict_do_update(
                index_elements=["api_key_id"],
                set_={"stored_bytes": KeyUsage.stored_bytes + upsert.excluded.stored_bytes}))


@event.listens_for(Session, "after_transaction_end")
def _forget_charges(session: Session, transaction: Any) -> None:
    if transaction.parent is None:  # rolled back or closed: its charges never happened
        session.info.pop(_PENDING, None)
