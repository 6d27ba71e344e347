"""What each role should serve, as an admin asked at run time (docs/architecture.md §10): one row per role in
`adapter_assignments`, written by the API's load and unload routes and by `kevlaya models load|unload` after their
checks (shared/adapter_check.py), read by workers at start and every KEVLAYA_MODEL__ADAPTER_POLL_S while they serve.
A role without a row serves its configured adapter; a role under a new name exists from its first load. The row is
the desired state, not what a worker did: a worker killed mid-switch finds it at its next start."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session

from shared.adapter_check import AdapterRefused, CheckedAdapter
from shared.clock import db_now
from shared.models import AdapterAssignment
from shared.settings import ADAPTERS


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


def new_roles(session: Session) -> set[str]:
    """The roles loaded at run time under names other than kev and laya, and not unloaded since."""
    return set(session.scalars(select(AdapterAssignment.role).where(
        AdapterAssignment.role.not_in(ADAPTERS), AdapterAssignment.unloaded.is_(False))))


def is_role(session: Session, name: str) -> bool:
    """Whether `name` is a role: kev, laya, or one ever loaded at run time (an unloaded one is still a role: its
    submits are refused as unloaded, 503, not as unknown)."""
    return name in ADAPTERS or session.get(AdapterAssignment, name) is not None


def unloaded_roles(session: Session) -> set[str]:
    return set(session.scalars(select(AdapterAssignment.role).where(AdapterAssignment.unloaded.is_(True))))


def _row(session: Session, role: str) -> AdapterAssignment:
    row = session.get(AdapterAssignment, role, with_for_update=True)
    if row is None:
        row = AdapterAssignment(role=role, generation=0)
        session.add(row)
    return row


def assign(session: Session, adapter: CheckedAdapter, spare_roles: int) -> int:
    """Record that `adapter.role` should serve `adapter` (a load, or a reload in place); returns its generation.
    A role under a new name takes one of the `spare_roles` blocks each worker keeps (AdapterRefused when none is
    free). In the caller's write (shared/db.py: write_scope)."""
    row = _row(session, adapter.role)
    if adapter.role not in ADAPTERS and (row.unloaded or row.generation == 0):
        held = new_roles(session) - {adapter.role}
        if len(held) >= spare_roles:
            raise AdapterRefused("lora_name", f"no room for another role: {', '.join(sorted(held)) or 'none'} "
                                 f"hold the {spare_roles} spare block(s) a worker keeps (KEVLAYA_MODEL__SPARE_ROLES); "
                                 "unload one first")
    row.path, row.sha256, row.unloaded = str(adapter.path), adapter.sha256, False
    row.generation += 1
    row.requested_at = db_now(session)
    return row.generation


def unload(session: Session, role: str) -> bool:
    """Record that `role` takes no jobs; False when it was unloaded already, or is a new name never loaded (nothing
    changes). In the caller's write."""
    if role not in ADAPTERS and session.get(AdapterAssignment, role) is None:
        return False  # a name never loaded: nothing to unload
    row = _row(session, role)
    if row.unloaded:
        return False
    row.unloaded = True
    row.generation += 1
    row.requested_at = db_now(session)
    return True
