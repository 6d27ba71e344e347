"""The Files API's objects, field for field as OpenAI's API reference defines them, so the official client parses
them (docs/architecture.md §15). Ids carry OpenAI's prefix (api/openai/ids.py); the rows keep plain UUIDs."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel

from api.openai.ids import public_id
from shared.models import StoredFile

FILE_PREFIX = "file-"


def epoch(value: datetime | None) -> int | None:
    """A time as OpenAI's objects give it: Unix seconds."""
    return None if value is None else int(value.timestamp())


class FileObject(BaseModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    expires_at: int | None
    filename: str
    purpose: Literal["batch", "batch_output"]
    status: Literal["processed"] = "processed"  # deprecated by OpenAI; a stored file is always whole here
    status_details: None = None

    @classmethod
    def of(cls, row: StoredFile) -> FileObject:
        return cls(id=public_id(FILE_PREFIX, row.id), bytes=row.bytes, created_at=epoch(row.created_at),
                   expires_at=epoch(row.expires_at), filename=row.filename, purpose=row.purpose)


class FileList(BaseModel):
    object: Literal["list"] = "list"
    data: list[FileObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool
