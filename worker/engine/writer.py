"""The result writer: a thread that stores what the decode loop finished, so the loop never waits on the database
(docs/architecture.md §14). It also makes each result's text (a decode per token prefix, milliseconds a row) and
closes a claim group's `batches` row in the commit that stores (or gives back) its last job."""

from __future__ import annotations

import copy
import logging
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING

from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError

from shared import lifecycle
from shared.calibration import Calibration
from shared.clock import db_now
from shared.db import write_scope
from shared.lifecycle import JobOutcome
from shared.models import ClaimGroup, Job
from shared.settings import Settings
from worker.generation import GenerationResult
from worker.ledger.claims import GroupFigures, close_group
from worker.ledger.settle import Settled, announce_escalations, settle_job
from worker.metrics import METRICS
from worker.model.tokens import result_text

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from worker.engine.token_stream import TokenPublisher

log = logging.getLogger("kevlaya.worker")
Result = GenerationResult | JobOutcome
STORE_RETRY_S = 600.0  # how long a result waits for an unreachable database before it is given up
STORE_RETRY_PAUSE_S = 1.0


def _unreachable(exc: Exception) -> bool:
    """Whether the database could not be reached or dropped the connection (worth trying again), as opposed to
    refusing the write itself."""
    return isinstance(exc, (OperationalError, InterfaceError)) or (
        isinstance(exc, DBAPIError) and exc.connection_invalidated)


@dataclass(eq=False)  # one per group: compared and hashed as itself
class GroupProgress:
    """A claim group in flight: its jobs, and how many are stored or were given back to the queue."""

    group: ClaimGroup
    jobs: dict[uuid.UUID, Job]
    versions: dict[str, str] = field(default_factory=dict)  # adapter -> the version its jobs run on (sha256)
    calibrations: dict[str, Calibration] = field(default_factory=dict)  # adapter -> that version's calibration
    results: list[GenerationResult] = field(default_factory=list)  # of the jobs that reached the model
    stored: int = 0
    escalated: int = 0
    lost: int = 0
    released: int = 0
    unstored: int = 0  # results the database refused for good: their leases lapse and the sweeper re-queues them

    @property
    def done(self) -> bool:
        return self.completed_by(0)

    def completed_by(self, arriving: int) -> bool:
        """Whether every job is stored, given back or given up once `arriving` more are: only then does the group
        stop being live, so a job that could not be stored is not held (its lease renewed) for ever."""
        return self.stored + self.released + self.unstored + arriving == len(self.jobs)


