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


class BatchStatus:
    """A file batch's states, as OpenAI's Batch API names them (docs/architecture.md §15)."""

    VALIDATING = "validating"
    FAILED = "failed"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    EXPIRED = "expired"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"
    FINISHED = (FAILED, COMPLETED, EXPIRED, CANCELLED)


class Priority:
    """Claim order within an adapter: interactive jobs before the lines of file batches."""

    INTERACTIVE = 0
    BATCH = 1


class Base(DeclarativeBase):
    type_annotation_map = {datetime: UTCDateTime, dict[str, Any]: JSON}


class ApiKey(Base):
    __tablename__ = "api_keys"

    id: Mapped[uuid.UUID] = mapped_column(Uuid, primary_key=True, default=uuid.uuid4)
    name: Mapped[str] = mapped_column(String(100))
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    is_admin: Mapped[bool] = mapped_column(Boolean, default=False)
    rate_limit_per_minute: Mapped[int | None] = mapped_column(Integer)
    # the key's share of the slots against other keys with work queued (docs/architecture.md §3; migration 0008)
    share_weight: Mapped[float] = mapped_column(Float, default=1.0, server_default="1")
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    revoked_at: Mapped[datetime | None]


class KeyUsage(Base):
    """What one API key stores, and its own limits where they differ from the settings' (shared/usage.py,
    docs/architecture.md §16; migration 0009). Written in the transaction that stores or deletes what it counts."""

    __tablename__ = "key_usage"

    api_key_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("api_keys.id", ondelete="CASCADE"), primary_key=True)
    stored_bytes: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")  # jobs' and files'
    max_queued_jobs: Mapped[int | None] = mapped_column(Integer)  # None: KEVLAYA_QUOTAS__QUEUED_JOBS_PER_KEY
    max_stored_bytes: Mapped[int | None] = mapped_column(BigInteger)  # None: KEVLAYA_QUOTAS__STORED_BYTES_PER_KEY


class ClaimGroup(Base):
    """Jobs one worker claimed together (the engine's claim for its free slots): the `batches` table, and the
    `batch_id` of a job in the API."""

    __tablename__ = "batches"

    id: Mapped[uuid.UUID] = mapped_column(Uuid, primary_key=True, default=uuid.uuid4)
    adapters: Mapped[str] = mapped_column(String(32))  # "kev" or "laya" ("kev,laya": rows of older versions)
    size: Mapped[int] = mapped_column(Integer, default=0)
    prefill_ms: Mapped[float | None] = mapped_column(Float)
    decode_ms: Mapped[float | None] = mapped_column(Float)
    tokens: Mapped[int | None] = mapped_column(Integer)
    peak_vram_bytes: Mapped[int | None] = mapped_column(BigInteger)
    worker: Mapped[str] = mapped_column(String(200))
    started_at: Mapped[datetime] = mapped_column(default=utcnow)
    finished_at: Mapped[datetime | None]

    # /v1/stats reads a window of batches from this index alone (migrations 0003, 0004, 0010)
    __table_args__ = (
        Index("ix_batches_stats", "started_at", "worker", "adapters", "size", "prefill_ms", "decode_ms", "tokens",
              "peak_vram_bytes"),
    )


