"""A file batch's life in the database (docs/architecture.md §15): its lines stored as jobs, its counts, cancel,
expiry, and its output and error files written once every line has finished.

Validating and writing out are long, so an API process takes the batch's lease for them (`take`), renews it as
it goes and makes its last change only while it still holds it: a process that died leaves the batch to another
once the lease has expired, and two processes never both finish one batch. Every other change is one
conditional update."""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import and_, exists, func, insert, or_, select, update
from sqlalchemy import delete as delete_rows
from sqlalchemy.orm import Session

from api.batch.lines import MalformedFile, Rejected, Request, check_file, read_requests
from api.batch.schemas import BATCH_PREFIX, RequestCounts
from api.files.deletion import delete_files
from api.files.store import FileStore
from api.jobs.deletion import delete_jobs
from api.jobs.presenters import jobs_out
from api.openai.chat.schemas import chat_answered, completion
from api.openai.ids import public_id
from api.openai.responses.schemas import StoredResponse, response_object
from shared import lifecycle, usage
from shared.clock import db_now
from shared.db import one_writer
from shared.models import BatchStatus, FileBatch, Job, JobStatus, Priority, RejectedLine, StoredFile
from shared.schemas import JobCreate

log = logging.getLogger("kevlaya.batches")

CHUNK_LINES = 1000  # lines stored per transaction: short write locks, so interactive submits are not held up
UNFINISHED = (JobStatus.QUEUED, JobStatus.RUNNING)
EXPIRED_ERROR = ("batch_expired", "This request could not be executed before the completion window expired.")
CANCELLED_ERROR = ("batch_cancelled", "This request was not run: the batch was cancelled.")


def _lines_of(batch_id: uuid.UUID) -> Any:
    return and_(Job.file_batch_id == batch_id, Job.parent_job_id.is_(None))


def request_counts(session: Session, batch: FileBatch) -> RequestCounts:
    by_status = dict(session.execute(
        select(Job.status, func.count()).where(_lines_of(batch.id)).group_by(Job.status)).all())
    rejected = session.scalar(select(func.count()).where(RejectedLine.file_batch_id == batch.id)) or 0
    # answered 200 in the output file like a chat completion (chat_answered): cut by max_tokens, text kept
    cut = session.scalar(select(func.count()).where(
        _lines_of(batch.id), Job.status == JobStatus.FAILED, Job.error_code == "length",
        Job.result_text.is_not(None))) or 0 if by_status.get(JobStatus.FAILED) else 0
    failed = by_status.get(JobStatus.FAILED, 0) - cut + by_status.get(JobStatus.CANCELLED, 0) + rejected
    return RequestCounts(total=batch.total, completed=by_status.get(JobStatus.SUCCEEDED, 0) + cut, failed=failed)


# -- leases ---------------------------------------------------------------------------------------------------

def take(session: Session, batch_id: uuid.UUID, statuses: Iterable[str], owner: str, lease_s: float,
         **values: Any) -> bool:
    """Lease the batch to `owner` while it is in one of `statuses` and nobody else holds it; commits."""
    now = db_now(session)
    with one_writer(session):
        taken = session.execute(
            update(FileBatch).where(FileBatch.id == batch_id, FileBatch.status.in_(list(statuses)),
                                    or_(FileBatch.lease_owner.is_(None), FileBatch.lease_expires_at < now))
            .values(lease_owner=owner, lease_expires_at=now + timedelta(seconds=lease_s), **values)
        ).rowcount
        session.commit()
    return bool(taken)


def release(session: Session, batch_id: uuid.UUID, owner: str) -> None:
    """Give the lease back after a failure (a full disk, say), so the next look tries again at once."""
    session.rollback()
    with one_writer(session):
        session.execute(update(FileBatch).where(FileBatch.id == batch_id, FileBatch.lease_owner == owner)
                        .values(lease_owner=None, lease_expires_at=None))
        session.commit()


def _held(session: Session, batch_id: uuid.UUID, owner: str, lease_s: float, **values: Any) -> bool:
    """Renew the lease (and set `values`) in the current transaction; False when `owner` lost it."""
    return bool(session.execute(
        update(FileBatch).where(FileBatch.id == batch_id, FileBatch.lease_owner == owner)
        .values(**{"lease_expires_at": db_now(session) + timedelta(seconds=lease_s), **values})).rowcount)


# -- validating: the lines become jobs ------------------------------------------------------------------------

@dataclass(frozen=True)
class Stored:
    """What one chunk stored: each adapter's first new job, for its wake-up."""

    wakeups: dict[str, uuid.UUID]


