"""`/v1/files`: OpenAI's Files API for batch input, output and error files (docs/architecture.md §15).

A key sees only its own files. An upload is streamed to disk (never held in memory) and stored under the
service's own id; the client's file name is only shown back."""

from __future__ import annotations

import errno
import logging
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import FileResponse
from sqlalchemy import and_, or_, select
from sqlalchemy.orm import Session

from api.files.deletion import delete_files
from api.files.names import content_disposition, shown_name
from api.files.schemas import FILE_PREFIX, FileDeleted, FileList, FileObject
from api.files.store import FileStore, FileStoreDep, Received, TooLarge
from api.files.upload import read_form
from api.http.deps import SessionDep, SettingsDep, reject_unknown_query_parameters
from api.http.errors import AUTH_ERRORS, RETRY_AFTER_S, ApiError, error_responses
from api.keys.auth import CurrentKey
from api.keys.quotas import Admission, stored_limit, uploads_in_flight
from api.openai.ids import parse_id
from shared.db import new_session, one_writer
from shared.models import ApiKey, BatchStatus, FileBatch, KeyUsage, StoredFile
from shared.settings import Settings

router = APIRouter(prefix="/v1/files", tags=["files"], dependencies=[Depends(reject_unknown_query_parameters)])

log = logging.getLogger("kevlaya.api")

FORM_FIELDS = ("file", "purpose", "expires_after[anchor]", "expires_after[seconds]")

_UPLOAD_BODY = {"requestBody": {"required": True, "content": {"multipart/form-data": {"schema": {
    "type": "object", "required": ["file", "purpose"], "properties": {
        "file": {"type": "string", "format": "binary", "description": "JSONL, one request per line"},
        "purpose": {"type": "string", "enum": ["batch"]},
        "expires_after[anchor]": {"type": "string", "enum": ["created_at"]},
        "expires_after[seconds]": {"type": "integer", "minimum": 3600, "maximum": 2592000},
    }}}}}}


def own_file(session: Session, key: ApiKey, file_id: str) -> StoredFile:
    row_id = parse_id(FILE_PREFIX, file_id)
    row = None if row_id is None else session.scalar(
        select(StoredFile).where(StoredFile.id == row_id, StoredFile.api_key_id == key.id))
    if row is None:
        raise ApiError(404, "not_found", f"file {file_id} not found")
    return row


@contextmanager
def storage_errors() -> Iterator[None]:
    """A full disk (or quota) under the files directory: 503 with Retry-After; what was written is removed."""
    try:
        yield
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        log.error("upload refused: the files directory is full (%s)", exc)
        raise ApiError(503, "storage_full", "no space left to store the file; nothing was stored, retry later",
                       headers={"Retry-After": RETRY_AFTER_S}) from None


def _expiry(form_value: object, anchor: object) -> int | None:
    if form_value is None and anchor is None:
        return None
    if anchor != "created_at":
        raise ApiError(422, "invalid_request", "expires_after[anchor]: only created_at")
    if not isinstance(form_value, str) or not form_value.isdigit() or not 3600 <= int(form_value) <= 2_592_000:
        raise ApiError(422, "invalid_request", "expires_after[seconds]: a whole number from 3600 to 2592000")
    return int(form_value)


def _remaining(key: ApiKey, settings: Settings) -> int:
    """What the key may still store as its stored bytes stand now, less its other uploads arriving in this process:
    an upload stops as soon as it passes this (the storing transaction checks again, exactly)."""
    with new_session() as session:
        row = session.get(KeyUsage, key.id)
        stored = row.stored_bytes if row is not None else 0
    return stored_limit(row, settings) - stored - uploads_in_flight.of(key.id)


class QuotaCountedUpload:
    """The sink of one upload: its bytes go to a file under the files directory's tmp/ as they arrive, counted
    against the file limits and the key's stored-bytes quota (413 at the chunk that passes either)."""

    def __init__(self, key: ApiKey, store: FileStore, settings: Settings, remaining: int):
        self.key, self.remaining = key, remaining
        self.incoming = store.incoming(settings.batch.files_max_bytes, settings.batch.files_max_lines)

    def write(self, data: bytes) -> None:
        if self.incoming.bytes + len(data) > self.remaining:
            raise ApiError(413, "storage_quota_exceeded",
                           f"file: over this key's stored-bytes quota after {self.incoming.bytes + len(data)} bytes: "
                           f"it could store {max(self.remaining, 0)} more when the upload began "
                           "(KEVLAYA_QUOTAS__STORED_BYTES_PER_KEY, or the key's own, less its jobs, files and uploads "
                           "in progress); nothing was stored")
        try:
            self.incoming.write(data)
        except TooLarge as exc:
            raise ApiError(413, "payload_too_large", str(exc)) from None
        uploads_in_flight.add(self.key.id, len(data))

    def discard(self) -> None:
        uploads_in_flight.add(self.key.id, -self.incoming.bytes)
        self.incoming.discard()