class Job(Base):
    __tablename__ = "jobs"
    __table_args__ = (
        UniqueConstraint("api_key_id", "idempotency_key", name="uq_jobs_api_key_idempotency"),
        # claims: each key's oldest queued jobs per adapter and priority (migration 0008, docs/architecture.md §3)
        Index("ix_jobs_claim_by_key", "status", "adapter", "priority", "api_key_id", "created_at"),
        Index("ix_jobs_created_id", "created_at", "id"),
        # /v1/stats reads a window of jobs from this index alone, and finds escalations (migration 0003)
        Index("ix_jobs_stats", "created_at", "adapter", "status", "error_code", "requested_adapter", "parent_job_id",
              "queue_ms", "ttft_ms", "decode_ms", "total_ms", "completion_tokens", "id"),
        Index("ix_jobs_parent_adapter", "parent_job_id", "adapter"),
        Index("ix_jobs_file_batch_status", "file_batch_id", "status"),
        Index("ix_jobs_finished_at", "finished_at"),  # retention (migration 0009)
        UniqueConstraint("file_batch_id", "batch_line", name="uq_jobs_file_batch_line"),
    )

    id: Mapped[uuid.UUID] = mapped_column(Uuid, primary_key=True, default=uuid.uuid4)
    adapter: Mapped[str] = mapped_column(String(32))  # a role: kev, laya, or one loaded at run time (0014)
    requested_adapter: Mapped[str] = mapped_column(String(32))
    # The adapter whose answer (or failure) the job ended with: its own adapter, or for `auto` laya, or kev once
    # escalated. Null while queued or running, and for a cancelled job (migration 0007).
    answered_by: Mapped[str | None] = mapped_column(String(32))
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
    prefill_ms: Mapped[float | None] = mapped_column(Float)
    decode_ms: Mapped[float | None] = mapped_column(Float)  # this job's own: its first token to its last
    ttft_ms: Mapped[float | None] = mapped_column(Float)  # created to its first token
    total_ms: Mapped[float | None] = mapped_column(Float)
    prompt_tokens: Mapped[int | None] = mapped_column(Integer)
    completion_tokens: Mapped[int | None] = mapped_column(Integer)
    # A line of a file batch (§15): claimed after every interactive job of its adapter.
    priority: Mapped[int] = mapped_column(Integer, default=Priority.INTERACTIVE, server_default="0")
    file_batch_id: Mapped[uuid.UUID | None] = mapped_column(ForeignKey("file_batches.id", ondelete="CASCADE"))
    batch_line: Mapped[int | None] = mapped_column(Integer)  # its line in the batch's input file, from 1
    custom_id: Mapped[str | None] = mapped_column(String(512))
    # What this row charges its key's stored bytes (shared/usage.py): its request when stored, plus its result once
    # finished; a deletion gives back exactly this (migration 0009).
    stored_bytes: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    # A response of the Responses API (api/openai/responses/, docs/architecture.md §17; migration 0011): the request
    # as it came, less what the job itself holds (null for every other job); the response it continues, by id (a
    # plain column: that one may be deleted, this one keeps its conversation in `input`); and whether it is stored
    # (`store: false`: never shown, deleted once answered).
    response_request: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    previous_response_id: Mapped[uuid.UUID | None] = mapped_column(Uuid)
    response_store: Mapped[bool | None] = mapped_column(Boolean)
    # The adapter version (`adapter_versions.sha256`) whose weights wrote the answer, stored with it: for an `auto`
    # job, its answering stage's. Null while unanswered, when the model wrote nothing (a job refused before it ran),
    # and for jobs finished before migration 0012. A plain column: versions are never deleted, but need not be
    # recorded first on an older worker's database.
    adapter_version: Mapped[str | None] = mapped_column(String(64))


class AdapterVersion(Base):
    """An adapter version a worker loaded (shared/adapter_versions.py, docs/architecture.md §10; migration 0012): one
    row per name and weights digest, however often it is loaded again."""

    __tablename__ = "adapter_versions"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    sha256: Mapped[str] = mapped_column(String(64), primary_key=True)  # its version: shared/manifest.py, adapter_sha256
    rank: Mapped[int | None] = mapped_column(Integer)  # adapter_config.json's `r`
    target_modules: Mapped[list[str] | str | None] = mapped_column(JSON)  # adapter_config.json's: names, or a pattern
    base: Mapped[str] = mapped_column(String(1000))  # the base it was checked against (KEVLAYA_MODEL__BASE)
    calibrated: Mapped[bool] = mapped_column(Boolean)  # whether it has a calibration.json
    first_loaded_at: Mapped[datetime] = mapped_column(default=utcnow)
    loaded_at: Mapped[datetime] = mapped_column(default=utcnow)  # the last time a worker loaded it


