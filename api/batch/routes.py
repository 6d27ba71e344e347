"""`/v1/batches`: OpenAI's Batch API on the durable queue (docs/architecture.md §15).

Creating a batch stores its row (`validating`) and answers at once; the API's batch keeper (api/batch/keeper.py)
stores the lines as jobs, and writes the output and error files when the last line has finished. A key sees
only its own batches."""

from __future__ import annotations

import uuid
from typing import Annotated

from fastapi import APIRouter, Depends, Query
from sqlalchemy import and_, or_, select
from sqlalchemy.orm import Session

from api.batch import file_batches
from api.batch.keeper import BatchKeeperDep
from api.batch.schemas import (
    BATCH_PREFIX,
    BatchCreate,
    BatchDeleted,
    BatchList,
    BatchObject,
    RequestCounts,
    completion_window,
)
from api.files.schemas import FILE_PREFIX
from api.files.store import FileStoreDep
from api.http.deps import SessionDep, reject_unknown_query_parameters
from api.http.errors import AUTH_ERRORS, ApiError, error_responses
from api.keys.auth import CurrentKey
from api.openai.ids import parse_id
from shared.clock import db_now
from shared.db import one_writer
from shared.models import ApiKey, BatchStatus, FileBatch, StoredFile

router = APIRouter(prefix="/v1/batches", tags=["batches"], dependencies=[Depends(reject_unknown_query_parameters)])

def own_batch(session: Session, key: ApiKey, batch_id: str) -> FileBatch:
    row_id = parse_id(BATCH_PREFIX, batch_id)
    row = None if row_id is None else session.scalar(
        select(FileBatch).where(FileBatch.id == row_id, FileBatch.api_key_id == key.id))
    if row is None:
        raise ApiError(404, "not_found", f"batch {batch_id} not found")
    return row


def batch_out(session: Session, row: FileBatch) -> BatchObject:
    return BatchObject.of(row, file_batches.request_counts(session, row))


@router.post("", response_model=BatchObject, responses=error_responses(400, 404, 422, *AUTH_ERRORS))
def create_batch(request: BatchCreate, key: CurrentKey, session: SessionDep, keeper: BatchKeeperDep) -> BatchObject:
    try:
        window = completion_window(request.completion_window)
    except ValueError as exc:
        raise ApiError(422, "invalid_request", f"completion_window: {exc}") from None
    file_id = parse_id(FILE_PREFIX, request.input_file_id)
    source = None if file_id is None else session.scalar(
        select(StoredFile).where(StoredFile.id == file_id, StoredFile.api_key_id == key.id))
    if source is None:
        raise ApiError(404, "not_found", f"input_file_id: file {request.input_file_id} not found")
    if source.purpose != "batch":
        raise ApiError(422, "invalid_request", f"input_file_id: file {request.input_file_id} has purpose "
                       f"{source.purpose}, not batch")
    now = db_now(session)
    row = FileBatch(id=uuid.uuid4(), api_key_id=key.id, status=BatchStatus.VALIDATING, endpoint=request.endpoint,
                    completion_window=request.completion_window, input_file_id=source.id, meta=request.metadata,
                    output_expires_after_s=request.output_expires_after.seconds if request.output_expires_after
                    else None, total=0, created_at=now, expires_at=now + window)
    with one_writer(session):
        session.add(row)
        session.commit()
    keeper.kick()
    return BatchObject.of(row, RequestCounts(total=0, completed=0, failed=0))


@router.get("", response_model=BatchList, responses=error_responses(404, 422, *AUTH_ERRORS))
def list_batches(key: CurrentKey, session: SessionDep,
                 limit: Annotated[int, Query(ge=1, le=100)] = 20,
                 after: Annotated[str | None, Query(min_length=1, description="a batch id: the page starts after it")] = None,
                 ) -> BatchList:
    query = select(FileBatch).where(FileBatch.api_key_id == key.id)
    if after:
        start = own_batch(session, key, after)
        query = query.where(or_(FileBatch.created_at < start.created_at,
                                and_(FileBatch.created_at == start.created_at, FileBatch.id < start.id)))
    rows = session.scalars(query.order_by(FileBatch.created_at.desc(), FileBatch.id.desc()).limit(limit + 1)).all()
    data = [batch_out(session, row) for row in rows[:limit]]
    return BatchList(data=data, first_id=data[0].id if data else None, last_id=data[-1].id if data else None,
                     has_more=len(rows) > limit)


@router.get("/{batch_id}", response_model=BatchObject, responses=error_responses(404, 422, *AUTH_ERRORS))
def get_batch(batch_id: str, key: CurrentKey, session: SessionDep) -> BatchObject:
    return batch_out(session, own_batch(session, key, batch_id))


@router.post("/{batch_id}/cancel", response_model=BatchObject,
             responses=error_responses(404, 409, 422, *AUTH_ERRORS))
def cancel_batch(batch_id: str, key: CurrentKey, session: SessionDep, keeper: BatchKeeperDep) -> BatchObject:
    """Queued lines are cancelled; lines already running finish and keep their answers. The batch is
    `cancelling` until they have, then `cancelled` with its output and error files."""
    row = own_batch(session, key, batch_id)
    if not file_batches.cancel(session, row):
        session.refresh(row)
        if row.status not in (BatchStatus.CANCELLING, BatchStatus.CANCELLED):
            raise ApiError(409, "conflict", f"batch {batch_id} is {row.status}; it can no longer be cancelled")
    session.refresh(row)
    keeper.kick()
    return batch_out(session, row)


@router.delete("/{batch_id}", response_model=BatchDeleted, responses=error_responses(404, 409, 422, *AUTH_ERRORS))
def delete_batch(batch_id: str, key: CurrentKey, session: SessionDep, store: FileStoreDep) -> BatchDeleted:
    """Not in OpenAI's API (its batches are kept): removes a finished batch, its lines' jobs and its output and
    error files, rows and bytes. The input file stays, as the upload it is (DELETE /v1/files/{id})."""
    row = own_batch(session, key, batch_id)
    if row.status not in BatchStatus.FINISHED:
        raise ApiError(409, "conflict", f"batch {batch_id} is {row.status}; cancel it and wait until it is "
                       "cancelled, or until it has finished")
    files = [file_id for file_id in (row.output_file_id, row.error_file_id) if file_id is not None]
    file_batches.delete(session, row)
    for file_id in files:
        store.remove(file_id)
    return BatchDeleted(id=batch_id, deleted=True)