def _job_row(batch: FileBatch, request: Request, now: datetime) -> dict[str, Any]:
    job: JobCreate = request.job
    adapter = "laya" if job.adapter == "auto" else job.adapter
    row = {
        "id": uuid.uuid4(), "adapter": adapter, "requested_adapter": job.adapter, "status": JobStatus.QUEUED,
        "input": job.input.model_dump() if not isinstance(job.input, str) else job.input,
        "params": job.params.model_dump(exclude_none=True), "meta": job.metadata, "api_key_id": batch.api_key_id,
        "created_at": now, "attempts": 0, "priority": Priority.BATCH, "file_batch_id": batch.id,
        "batch_line": request.line, "custom_id": request.custom_id, **job.row_columns(),
    }
    # Charged, never refused: the input file was admitted under the key's quota (docs/architecture.md §16).
    row["stored_bytes"] = usage.request_bytes(row)
    return row


def _reject_row(batch: FileBatch, rejected: Rejected) -> dict[str, Any]:
    return {"file_batch_id": batch.id, "batch_line": rejected.line, "custom_id": rejected.custom_id,
            "status_code": rejected.status_code, "error_code": rejected.error["code"],
            "error_message": json.dumps(rejected.error)}


def _last_stored_line(session: Session, batch_id: uuid.UUID) -> int:
    jobs = session.scalar(select(func.max(Job.batch_line)).where(Job.file_batch_id == batch_id)) or 0
    rejected = session.scalar(select(func.max(RejectedLine.batch_line))
                              .where(RejectedLine.file_batch_id == batch_id)) or 0
    return max(jobs, rejected)


def validate(session: Session, store: FileStore, batch_id: uuid.UUID, owner: str, lease_s: float,
             check: Callable[[JobCreate], None], max_line_bytes: int,
             wake: Callable[[dict[str, uuid.UUID]], None]) -> str:
    """Store a leased `validating` batch's lines as jobs (or rejected lines), `CHUNK_LINES` per transaction,
    after the whole file was checked; resumes after the last stored line. Returns the batch's new status."""
    batch = session.get(FileBatch, batch_id)
    path = store.path(batch.input_file_id)
    try:
        if not path.is_file():
            raise MalformedFile([{"code": "file_not_found", "line": None,
                                  "message": "the input file was deleted before the batch was read"}])
        total = check_file(path, batch.endpoint, max_line_bytes)
    except MalformedFile as exc:
        with one_writer(session):
            failed = _held(session, batch_id, owner, lease_s, status=BatchStatus.FAILED, failed_at=db_now(session),
                           errors=exc.errors, lease_owner=None, lease_expires_at=None)
            session.commit()
        log.info("batch %s failed validation: %s", batch_id, exc)
        return BatchStatus.FAILED if failed else batch.status
    after = _last_stored_line(session, batch_id)
    chunk: list[Request | Rejected] = []
    for item in read_requests(path, batch.endpoint, check, max_line_bytes, after_line=after):
        chunk.append(item)
        if len(chunk) == CHUNK_LINES:
            if not _store_chunk(session, batch, chunk, owner, lease_s, wake):
                return BatchStatus.VALIDATING  # lost the lease or cancelled meanwhile
            chunk = []
    if not _store_chunk(session, batch, chunk, owner, lease_s, wake, total=total):
        return BatchStatus.VALIDATING
    log.info("batch %s: %d line(s) stored, now in progress", batch_id, total)
    return BatchStatus.IN_PROGRESS


def _store_chunk(session: Session, batch: FileBatch, chunk: list[Request | Rejected], owner: str, lease_s: float,
                 wake: Callable[[dict[str, uuid.UUID]], None], total: int | None = None) -> bool:
    jobs = [_job_row(batch, item, db_now(session)) for item in chunk if isinstance(item, Request)]
    rejects = [_reject_row(batch, item) for item in chunk if isinstance(item, Rejected)]
    last = {} if total is None else {"status": BatchStatus.IN_PROGRESS, "in_progress_at": db_now(session), "total": total,
                                     "lease_owner": None, "lease_expires_at": None}
    with one_writer(session):
        held = session.execute(
            update(FileBatch).where(FileBatch.id == batch.id, FileBatch.lease_owner == owner,
                                    FileBatch.status == BatchStatus.VALIDATING)
            .values(**{"lease_expires_at": db_now(session) + timedelta(seconds=lease_s), **last})).rowcount
        if not held:
            session.rollback()
            return False
        if jobs:
            session.execute(insert(Job), jobs)
            usage.charge(session, batch.api_key_id, sum(job["stored_bytes"] for job in jobs))
        if rejects:
            session.execute(insert(RejectedLine), rejects)
        session.commit()
    wakeups: dict[str, uuid.UUID] = {}
    for job in jobs:
        wakeups.setdefault(job["adapter"], job["id"])
    if wakeups:
        wake(wakeups)
    return True


# -- cancel and expiry ----------------------------------------------------------------------------------------

