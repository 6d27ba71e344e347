"""Retention (docs/architecture.md §16): finished batches, finished jobs and files older than
`KEVLAYA_QUOTAS__RETENTION_S` are deleted, a chunk of rows per transaction, with their bytes on disk and their charge
on their keys' quotas. The batch keeper of each API process runs it with its housekeeping; processes that run
it at once delete disjoint rows or nothing (a row deleted twice is deleted once)."""

from __future__ import annotations

import logging
import threading
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import exists, or_, select
from sqlalchemy.orm import Session

from api.batch import file_batches
from api.files.deletion import delete_files
from api.files.store import FileStore
from api.jobs.deletion import delete_jobs
from shared.clock import db_now
from shared.db import one_writer
from shared.models import BatchStatus, FileBatch, Job, JobStatus, StoredFile

log = logging.getLogger("kevlaya.retention")

CHUNK = 1000  # rows per transaction: the write lock is held briefly, submits go on meanwhile


@dataclass
class Swept:
    batches: int = 0
    jobs: int = 0
    files: int = 0


def _ended_before(cutoff: datetime) -> object:
    return or_(*(column < cutoff for column in (FileBatch.completed_at, FileBatch.failed_at, FileBatch.expired_at,
                                                FileBatch.cancelled_at)))


def sweep(session: Session, store: FileStore, retention_s: float, stop: threading.Event | None = None) -> Swept:
    """Delete what is older than `retention_s`: batches that ended before, with their lines and output files;
    jobs that finished before (not batch lines: they go with their batch; `auto` stages go with their job); files
    stored before, unless a batch not yet finished reads them."""
    swept = Swept()
    if retention_s <= 0:
        return swept
    cutoff = db_now(session) - timedelta(seconds=retention_s)

    def stopped() -> bool:
        return stop is not None and stop.is_set()

    while not stopped() and (batches := session.scalars(select(FileBatch).where(
            FileBatch.status.in_(BatchStatus.FINISHED), _ended_before(cutoff)).limit(100)).all()):
        removed: list[uuid.UUID] = []
        with one_writer(session):
            for batch in batches:
                removed += file_batches.remove(session, batch)
            session.commit()
        _remove_bytes(store, removed)
        swept.batches += len(batches)
        swept.files += len(removed)
    old_job = (Job.status.in_(JobStatus.FINISHED), Job.finished_at < cutoff, Job.parent_job_id.is_(None),
               Job.file_batch_id.is_(None))
    while not stopped() and (ids := session.scalars(select(Job.id).where(*old_job).limit(CHUNK)).all()):
        with one_writer(session):
            swept.jobs += len(delete_jobs(session, Job.id.in_(ids), *old_job))
            session.commit()
    read_by_batch = exists().where(FileBatch.input_file_id == StoredFile.id,
                                   FileBatch.status.not_in(BatchStatus.FINISHED))
    old_file = (StoredFile.created_at < cutoff, ~read_by_batch)
    while not stopped() and (ids := session.scalars(select(StoredFile.id).where(*old_file).limit(CHUNK)).all()):
        with one_writer(session):
            removed = delete_files(session, StoredFile.id.in_(ids), *old_file)
            session.commit()
        _remove_bytes(store, removed)
        swept.files += len(removed)
    if swept.batches or swept.jobs or swept.files:
        log.info("retention: deleted %d batch(es), %d job(s) and %d file(s) older than %.0f s", swept.batches,
                 swept.jobs, swept.files, retention_s)
    return swept


def _remove_bytes(store: FileStore, file_ids: list[uuid.UUID]) -> None:
    for file_id in file_ids:
        store.remove(file_id)
