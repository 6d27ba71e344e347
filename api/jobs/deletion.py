"""Deleting stored jobs in the caller's write transaction, with their `auto` stages, giving their bytes back to their
keys (shared/usage.py). Used by `DELETE /v1/jobs/{id}`, `DELETE /v1/responses/{id}`, `DELETE /v1/batches/{id}` and
the retention sweep (api/batch/retention.py)."""

from __future__ import annotations

import uuid

from sqlalchemy import ColumnElement, delete, select
from sqlalchemy.orm import Session

from shared import usage
from shared.models import Job


def delete_jobs(session: Session, *where: ColumnElement[bool]) -> list[uuid.UUID]:
    """Delete the jobs `where` selects with their `auto` stages; returns the ids of those selected."""
    chosen = select(Job.id).where(*where).scalar_subquery()
    stages = session.execute(delete(Job).where(Job.parent_job_id.in_(chosen))
                             .returning(Job.api_key_id, Job.stored_bytes)).all()
    deleted = session.execute(delete(Job).where(*where).returning(Job.id, Job.api_key_id, Job.stored_bytes)).all()
    usage.give_back(session, [(key_id, size) for key_id, size in stages])
    usage.give_back(session, [(key_id, size) for _, key_id, size in deleted])
    return [job_id for job_id, _, _ in deleted]
