"""What each role should serve, as an admin asked at run time (docs/architecture.md §10): one row per role in
`adapter_assignments`, written by the API's load and unload routes and by `kevlaya models load|unload` after their
checks (shared/adapter_check.py), read by workers at start and every KEVLAYA_MODEL__ADAPTER_POLL_S while they serve.
A role without a row serves its configured adapter. The row is the desired state, not what a worker did: a worker
killed mid-switch finds it at its next start."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session

from shared.adapter_check import CheckedAdapter
from shared.clock import db_now
from shared.models import AdapterAssignment


@dataclass(frozen=True)
class Desired:
    """A role's desired state, as plain data (a worker compares it with what it serves)."""

    role: str
    path: str | None  # None: the configured adapter
    sha256: str | None
    unloaded: bool
    generation: int


def desired(session: Session) -> dict[str, Desired]:
    return {row.role: Desired(row.role, row.path, row.sha256, row.unloaded, row.generation)
            for row in session.scalars(select(AdapterAssignment))}


def unloaded_roles(session: Session) -> set[str]:
    return set(session.scalars(select(AdapterAssignment.role).where(AdapterAssignment.unloaded.is_(True))))


def _row(session: Session, role: str) -> AdapterAssignment:
    row = session.get(AdapterAssignment, role, with_for_update=True)
    if row is None:
        row = AdapterAssignment(role=role, generation=0)
        session.add(row)
    return row


def assign(session: Session, adapter: CheckedAdapter) -> int:
    """Record that `adapter.role` should serve `adapter` (a load, or a reload in place); returns its generation.
    In the caller's write (shared/db.py: write_scope)."""
    row = _row(session, adapter.role)
    row.path, row.sha256, row.unloaded = str(adapter.path), adapter.sha256, False
    row.generation += 1
    row.requested_at = db_now(session)
    return row.generation


def unload(session: Session, role: str) -> bool:
    """Record that `role` takes no jobs; False when it was unloaded already (nothing changes). In the caller's
    write."""
    row = _row(session, role)
    if row.unloaded:
        return False
    row.unloaded = True
    row.generation += 1
    row.requested_at = db_now(session)
    return True