def _stop_queued(session: Session, batch_id: uuid.UUID, error: tuple[str, str]) -> int:
    """Cancel the batch's queued lines, a chunk at a time (a batch may hold 50,000)."""
    stopped = 0
    while ids := session.scalars(select(Job.id).where(_lines_of(batch_id), Job.status == JobStatus.QUEUED)
                                 .limit(CHUNK_LINES)).all():
        stopped += len(lifecycle.cancel_many(session, ids, error_code=error[0], error_message=error[1]))
    return stopped


def cancel(session: Session, batch: FileBatch) -> bool:
    """validating | in_progress → cancelling, its queued lines cancelled; running ones finish. False when the
    batch was no longer cancellable."""
    with one_writer(session):
        moved = session.execute(
            update(FileBatch).where(FileBatch.id == batch.id,
                                    FileBatch.status.in_([BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS]))
            .values(status=BatchStatus.CANCELLING, cancelling_at=db_now(session))).rowcount
        stopped = _stop_queued(session, batch.id, CANCELLED_ERROR) if moved else 0
        session.commit()
    if moved:
        log.info("batch %s cancelling: %d queued line(s) cancelled", batch.id, stopped)
    return bool(moved)


def expire_due(session: Session) -> list[uuid.UUID]:
    """in_progress batches past their completion window → finalizing, their queued lines expired."""
    due = session.scalars(select(FileBatch.id).where(FileBatch.status == BatchStatus.IN_PROGRESS,
                                                     FileBatch.expires_at < db_now(session))).all()
    expired = []
    for batch_id in due:
        with one_writer(session):
            now = db_now(session)
            moved = session.execute(
                update(FileBatch).where(FileBatch.id == batch_id, FileBatch.status == BatchStatus.IN_PROGRESS)
                .values(status=BatchStatus.FINALIZING, finalizing_at=now, expired_at=now)).rowcount
            stopped = _stop_queued(session, batch_id, EXPIRED_ERROR) if moved else 0
            session.commit()
        if moved:
            expired.append(batch_id)
            log.info("batch %s expired: %d queued line(s) will not run", batch_id, stopped)
    return expired


def remove(session: Session, batch: FileBatch) -> list[uuid.UUID]:
    """In the caller's transaction: what `delete` removes. Returns the ids of the file rows deleted."""
    files = [file_id for file_id in (batch.output_file_id, batch.error_file_id) if file_id is not None]
    delete_jobs(session, Job.file_batch_id == batch.id)
    session.execute(delete_rows(RejectedLine).where(RejectedLine.file_batch_id == batch.id))
    removed = delete_files(session, StoredFile.id.in_(files)) if files else []
    session.execute(delete_rows(FileBatch).where(FileBatch.id == batch.id))
    return removed


def delete(session: Session, batch: FileBatch) -> None:
    """A finished batch, its lines' jobs (their `auto` stages with them) and its output and error file rows, in
    one transaction; the caller removes the files' bytes once it has committed."""
    with one_writer(session):
        files = remove(session, batch)
        session.commit()
    log.info("batch %s deleted with its lines and %d file(s)", batch.id, len(files))


# -- finishing: the output and error files --------------------------------------------------------------------

def ready_to_finish(session: Session) -> list[uuid.UUID]:
    """Batches running, finalizing or cancelling whose every line has finished, and nobody writes out now."""
    unfinished = exists().where(Job.file_batch_id == FileBatch.id, Job.status.in_(UNFINISHED))
    return list(session.scalars(select(FileBatch.id).where(
        FileBatch.status.in_([BatchStatus.IN_PROGRESS, BatchStatus.FINALIZING, BatchStatus.CANCELLING]),
        or_(FileBatch.lease_owner.is_(None), FileBatch.lease_expires_at < db_now(session)), ~unfinished)).all())


# Characters that str.splitlines() and some JSONL readers take for a line's end, which JSON leaves raw in a string
_LINE_BREAKS = {"\u2028": "\\u2028", "\u2029": "\\u2029", "\x85": "\\u0085"}


def jsonl_line(value: Any) -> bytes:
    """One line of an output or error file: a model's text may hold any character, and each line must still read
    back as one line however the client splits them."""
    text = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    for raw, escaped in _LINE_BREAKS.items():
        text = text.replace(raw, escaped)
    return (text + "\n").encode()


def _answer(job: Any, row: Job) -> dict[str, Any]:
    """A line's answer, as its endpoint gives it: a chat completion, or a response object."""
    stored = StoredResponse.of(row)
    if stored is not None:
        return response_object(job, stored).model_dump(mode="json")
    return completion(job, job.requested_adapter).model_dump(mode="json")


