"""The batch keeper: one thread per API process that moves file batches along (docs/architecture.md §15).

Every `KEVLAYA_BATCH__CHECK_INTERVAL_S` it stores the lines of `validating` batches as jobs, expires batches past
their completion window, writes the output and error files of batches whose lines have all finished, and
removes expired files, files left without a row, and what is older than `KEVLAYA_QUOTAS__RETENTION_S` (api/batch/retention.py). Everything it does is in the database first, so a keeper
that dies (or a database that is away for a while) leaves nothing half done: the next look, here or in another
API process, goes on from the rows."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy import select
from sqlalchemy.orm import Session

from api.batch import file_batches, retention
from api.files.deletion import delete_files
from api.files.store import FileStore
from shared.clock import db_now
from shared.db import new_session, one_writer
from shared.models import BatchStatus, FileBatch, StoredFile
from shared.queue import QueueUnavailable, publish_wakeup
from shared.schemas import JobCreate
from shared.settings import Settings

log = logging.getLogger("kevlaya.batches")

HOUSEKEEPING_S = 60.0  # expired files, orphans and what retention deletes are looked for this often
ORPHAN_AGE_S = 3600.0  # a file without a row this old is left by a process that died mid-upload


def wake(adapters: dict[str, uuid.UUID]) -> None:
    """One wake-up per adapter: a worker that takes it drains that adapter's whole queue."""
    for adapter, job_id in adapters.items():
        try:
            publish_wakeup(job_id, adapter)
        except QueueUnavailable:
            log.warning("no wake-up published for the batch lines of %s; the worker's sweeper will publish one",
                        adapter)


class BatchKeeper:
    def __init__(self, settings: Settings, store: FileStore, check: Callable[[JobCreate], None]):
        self.settings, self.store, self.check = settings, store, check
        self.owner = ""  # host:pid of the process it runs in, as a batch's lease owner
        self._stop = threading.Event()
        self._kick = threading.Event()
        self._thread: threading.Thread | None = None
        self._housekept = 0.0

    def start(self) -> None:
        self.owner = f"{socket.gethostname()}:{os.getpid()}"
        self._thread = threading.Thread(target=self._run, name="batch-keeper", daemon=True)
        self._thread.start()

    def kick(self) -> None:
        """Look now (a batch was created or cancelled)."""
        self._kick.set()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        self._kick.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.look()
            except Exception as exc:  # the database is away, say: the rows still hold everything
                log.warning("batch keeper: %s; trying again in %.0f s", exc, self.settings.batch.check_interval_s)
            self._kick.wait(self.settings.batch.check_interval_s)
            self._kick.clear()

    def look(self) -> None:
        """One pass over every batch that needs something done."""
        settings, lease_s = self.settings, self.settings.batch.lease_s
        with new_session() as session:
            validating = session.scalars(select(FileBatch.id).where(
                FileBatch.status == BatchStatus.VALIDATING)).all()
            for batch_id in validating:
                if self._stop.is_set():
                    return
                if file_batches.take(session, batch_id, [BatchStatus.VALIDATING], self.owner, lease_s):
                    with self._leased(session, batch_id):
                        file_batches.validate(session, self.store, batch_id, self.owner, lease_s, self.check,
                                              settings.limits.body_bytes, wake)
            file_batches.expire_due(session)
            for batch_id in file_batches.ready_to_finish(session):
                if self._stop.is_set():
                    return
                now = db_now(session)
                if file_batches.take(session, batch_id, [BatchStatus.IN_PROGRESS], self.owner, lease_s,
                                     status=BatchStatus.FINALIZING, finalizing_at=now) or \
                        file_batches.take(session, batch_id, [BatchStatus.FINALIZING, BatchStatus.CANCELLING],
                                          self.owner, lease_s):
                    with self._leased(session, batch_id):
                        file_batches.finish(session, self.store, batch_id, self.owner, lease_s)
            if time.monotonic() - self._housekept > HOUSEKEEPING_S:
                self._housekeep(session)
                self._housekept = time.monotonic()

    @contextmanager
    def _leased(self, session: Session, batch_id: uuid.UUID) -> Iterator[None]:
        """Work on a batch this keeper leased; should it fail, the lease is given back (when the database lets
        it: else it expires) so the next look tries again."""
        try:
            yield
        except Exception:
            try:
                file_batches.release(session, batch_id, self.owner)
            except Exception as exc:
                log.warning("batch %s: the lease could not be given back (%s); it expires in %.0f s", batch_id,
                            exc, self.settings.batch.lease_s)
            raise

    def _housekeep(self, session: Session) -> None:
        now = db_now(session)
        expired = session.scalars(select(StoredFile.id).where(StoredFile.expires_at < now)).all()
        if expired:
            with one_writer(session):
                expired = delete_files(session, StoredFile.id.in_(expired))
                session.commit()
            for file_id in expired:
                self.store.remove(file_id)
            log.info("removed %d expired file(s)", len(expired))
        retention.sweep(session, self.store, self.settings.quotas.retention_s, self._stop)
        known = set(session.scalars(select(StoredFile.id)).all())
        if removed := self.store.remove_orphans(known, ORPHAN_AGE_S):
            log.info("removed %d file(s) no row names (left by a process that stopped mid-write)", removed)


async def get_batch_keeper(request: Request) -> BatchKeeper:
    return request.app.state.batch_keeper


BatchKeeperDep = Annotated[BatchKeeper, Depends(get_batch_keeper)]
