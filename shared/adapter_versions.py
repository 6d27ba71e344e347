"""The adapter versions workers loaded, in `adapter_versions` (docs/architecture.md §10): one row per name and
version, however often it is loaded again. Every job stores the version that answered it (`jobs.adapter_version`);
`/v1/models` shows each adapter's version loaded last."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from shared.adapter_identity import AdapterIdentity
from shared.clock import db_now
from shared.models import AdapterVersion


def record_loaded(session: Session, adapters: Iterable[AdapterIdentity]) -> None:
    """Insert each version not recorded yet; one recorded before keeps its row and gets this load's time."""
    now = db_now(session)
    insert: Any = postgresql.insert if session.get_bind().dialect.name == "postgresql" else sqlite.insert
    for adapter in adapters:
        row = insert(AdapterVersion).values(
            name=adapter.name, sha256=adapter.sha256, rank=adapter.rank, target_modules=adapter.target_modules,
            base=adapter.base, calibrated=adapter.calibrated, first_loaded_at=now, loaded_at=now)
        session.execute(row.on_conflict_do_update(index_elements=["name", "sha256"],
                                                  set_={"loaded_at": row.excluded.loaded_at}))


def last_loaded(session: Session) -> dict[str, AdapterVersion]:
    """Each adapter name's version loaded last (by any worker)."""
    newest = (select(AdapterVersion.name, func.max(AdapterVersion.loaded_at).label("loaded_at"))
              .group_by(AdapterVersion.name).subquery())
    rows = session.scalars(select(AdapterVersion).join(
        newest, (AdapterVersion.name == newest.c.name) & (AdapterVersion.loaded_at == newest.c.loaded_at)))
    return {row.name: row for row in rows}