class AdapterAssignment(Base):
    """What a role should serve, as an admin last asked (POST /v1/load_lora_adapter, /v1/unload_lora_adapter,
    `kevlaya models load|unload`; shared/adapter_assignments.py, docs/architecture.md §10; migration 0013). Workers
    follow it at a safe point and read it at start; a role without a row serves its configured adapter."""

    __tablename__ = "adapter_assignments"

    role: Mapped[str] = mapped_column(String(64), primary_key=True)
    path: Mapped[str | None] = mapped_column(String(4096))  # the adapter's directory (None: the configured one)
    sha256: Mapped[str | None] = mapped_column(String(64))  # its version as checked when it was asked for
    unloaded: Mapped[bool] = mapped_column(Boolean, default=False)  # the role takes no jobs
    generation: Mapped[int] = mapped_column(Integer, default=1)  # +1 at every request: a worker sees a change
    requested_at: Mapped[datetime] = mapped_column(default=utcnow)


class StoredFile(Base):
    """A file of the Files API: its bytes live in KEVLAYA_BATCH__FILES_DIR under this id, never under a client's
    name."""

    __tablename__ = "files"
    __table_args__ = (Index("ix_files_key_created", "api_key_id", "created_at", "id"),)

    id: Mapped[uuid.UUID] = mapped_column(Uuid, primary_key=True, default=uuid.uuid4)
    api_key_id: Mapped[uuid.UUID | None] = mapped_column(ForeignKey("api_keys.id"))
    purpose: Mapped[str] = mapped_column(String(32))  # batch (uploaded) | batch_output (written by a batch)
    filename: Mapped[str] = mapped_column(String(255))  # shown back; never a path
    bytes: Mapped[int] = mapped_column(BigInteger)
    lines: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    expires_at: Mapped[datetime | None]


class FileBatch(Base):
    """A batch of the Batch API: an input file whose lines became jobs (docs/architecture.md §15)."""

    __tablename__ = "file_batches"
    __table_args__ = (
        Index("ix_file_batches_key_created", "api_key_id", "created_at", "id"),
        Index("ix_file_batches_status", "status"),
    )

    id: Mapped[uuid.UUID] = mapped_column(Uuid, primary_key=True, default=uuid.uuid4)
    api_key_id: Mapped[uuid.UUID | None] = mapped_column(ForeignKey("api_keys.id"))
    status: Mapped[str] = mapped_column(String(16), default=BatchStatus.VALIDATING)
    endpoint: Mapped[str] = mapped_column(String(64))
    completion_window: Mapped[str] = mapped_column(String(16))
    input_file_id: Mapped[uuid.UUID] = mapped_column(Uuid)  # not a foreign key: the file may be deleted later
    output_file_id: Mapped[uuid.UUID | None] = mapped_column(Uuid)
    error_file_id: Mapped[uuid.UUID | None] = mapped_column(Uuid)
    output_expires_after_s: Mapped[int | None] = mapped_column(Integer)
    meta: Mapped[dict[str, Any] | None] = mapped_column("metadata", JSON)
    errors: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON)  # why a malformed file failed the batch
    total: Mapped[int] = mapped_column(Integer, default=0)
    # Which API process validates or finalizes it, until when (a process that died leaves it to another).
    lease_owner: Mapped[str | None] = mapped_column(String(200))
    lease_expires_at: Mapped[datetime | None]
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    expires_at: Mapped[datetime]
    in_progress_at: Mapped[datetime | None]
    finalizing_at: Mapped[datetime | None]
    completed_at: Mapped[datetime | None]
    failed_at: Mapped[datetime | None]
    expired_at: Mapped[datetime | None]
    cancelling_at: Mapped[datetime | None]
    cancelled_at: Mapped[datetime | None]


class RejectedLine(Base):
    """A line of a batch's input file that the chat endpoint would have refused: it goes to the error file."""

    __tablename__ = "file_batch_rejects"

    file_batch_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("file_batches.id", ondelete="CASCADE"),
                                                     primary_key=True)
    batch_line: Mapped[int] = mapped_column(Integer, primary_key=True)
    custom_id: Mapped[str] = mapped_column(String(512))
    status_code: Mapped[int] = mapped_column(Integer)
    error_code: Mapped[str] = mapped_column(String(32))
    error_message: Mapped[str] = mapped_column(Text)
