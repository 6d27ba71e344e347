"""Deleting stored jobs and files in the caller's write transaction, giving their bytes back to their keys
(shared/usage.py). Used by `DELETE /v1/jobs/{id}`, `DELETE /v1/files/{id}`, `DELETE /v1/batches/{id}` and the
retention sweep (api/retention.py); a file's bytes on disk go once the transaction has committed (the caller's)."""

from __future__ import annotations

import uuid

from sqlalchemy import ColumnElement, delete, select
from sqlalchemy.orm import Session

from shared import usage
from shared.models import Job, StoredFile


def delete_jobs(session: Session, *where: ColumnElement[bool]) -> list[uuid.UUID]:
    """Delete the jobs `where` selects with their `auto` stages; returns the ids of those selected."""
    chosen = select(Job.id).where(*where).scalar_subquery()
    stages = session.execute(delete(Job).where(Job.parent_job_id.in_(chosen))
                             .returning(Job.api_key_id, Job.stored_bytes)).all()
    deleted = session.execute(delete(Job).where(*where).returning(Job.id, Job.api_key_id, Job.stored_bytes)).all()
    usage.give_back(session, [(key_id, size) for key_id, size in stages])
    usage.give_back(session, [(key_id, size) for _, key_id, size in deleted])
    return [job_id for job_id, _, _ in deleted]


def delete_files(session: Session, *where: ColumnElement[bool]) -> list[uuid.UUID]:
    """Delete the file rows `where` selects; returns their ids, whose bytes the caller removes after the commit."""
    deleted = session.execute(delete(StoredFile).where(*where)
                              .returning(StoredFile.id, StoredFile.api_key_id, StoredFile.bytes)).all()
    usage.give_back(session, [(key_id, size) for _, key_id, size in deleted])
    return [file_id for file_id, _, _ in deleted]