class ResultWriter:
    """Owns the claim groups in flight. The decode loop hands it results and jobs to give back; it stores them on
    its own thread, in the order they were handed in."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, settings: Settings,
                 peak_vram: Callable[[], int | None], stream: TokenPublisher):
        self.settings, self.peak_vram, self.stream = settings, peak_vram, stream
        # Its own tokenizer: the decode loop's changes its padding settings while it encodes, which a decode on
        # this thread must not see.
        self.tokenizer = copy.deepcopy(tokenizer)
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="result-writer")
        self.groups: dict[uuid.UUID, GroupProgress] = {}  # by group id
        self.group_of: dict[uuid.UUID, GroupProgress] = {}  # by job id, while the job is held by this worker
        self.pending: list[Future] = []
        # Groups are read by the lease thread and written by this one. Never held while opening a write
        # (shared/db.py: write_scope), which may wait for another writer, nor around `_close`.
        self._lock = threading.Lock()

    def add(self, group: ClaimGroup, jobs: list[Job], versions: dict[str, str] | None = None,
            calibrations: dict[str, Calibration] | None = None) -> None:
        """A claim group taken: `versions` (adapter -> sha256) and `calibrations` of the adapter versions its jobs
        run on, as the claim found them; the version is stored with each answer, the calibration settles it."""
        progress = GroupProgress(group=group, jobs={job.id: job for job in jobs}, versions=versions or {},
                                 calibrations=calibrations or {})
        with self._lock:
            self.groups[group.id] = progress
        for job in jobs:
            self.group_of[job.id] = progress

    def live_groups(self) -> list[uuid.UUID]:
        with self._lock:
            return list(self.groups)

    def store(self, items: list[tuple[uuid.UUID, Result]]) -> None:
        """Store what became of these jobs (by id), in one transaction, off the calling thread."""
        if not items:
            return
        batch = [(self.group_of.pop(job_id), job_id, result) for job_id, result in items]
        self._submit(self._write, batch)

    def release(self, job_ids: list[uuid.UUID]) -> None:
        """Give jobs back to the queue unrun (not an attempt); their group closes without them."""
        by_group: dict[uuid.UUID, list[uuid.UUID]] = {}
        for job_id in job_ids:
            by_group.setdefault(self.group_of.pop(job_id).group.id, []).append(job_id)
        for group_id, ids in by_group.items():
            progress, figures = self.groups[group_id], None
            with write_scope() as session:
                released = lifecycle.release(session, ids, group_id)
                with self._lock:  # the last of its jobs: the group closes in the same commit, as in `_write`
                    if progress.completed_by(len(released)):
                        figures = self._figures(progress.results)
                if figures is not None:
                    close_group(session, group_id, figures)
            self.stream.requeued(released)
            with self._lock:
                progress.released += len(released)
                finished = progress.done
            if finished and figures is not None:
                self._close(progress, figures)  # its row is closed: no write left for this thread
            elif finished:
                self._submit(self._close, progress)

    def wait(self) -> None:
        """Until everything handed in is stored (a drain ends only then)."""
        try:
            for future in self.pending:
                future.result()
        finally:
            self.pending.clear()

    def _submit(self, fn: Callable[..., None], *args: object) -> None:
        self.pending.append(self.pool.submit(fn, *args))
        self.pending = [f for f in self.pending if not f.done() or f.exception() is not None]

    def _write(self, items: list[tuple[GroupProgress, uuid.UUID, Result]]) -> None:
        """One transaction for all of `items` (one commit for a whole step's rows, so this thread holds the
        interpreter lock for less of the decode loop's time); if that fails, each alone, so one job that cannot be
        stored does not take the others with it; one alone that the database could not be reached for, again
        until it can (for STORE_RETRY_S at most)."""
        started = time.perf_counter()
        while True:
            try:
                stored_at, settled, closing = self._store(items)
                break
            except Exception as exc:
                if len(items) > 1:
                    log.exception("storing %d results together failed; storing them one by one", len(items))
                    for item in items:
                        self._write([item])
                    return
                if _unreachable(exc) and time.perf_counter() - started < STORE_RETRY_S:
                    # The database is away (restarting, failing over): the result waits here, not lost and not
                    # re-run; if it comes back after the lease lapsed, the fence discards it and the job runs again.
                    log.warning("storing job %s's result failed (%s); trying again", items[0][1],
                                exc.__class__.__name__)
                    time.sleep(STORE_RETRY_PAUSE_S)
                    continue
                self._give_up(items[0][0], items[0][1])
                raise
        for (progress, job_id, result), done in zip(items, settled):
            job = progress.jobs[job_id]
            METRICS.job_finished(job, done.outcome, result if isinstance(result, GenerationResult) else None, stored_at)
            if not done.stored:
                log.warning("job %s had lost its lease; its result was discarded", job.id)
            if done.escalated is not None:
                self.stream.escalated(job.id, done.escalated.id)
                announce_escalations([done.escalated])
            with self._lock:
                progress.lost += not done.stored
                progress.escalated += done.escalated is not None
                progress.stored += 1
                if isinstance(result, GenerationResult):
                    progress.results.append(result)
                finished = progress.done
            if finished:  # out of the lock: the close may write
                self._close(progress, closing.get(progress))
        METRICS.engine_phase.labels("store").observe(time.perf_counter() - started)

    def _store(self, items: list[tuple[GroupProgress, uuid.UUID, Result]],
               ) -> tuple[datetime, list[Settled], dict[GroupProgress, GroupFigures]]:
        for _progress, _job_id, result in items:
            if isinstance(result, GenerationResult) and result.text is None:  # the decoder left it to us
                result_text(self.tokenizer, result)
        # Streams hold every character before the commit announces the jobs finished.
        self.stream.finish([(job_id, result.text, result.completion_tokens, result.first_token_at)
                            if isinstance(result, GenerationResult) else (job_id, None, 0, None)
                            for _progress, job_id, result in items])
        with write_scope() as session:
            stored_at = db_now(session)
            settled = [settle_job(session, progress.jobs[job_id], progress.group.id, result, self.settings,
                                  progress.versions, progress.calibrations)
                       for progress, job_id, result in items]
            # A group whose last jobs these are closes in the same commit: whoever sees all of a group's jobs
            # finished also sees the group closed.
            closing = self._completed_by(items)
            for progress, figures in closing.items():
                close_group(session, progress.group.id, figures)
        return stored_at, settled, closing

    def _give_up(self, progress: GroupProgress, job_id: uuid.UUID) -> None:
        """A result the database refused for good: its group no longer waits for it, so once the rest are done
        the group is not live and nothing renews the job's lease; the sweeper re-queues it when that lapses."""
        log.error("job %s: its result could not be stored; its lease will lapse and it will run again", job_id)
        with self._lock:
            progress.unstored += 1
            finished = progress.done
        if finished:
            try:
                self._close(progress)
            except Exception:  # its row stays open; the group is no longer held here either way
                log.exception("claim group %s could not be closed", progress.group.id)

    def _completed_by(self, items: list[tuple[GroupProgress, uuid.UUID, Result]]) -> dict[GroupProgress, GroupFigures]:
        """The groups whose every job is stored or given back once `items` are, with their row's figures."""
        arriving: dict[GroupProgress, int] = {}
        results: dict[GroupProgress, list[GenerationResult]] = {}
        for progress, _job_id, result in items:
            arriving[progress] = arriving.get(progress, 0) + 1
            if isinstance(result, GenerationResult):
                results.setdefault(progress, []).append(result)
        with self._lock:
            return {progress: self._figures(progress.results + results.get(progress, []))
                    for progress, count in arriving.items()
                    if progress.completed_by(count)}

    def _figures(self, results: list[GenerationResult]) -> GroupFigures:
        return GroupFigures(prefill_ms=max((r.prefill_ms for r in results), default=0.0),
                            decode_ms=max((r.decode_ms for r in results), default=0.0),
                            tokens=sum(r.completion_tokens for r in results), peak_vram_bytes=self.peak_vram())

    def _close(self, progress: GroupProgress, stored: GroupFigures | None = None) -> None:
        """Close the group's row once its last job is stored or given back (`stored`: the figures already
        written in the transaction that stored its last jobs; None: written here)."""
        with self._lock:
            self.groups.pop(progress.group.id, None)
        figures = stored
        if figures is None:
            figures = self._figures(progress.results)
            with write_scope() as session:
                close_group(session, progress.group.id, figures)
        METRICS.group_closed(progress.group, len(progress.jobs), figures, escalated=progress.escalated,
                             lost=progress.lost)

