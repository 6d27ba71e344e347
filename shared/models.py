"""SQLAlchemy 2 typed models: the `jobs` row is the source of truth for a job (docs/architecture.md §7)."""

from __future__ import annotations

import uuid
from datetime import datetime, timezone
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
    Uuid,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


class UTCDateTime(TypeDecorator[datetime]):
    """Stores UTC; always returns an aware datetime (SQLite drops the zone, PostgreSQL keeps it)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is not None and value.tzinfo is not None:
            value = value.astimezone(timezone.utc)
            if dialect.name == "sqlite":
                value = value.replace(tzinfo=None)
        return value

    def process_result_value(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is not None and value.tzinfo is None:
            value = value.replace(tzinfo=timezone.utc)
        return value


class JobStatus:
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    FINISHED = (SUCCEEDED, FAILED, CANCELLED)


class Base(DeclarativeBase):
    type_annotation_map = {datetime: UTCDateTime, dict[str, Any]: JSON}


class ApiKey(Base):
    __tablename__ = "api_keys"

    id: Mapped[uuid.UUID] = mapped_column(Uuid, primary_key=True, default=uuid.uuid4)
    name: Mapped[str] = mapped_column(String(100))
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    is_admin: Mapped[bool] = mapped_column(Boolean, default=False)
    rate_limit_per_minute: Mapped[int | None] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    revoked_at: Mapped[datetime | None]


class ClaimGroup(Base):
    """Jobs one worker claimed together (the engine's claim for its free slots): the `batches` table, and the
    `batch_id` of a job in the API."""

    __tablename__ = "batches"

    id: Mapped[uuid.UUID] = mapped_column(Uuid, primary_key=True, default=uuid.uuid4)
    adapters: Mapped[str] = mapped_column(String(32))  # "kev" or "laya" ("kev,laya": rows of older versions)
    size: Mapped[int] = mapped_column(Integer, default=0)
    mixed: Mapped[bool] = mapped_column(Boolean, default=False)
    switch_ms: Mapped[float | None] = mapped_column(Float)
    prefill_ms: Mapped[float | None] = mapped_column(Float)
    decode_ms: Mapped[float | None] = mapped_column(Float)
    tokens: Mapped[int | None] = mapped_column(Integer)
    peak_vram_bytes: Mapped[int | None] = mapped_column(BigInteger)
    oom_splits: Mapped[int | None] = mapped_column(Integer)  # 0: an out-of-memory gives rows back to the queue instead
    worker: Mapped[str] = mapped_column(String(200))
    started_at: Mapped[datetime] = mapped_column(default=utcnow)
    finished_at: Mapped[datetime | None]

    # /v1/stats reads a window of batches from this index alone (migrations 0003, 0004)
    __table_args__ = (
        Index("ix_batches_stats", "started_at", "worker", "adapters", "size", "switch_ms", "prefill_ms", "decode_ms",
              "tokens", "oom_splits", "peak_vram_bytes"),
    )


class Job(Base):
    __tablename__ = "jobs"
    __table_args__ = (
        UniqueConstraint("api_key_id", "idempotency_key", name="uq_jobs_api_key_idempotency"),
        Index("ix_jobs_status_adapter_created", "status", "adapter", "created_at"),
        Index("ix_jobs_created_id", "created_at", "id"),
        # /v1/stats reads a window of jobs from this index alone, and finds escalations (migration 0003)
        Index("ix_jobs_stats", "created_at", "adapter", "status", "error_code", "requested_adapter", "parent_job_id",
              "queue_ms", "ttft_ms", "decode_ms", "total_ms", "completion_tokens", "id"),
        Index("ix_jobs_parent_adapter", "parent_job_id", "adapter"),
    )

    id: Mapped[uuid.UUID] = mapped_column(Uuid, primary_key=True, default=uuid.uuid4)
    adapter: Mapped[str] = mapped_column(String(8))
    requested_adapter: Mapped[str] = mapped_column(String(8))
    status: Mapped[str] = mapped_column(String(16), default=JobStatus.QUEUED)
    input: Mapped[Any] = mapped_column(JSON)
    params: Mapped[dict[str, Any]] = mapped_column(default=dict)
    meta: Mapped[dict[str, Any] | None] = mapped_column("metadata", JSON)
    result_text: Mapped[str | None] = mapped_column(Text)
    decision: Mapped[dict[str, Any] | None]
    error_code: Mapped[str | None] = mapped_column(String(32))
    error_message: Mapped[str | None] = mapped_column(Text)
    # Why the answer ended: "stop" (end of sequence, its grammar complete or a stop string) or "length".
    finish_reason: Mapped[str | None] = mapped_column(String(16))
    logprobs: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON)  # when the job asked for them
    idempotency_key: Mapped[str | None] = mapped_column(String(200))
    api_key_id: Mapped[uuid.UUID | None] = mapped_column(ForeignKey("api_keys.id"), index=True)
    parent_job_id: Mapped[uuid.UUID | None] = mapped_column(
        ForeignKey("jobs.id", ondelete="CASCADE"), index=True
    )
    batch_id: Mapped[uuid.UUID | None] = mapped_column(ForeignKey("batches.id"), index=True)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    lease_owner: Mapped[str | None] = mapped_column(String(200))
    lease_expires_at: Mapped[datetime | None]
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    started_at: Mapped[datetime | None]
    finished_at: Mapped[datetime | None]
    queue_ms: Mapped[float | None] = mapped_column(Float)
    switch_ms: Mapped[float | None] = mapped_column(Float)
    prefill_ms: Mapped[float | None] = mapped_column(Float)
    decode_ms: Mapped[float | None] = mapped_column(Float)  # this job's own: its first token to its last
    ttft_ms: Mapped[float | None] = mapped_column(Float)  # created to its first token
    total_ms: Mapped[float | None] = mapped_column(Float)
    prompt_tokens: Mapped[int | None] = mapped_column(Integer)
    completion_tokens: Mapped[int | None] = mapped_column(Integer)
