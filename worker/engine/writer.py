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
from typing import TYPE_CHECKING

from shared import lifecycle
from shared.clock import db_now
from shared.db import write_scope
from shared.lifecycle import JobOutcome
from shared.models import ClaimGroup, Job
from shared.settings import Settings
from worker.generation import GenerationResult
from worker.ledger.claims import GroupFigures, close_group
from worker.ledger.settle import announce_escalations, settle_job
from worker.metrics import METRICS
from worker.model.tokens import result_text

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from worker.engine.token_stream import TokenPublisher

log = logging.getLogger("kevlaya.worker")
Result = GenerationResult | JobOutcome


@dataclass(eq=False)  # one per group: compared and hashed as itself
class GroupProgress:
    """A claim group in flight: its jobs, and how many are stored or were given back to the queue."""

    group: ClaimGroup
    jobs: dict[uuid.UUID, Job]
    results: list[GenerationResult] = field(default_factory=list)  # of the jobs that reached the model
    stored: int = 0
    escalated: int = 0
    lost: int = 0
    released: int = 0

    @property
    def done(self) -> bool:
        return self.completed_by(0)

    def completed_by(self, arriving: int) -> bool:
        """Whether every job is stored or given back once `arriving` more are."""
        return self.stored + self.released + arriving == len(self.jobs)


class ResultWriter:
    """Owns the claim groups in flight. The decode loop hands it results and jobs to give back; it stores them on
    its own thread, in the order they were handed in."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, settings: Settings,
                 peak_vram: Callable[[], int | None], stream: TokenPublisher, versions: dict[str, str]):
        self.settings, self.peak_vram, self.stream = settings, peak_vram, stream
        self.versions = versions  # adapter -> the sha256 of the version loaded, stored with each of its answers
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

    def add(self, group: ClaimGroup, jobs: list[Job]) -> None:
        progress = GroupProgress(group=group, jobs={job.id: job for job in jobs})
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
        stored does not take the others with it."""
        started = time.perf_counter()
        try:
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
                                      self.versions)
                           for progress, job_id, result in items]
                # A group whose last jobs these are closes in the same commit: whoever sees all of a group's jobs
                # finished also sees the group closed.
                closing = self._completed_by(items)
                for progress, figures in closing.items():
                    close_group(session, progress.group.id, figures)
        except Exception:
            if len(items) == 1:
                raise
            log.exception("storing %d results together failed; storing them one by one", len(items))
            for item in items:
                self._write([item])
            return
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

