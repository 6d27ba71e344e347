"""Group commit: one thread per API process stores the jobs that submits hand it.

A submit builds its rows on the event loop and hands them over; the writer takes everything handed over since
its last commit and stores it as one unit: one broker ping (a broker that is down means 503 and nothing
stored), one check that the submitting keys are still valid, the rows of every submit, one commit, then their
wake-up (api/jobs/wakeups.py). Each submit waits on its own future for its own answer. Alone, a submit is stored as
soon as it arrives; under load one commit serves every submit that arrived during the previous one, which is
what lets one process take hundreds of submits a second on SQLite (one writer at a time) and PostgreSQL alike.

A failure of the unit (the database or the broker down) is every submit's answer, and none of them is stored.
Only an idempotency key that raced with another process's submit splits the unit: then each submit is stored
on its own, so the race answers one submit with the stored job and fails no other.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from api.http.errors import RETRY_AFTER_S, ApiError, unauthorized
from api.jobs.submission import Accepted, Stored, check_queue, insert_rows, resolve, store_jobs
from api.jobs.wakeups import WakeupPublisher
from api.keys.quotas import Admission
from shared.adapter_assignments import unloaded_roles
from shared.db import new_session, one_writer
from shared.keys import is_revoked_at
from shared.models import ApiKey, Job
from shared.schemas import JobCreate
from shared.settings import get_settings

log = logging.getLogger("kevlaya.api")


@dataclass
class Submission:
    key: ApiKey
    requests: list[JobCreate]
    future: Future[list[Stored]] = field(default_factory=Future)


class JobWriter:
    def __init__(self, wakeups: WakeupPublisher, on_unit: Callable[[int, float], None] | None = None,
                 max_unit_jobs: int = 4096):
        # on_unit(submits, seconds): called for each unit that inserted rows, with how long its insert took
        self.wakeups, self.on_unit, self.max_unit_jobs = wakeups, on_unit, max_unit_jobs
        self._handed: queue.SimpleQueue[Submission | None] = queue.SimpleQueue()  # None: stop
        self._thread: threading.Thread | None = None
        self._closed = False
        self._lock = threading.Lock()

    async def store(self, key: ApiKey, requests: list[JobCreate]) -> list[Accepted]:
        """Each request's job (an existing one for a known idempotency key, else a new one, now committed) and
        whether it was created now. Raises what the unit raised: ApiError (401, 503) or the database's error."""
        return [Accepted.of(stored) for stored in await asyncio.wrap_future(self.hand_over(key, requests))]

    async def aclose(self, timeout_s: float) -> None:
        await asyncio.to_thread(self.shut_down, timeout_s)

    def shut_down(self, timeout_s: float) -> None:
        """Close, then see the wake-ups of what was stored published (else the sweeper would, a while later)."""
        self.close(timeout_s)
        self.wakeups.flush(5.0)

    def hand_over(self, key: ApiKey, requests: list[JobCreate]) -> Future[list[Stored]]:
        submission = Submission(key, requests)
        with self._lock:
            if self._closed:
                raise ApiError(503, "shutting_down", "the API is shutting down, nothing was stored; retry",
                               headers={"Retry-After": RETRY_AFTER_S})
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="job-writer", daemon=True)
                self._thread.start()
            self._handed.put(submission)
        return submission.future

    def close(self, timeout_s: float) -> None:
        """Store what was handed over, then stop; what is handed over later is refused (503)."""
        with self._lock:
            self._closed = True
            if self._thread is None:
                return
            self._handed.put(None)  # after every submission handed over: they are stored first
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            unit = self._next_unit()
            # A submit whose client went away before its turn is not stored (its future was cancelled).
            live = [s for s in unit if s is not None and s.future.set_running_or_notify_cancel()]
            if live:
                try:
                    self._store_unit(live)
                except Exception as exc:  # the writer outlives any one unit; its submits get the error
                    log.exception("storing %d submit(s) failed", len(live))
                    for submission in live:
                        if not submission.future.done():
                            submission.future.set_exception(exc)
            if None in unit:
                return

    def _next_unit(self) -> list[Submission | None]:
        """What was handed over while the last unit was being stored (at least one; waits for it)."""
        unit = [self._handed.get()]
        jobs = len(unit[0].requests) if unit[0] else 0
        while unit[-1] is not None and jobs < self.max_unit_jobs:
            try:
                unit.append(self._handed.get_nowait())
            except queue.Empty:
                break
            jobs += len(unit[-1].requests) if unit[-1] else 0
        return unit

    def _store_unit(self, unit: list[Submission]) -> None:
        try:
            check_queue()
        except ApiError as refused:
            for submission in unit:
                submission.future.set_exception(refused)
            return
        with new_session() as session:
            try:
                answers, new = self._insert(session, unit)
            except IntegrityError:
                session.rollback()
                log.info("an idempotency key raced with another submit; storing this unit's submits one by one")
                for submission in unit:
                    self._store_alone(session, submission)
                return
        self.wakeups.note(new)
        for submission, answer in zip(unit, answers):
            if isinstance(answer, ApiError):
                submission.future.set_exception(answer)
            else:
                submission.future.set_result(answer)

    def _insert(self, session: Session, unit: list[Submission]) -> tuple[list[list[Stored] | ApiError], list[Job]]:
        valid = _valid_keys(session, {submission.key.id for submission in unit})
        answers: list[list[Stored] | ApiError] = []
        created: list[list[Job]] = []
        seen: dict[tuple[uuid.UUID, str], Job] = {}  # one idempotency key twice in a unit: one job
        for submission in unit:
            if submission.key.id not in valid:  # revoked since the submit read it
                answers.append(unauthorized("API key revoked"))
                created.append([])
                continue
            stored, made = resolve(session, submission.key, submission.requests, seen)
            answers.append(stored)
            created.append(made)
        new: list[Job] = []
        checked = {submission.key.id for submission, made in zip(unit, created) if made}
        if not checked:  # nothing new (repeats of stored jobs, revoked keys): nothing to write
            return answers, new
        # The quotas are checked against the keys' usage rows, locked in this transaction (api/keys/quotas.py).
        with one_writer(session):
            admission = Admission(session, checked, get_settings())
            unloaded = unloaded_roles(session)  # read in the unit's transaction: an unload is exact from its commit
            refused: dict[uuid.UUID, ApiError] = {}  # new jobs of a refused submit, by id: never stored
            for index, submission in enumerate(unit):
                answer = answers[index]
                if isinstance(answer, ApiError):
                    continue
                # a repeat of an idempotency key whose submit was refused earlier in this unit is refused with it
                error = next((refused[job.id] for job, _ in answer if job.id in refused), None)
                error = error or _unloaded(created[index], unloaded) or admission.take_jobs(submission.key.id,
                                                                                           created[index])
                if error is not None:
                    refused.update((job.id, error) for job in created[index])
                    answers[index] = error
                    continue
                new += created[index]
            started = time.perf_counter()
            if new:
                insert_rows(session, new)
            session.commit()  # even with every new job refused: a rollback would expire the repeats' stored jobs
        if new and self.on_unit is not None:
            self.on_unit(len(unit), time.perf_counter() - started)
        return answers, new

    def _store_alone(self, session: Session, submission: Submission) -> None:
        try:
            if submission.key.id not in _valid_keys(session, {submission.key.id}):
                raise unauthorized("API key revoked")
            submission.future.set_result(store_jobs(session, submission.key, submission.requests, self.wakeups))
        except Exception as exc:
            session.rollback()
            submission.future.set_exception(exc)


def _unloaded(jobs: list[Job], unloaded: set[str]) -> ApiError | None:
    """A submit to a role unloaded at run time is refused whole (an `auto` job runs on Laya first)."""
    roles = sorted({job.adapter for job in jobs} & unloaded)
    if not roles:
        return None
    return ApiError(503, "adapter_unloaded", f"adapter {roles[0]} is unloaded (POST /v1/load_lora_adapter loads it "
                    "again); nothing was stored", headers={"Retry-After": RETRY_AFTER_S})


def _valid_keys(session: Session, key_ids: set[uuid.UUID]) -> set[uuid.UUID]:
    rows = session.execute(select(ApiKey.id, ApiKey.revoked_at).where(ApiKey.id.in_(key_ids)))
    return {key_id for key_id, revoked_at in rows if not is_revoked_at(revoked_at)}