def _store(key: ApiKey, received: Received, filename: str, expires_s: int | None, settings: Settings,
           store: FileStore) -> StoredFile:
    """The file row and its bytes in place, if the key's quota holds them (checked with its usage row locked)."""
    row = StoredFile(id=uuid.uuid4(), api_key_id=key.id, purpose="batch", filename=filename, bytes=received.bytes,
                     lines=received.lines, created_at=datetime.now(timezone.utc))
    if expires_s is not None:
        row.expires_at = row.created_at + timedelta(seconds=expires_s)
    with new_session() as session, one_writer(session):
        if refused := Admission(session, [key.id], settings).take_bytes(key.id, received.bytes, "file"):
            raise refused
        session.add(row)
        session.flush()
        store.keep(received.path, row.id)
        try:
            session.commit()
        except BaseException:
            store.remove(row.id)
            raise
        session.refresh(row)
        session.expunge(row)
    return row


@router.post("", response_model=FileObject, openapi_extra=_UPLOAD_BODY,
             responses=error_responses(400, 413, 422, *AUTH_ERRORS))
async def upload_file(request: Request, key: CurrentKey, session: SessionDep, settings: SettingsDep,
                      store: FileStoreDep) -> FileObject:
    """Upload a JSONL file of batch requests (multipart: `file`, `purpose=batch`). Its bytes go straight into the
    files directory as they arrive; past a limit or the key's quota the upload stops there (413)."""
    session.close()  # an upload can take a while: hold no pooled connection meanwhile
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise ApiError(422, "invalid_request", "body: multipart/form-data with the fields file and purpose")
    remaining = await run_in_threadpool(_remaining, key, settings)
    upload: QuotaCountedUpload | None = None

    def open_sink() -> QuotaCountedUpload:
        nonlocal upload
        upload = QuotaCountedUpload(key, store, settings, remaining)
        return upload

    with storage_errors():
        try:
            form = await read_form(request, FORM_FIELDS, "file", open_sink)
            if form.fields.get("purpose") != "batch":
                raise ApiError(422, "invalid_request", "purpose: only batch (files here are batch input)")
            if upload is None:
                raise ApiError(422, "invalid_request", "file: missing, or not a file part")
            expires_s = _expiry(form.fields.get("expires_after[seconds]"), form.fields.get("expires_after[anchor]"))
            received = await run_in_threadpool(upload.incoming.finish)
            row = await run_in_threadpool(_store, key, received, shown_name(form.filename), expires_s, settings,
                                          store)
        finally:
            if upload is not None:
                upload.discard()  # the file, unless it was kept (renamed into place), and its place in flight
    return FileObject.of(row)


@router.get("", response_model=FileList, responses=error_responses(400, 404, 422, *AUTH_ERRORS))
def list_files(key: CurrentKey, session: SessionDep,
               purpose: Annotated[Literal["batch", "batch_output"] | None, Query()] = None,
               limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000,
               order: Annotated[Literal["asc", "desc"], Query()] = "desc",
               after: Annotated[str | None, Query(min_length=1, description="a file id: the page starts after it")] = None,
               ) -> FileList:
    query = select(StoredFile).where(StoredFile.api_key_id == key.id)
    if purpose:
        query = query.where(StoredFile.purpose == purpose)
    newer = order == "asc"
    if after:
        start = own_file(session, key, after)
        query = query.where(or_(
            (StoredFile.created_at > start.created_at) if newer else (StoredFile.created_at < start.created_at),
            and_(StoredFile.created_at == start.created_at,
                 (StoredFile.id > start.id) if newer else (StoredFile.id < start.id))))
    keys = (StoredFile.created_at, StoredFile.id) if newer else (StoredFile.created_at.desc(), StoredFile.id.desc())
    rows = session.scalars(query.order_by(*keys).limit(limit + 1)).all()
    data = [FileObject.of(row) for row in rows[:limit]]
    return FileList(data=data, first_id=data[0].id if data else None, last_id=data[-1].id if data else None,
                    has_more=len(rows) > limit)


@router.get("/{file_id}", response_model=FileObject, responses=error_responses(404, 422, *AUTH_ERRORS))
def get_file(file_id: str, key: CurrentKey, session: SessionDep) -> FileObject:
    return FileObject.of(own_file(session, key, file_id))


@router.get("/{file_id}/content", response_class=FileResponse,
            responses={200: {"content": {"application/octet-stream": {}}, "description": "the file's bytes"},
                       **error_responses(404, 422, *AUTH_ERRORS)})
def file_content(file_id: str, key: CurrentKey, session: SessionDep, store: FileStoreDep) -> FileResponse:
    row = own_file(session, key, file_id)
    path = store.path(row.id)
    if not path.is_file():
        raise ApiError(404, "not_found", f"file {file_id}: its content is gone from the files directory")
    # the name is shown again as it would be now: rows stored before names were cleaned hold any text
    return FileResponse(path, media_type="application/octet-stream",
                        headers={"Content-Disposition": content_disposition(row.filename)})


@router.delete("/{file_id}", response_model=FileDeleted, responses=error_responses(404, 409, 422, *AUTH_ERRORS))
def delete_file(file_id: str, key: CurrentKey, session: SessionDep, store: FileStoreDep) -> FileDeleted:
    row = own_file(session, key, file_id)
    reading = session.scalar(select(FileBatch.id).where(FileBatch.input_file_id == row.id,
                                                        FileBatch.status == BatchStatus.VALIDATING).limit(1))
    if reading is not None:
        raise ApiError(409, "conflict", f"file {file_id} is the input of a batch being validated; delete it once "
                       "the batch is in progress")
    with one_writer(session):
        delete_files(session, StoredFile.id == row.id)
        session.commit()
    store.remove(row.id)
    return FileDeleted(id=file_id, deleted=True)