def _result_line(job: Any, request_id: str, row: Job) -> tuple[bool, dict[str, Any]]:
    """(whether it goes to the output file, its line) for a finished job (JobOut) of its row."""
    line: dict[str, Any] = {"id": f"batch_req_{job.id.hex}", "custom_id": None, "response": None, "error": None}
    if chat_answered(job):
        line["response"] = {"status_code": 200, "request_id": request_id, "body": _answer(job, row)}
        return True, line
    code, message = (job.error.code, job.error.message) if job.error else ("internal", "no answer was stored")
    if code in (EXPIRED_ERROR[0], CANCELLED_ERROR[0]):
        line["error"] = {"code": code, "message": message}
    else:  # what POST /v1/chat/completions answers for a job that failed
        line["response"] = {"status_code": 422, "request_id": request_id,
                            "body": {"error": {"code": code, "message": f"job {job.id} failed: {message}"}}}
    return False, line


def _result_lines(session: Session, batch_id: uuid.UUID) -> Iterator[tuple[bool, dict[str, Any]]]:
    for reject in session.scalars(select(RejectedLine).where(RejectedLine.file_batch_id == batch_id)
                                  .order_by(RejectedLine.batch_line)):
        request_id = f"batch_req_{batch_id.hex}_{reject.batch_line}"  # no job was made for it
        yield False, {"id": request_id, "custom_id": reject.custom_id,
                      "response": {"status_code": reject.status_code, "request_id": request_id,
                                   "body": {"error": json.loads(reject.error_message)}}, "error": None}
    after = 0
    while True:
        rows = list(session.scalars(select(Job).where(_lines_of(batch_id), Job.batch_line > after)
                                    .order_by(Job.batch_line).limit(500)))
        if not rows:
            return
        after = rows[-1].batch_line
        for row, job in zip(rows, jobs_out(session, rows)):
            to_output, line = _result_line(job, str(job.id), row)
            line["custom_id"] = row.custom_id
            yield to_output, line
        session.expunge_all()


def _file_row(batch: FileBatch, kind: str, size: int, lines: int, now: datetime) -> StoredFile:
    expires = None if batch.output_expires_after_s is None else now + timedelta(seconds=batch.output_expires_after_s)
    return StoredFile(id=uuid.uuid4(), api_key_id=batch.api_key_id, purpose="batch_output",
                      filename=f"{public_id(BATCH_PREFIX, batch.id)}_{kind}.jsonl", bytes=size, lines=lines,
                      created_at=now, expires_at=expires)


def finish(session: Session, store: FileStore, batch_id: uuid.UUID, owner: str, lease_s: float) -> str | None:
    """Write a leased batch's output and error files, every finished line once, then end it: completed, expired
    or cancelled. Returns the final status; None when another process finished it first."""
    batch = session.get(FileBatch, batch_id)
    final = (BatchStatus.CANCELLED if batch.cancelling_at else
             BatchStatus.EXPIRED if batch.expired_at else BatchStatus.COMPLETED)
    files: dict[str, StoredFile] = {}
    with store.writing() as (output_path, output), store.writing() as (error_path, errors):
        counts = {"output": [0, 0], "error": [0, 0]}
        for to_output, line in _result_lines(session, batch_id):
            kind = "output" if to_output else "error"
            data = jsonl_line(line)
            (output if to_output else errors).write(data)
            counts[kind][0] += len(data)
            counts[kind][1] += 1
            if counts[kind][1] % CHUNK_LINES == 0:
                with one_writer(session):
                    _held(session, batch_id, owner, lease_s)
                    session.commit()
        session.expunge_all()
    batch = session.get(FileBatch, batch_id)
    for kind, path in (("output", output_path), ("error", error_path)):
        size, lines = counts[kind]
        if lines:
            files[kind] = _file_row(batch, kind, size, lines, db_now(session))
            store.keep(path, files[kind].id)
        else:
            path.unlink(missing_ok=True)
    now = db_now(session)
    with one_writer(session):
        session.add_all(files.values())
        session.flush()
        usage.charge(session, batch.api_key_id, sum(row.bytes for row in files.values()))  # never refused
        stamp = {BatchStatus.CANCELLED: "cancelled_at", BatchStatus.EXPIRED: "expired_at",
                 BatchStatus.COMPLETED: "completed_at"}[final]
        ended = _held(session, batch_id, owner, lease_s, status=final, lease_owner=None, lease_expires_at=None,
                      output_file_id=files["output"].id if "output" in files else None,
                      error_file_id=files["error"].id if "error" in files else None,
                      finalizing_at=batch.finalizing_at or now, **{stamp: getattr(batch, stamp) or now})
        if ended:
            session.commit()
        else:
            session.rollback()
    if not ended:
        for row in files.values():
            store.remove(row.id)
        return None
    log.info("batch %s %s: %d line(s) in the output file, %d in the error file", batch_id, final,
             counts["output"][1], counts["error"][1])
    return final
