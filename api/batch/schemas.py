"""The Batch API's objects, field for field as OpenAI's API reference defines them, so the official client parses
them (docs/architecture.md §15). Ids carry OpenAI's prefixes (api/openai/ids.py); the rows keep plain UUIDs."""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field

from api.files.schemas import FILE_PREFIX, epoch
from api.openai.ids import public_id
from shared.models import FileBatch
from shared.schemas import RequestModel, Text
from shared.stats import parse_window

BATCH_PREFIX = "batch_"

BatchEndpoint = Literal["/v1/chat/completions", "/v1/responses"]  # the endpoints a line may call here


MAX_COMPLETION_WINDOW = timedelta(days=7)


def completion_window(value: str) -> timedelta:
    """`24h`, `30s`, `2h`, … up to 7 days; ValueError says what is accepted."""
    window = parse_window(value)
    if window > MAX_COMPLETION_WINDOW:
        raise ValueError(f"{value!r}: at most {MAX_COMPLETION_WINDOW.days}d")
    return window


class ExpiresAfter(RequestModel):
    anchor: Literal["created_at"]
    seconds: int = Field(ge=3600, le=2_592_000, description="one hour to 30 days, as OpenAI allows")


class BatchCreate(RequestModel):
    input_file_id: Annotated[Text, Field(max_length=64)]
    endpoint: BatchEndpoint
    completion_window: Annotated[Text, Field(pattern=r"^[1-9][0-9]*[smhd]$", max_length=12, description=(
        "how long the batch may run: OpenAI's `24h`, or any duration from 1s to 7d (30s, 15m, 2h)"))]
    metadata: dict[Annotated[Text, Field(max_length=64)], Annotated[Text, Field(max_length=512)]] | None = Field(
        default=None, max_length=16)
    output_expires_after: ExpiresAfter | None = Field(default=None, description="when the output and error "
                                                      "files are removed, counted from their creation")


class BatchError(BaseModel):
    code: str
    message: str
    param: str | None = None
    line: int | None = None


class BatchErrors(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchError]


class RequestCounts(BaseModel):
    total: int
    completed: int
    failed: int


class BatchObject(BaseModel):
    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    errors: BatchErrors | None
    input_file_id: str
    completion_window: str
    status: Literal["validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling",
                    "cancelled"]
    output_file_id: str | None
    error_file_id: str | None
    created_at: int
    in_progress_at: int | None
    expires_at: int | None
    finalizing_at: int | None
    completed_at: int | None
    failed_at: int | None
    expired_at: int | None
    cancelling_at: int | None
    cancelled_at: int | None
    request_counts: RequestCounts
    metadata: dict[str, str] | None

    @classmethod
    def of(cls, row: FileBatch, counts: RequestCounts) -> BatchObject:
        def file_id(value: uuid.UUID | None) -> str | None:
            return None if value is None else public_id(FILE_PREFIX, value)

        times: dict[str, Any] = {name: epoch(getattr(row, name)) for name in (
            "created_at", "in_progress_at", "expires_at", "finalizing_at", "completed_at", "failed_at",
            "expired_at", "cancelling_at", "cancelled_at")}
        return cls(id=public_id(BATCH_PREFIX, row.id), endpoint=row.endpoint,
                   errors=BatchErrors(data=[BatchError(**e) for e in row.errors]) if row.errors else None,
                   input_file_id=file_id(row.input_file_id), completion_window=row.completion_window,
                   status=row.status, output_file_id=file_id(row.output_file_id),
                   error_file_id=file_id(row.error_file_id), request_counts=counts, metadata=row.meta, **times)


class BatchList(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class BatchDeleted(BaseModel):
    id: str
    object: Literal["batch"] = "batch"
    deleted: bool
