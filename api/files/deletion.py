"""Deleting stored file rows in the caller's write transaction, giving their bytes back to their keys
(shared/usage.py). Used by `DELETE /v1/files/{id}`, `DELETE /v1/batches/{id}`, the batch keeper's expiry and the
retention sweep (api/batch/retention.py); a file's bytes on disk go once the transaction has committed (the
caller's: `FileStore.remove`)."""

from __future__ import annotations

import uuid

from sqlalchemy import ColumnElement, delete
from sqlalchemy.orm import Session

from shared import usage
from shared.models import StoredFile


def delete_files(session: Session, *where: ColumnElement[bool]) -> list[uuid.UUID]:
    """Delete the file rows `where` selects; returns their ids, whose bytes the caller removes after the commit."""
    deleted = session.execute(delete(StoredFile).where(*where)
                              .returning(StoredFile.id, StoredFile.api_key_id, StoredFile.bytes)).all()
    usage.give_back(session, [(key_id, size) for _, key_id, size in deleted])
    return [file_id for file_id, _, _ in deleted]
