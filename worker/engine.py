"""Glue between the scheduler, the job ledger and the model runtime: claim a batch, run it, record it."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from typing import TYPE_CHECKING

from sqlalchemy.orm import Session

from shared.db import session_scope
from shared.models import Batch, Job, JobStatus
from shared.queue import QueueUnavailable, publish_wakeup
from shared.schemas import to_messages, with_system_prompt
from shared.settings import Settings
from worker.cascade import escalate, is_cascade_head, needs_escalation
from worker.claims import JobOutcome, claim_batch, finish_job, queue_snapshot, renew_leases
from worker.generation import BatchOutcome, GenerationRequest, GenerationResult
from worker.metrics import METRICS
from worker.outcomes import job_outcome
from worker.scheduler import BatchPlan, SchedulerState, SchedulingPolicy, plan_next_batch

if TYPE_CHECKING:  # the runtime imports torch, which only the worker child may initialise
    from worker.runtime import AdapterRuntime

log = logging.getLogger("kevlaya.worker")


def worker_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def generation_request(job: Job, settings: Settings) -> GenerationRequest:
    """What the model is asked for a stored job: its adapter's system prompt and defaults, its own params."""
    profile = settings.adapter_profile(job.adapter)  # type: ignore[arg-type]
    messages = with_system_prompt(to_messages(job.input), profile.system_prompt)
    params = job.params
    return GenerationRequest(
        job_id=job.id, adapter=job.adapter, messages=messages,
        max_new_tokens=params.get("max_new_tokens", profile.max_new_tokens),
        temperature=params.get("temperature", profile.temperature),
        top_p=params.get("top_p", profile.top_p),
        seed=params.get("seed"),
    )


def settle_job(session: Session, job: Job, batch_id: uuid.UUID, result: GenerationResult | JobOutcome,
               switch_ms: float, settings: Settings) -> tuple[bool, Job | None]:
    """Store what became of one job: its outcome, or, for an unsure `auto` head, its Kev stage. Returns whether
    this worker still held the lease, and the escalated stage if there is one."""
    outcome = result if isinstance(result, JobOutcome) else job_outcome(result, job.params.get("output", "decision"),
                                                                         switch_ms)
    if isinstance(result, GenerationResult) and is_cascade_head(job) and needs_escalation(
            outcome, settings.cascade_threshold):
        child = escalate(session, job, batch_id, outcome)
        return child is not None, child
    return finish_job(session, job, batch_id, outcome), None  # also settles an `auto` parent


def announce_escalations(children: list[Job]) -> None:
    for child in children:
        log.info("job %s: Laya was unsure, escalated to Kev as job %s", child.parent_job_id, child.id)
        try:
            publish_wakeup(child.id, child.adapter)
        except QueueUnavailable:
            pass  # a drain or the sweeper picks it up from the database anyway


@contextmanager
def leases_kept(batch_ids: Callable[[], Iterable[uuid.UUID]], lease_s: float) -> Iterator[None]:
    """Renew the leases of the batches `batch_ids()` names while the block runs, so only a dead worker's jobs
    ever expire."""
    stop = threading.Event()

    def renew() -> None:
        while not stop.wait(lease_s / 3):
            for batch_id in batch_ids():
                try:
                    with session_scope() as session:
                        renew_leases(session, batch_id, lease_s)
                except Exception:  # the next renewal may succeed; expiry is the safety net
                    log.exception("lease renewal failed for batch %s", batch_id)

    thread = threading.Thread(target=renew, name="lease-renewal", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


class BatchEngine:
    """Owns the loaded runtime and the scheduler state of one worker process."""

    def __init__(self, runtime: AdapterRuntime, settings: Settings):
        self.runtime, self.settings = runtime, settings
        self.state = SchedulerState()
        self.policy = SchedulingPolicy(
            max_batch=settings.max_batch, max_wait_ms=settings.max_wait_ms,
            max_consecutive_batches=settings.max_consecutive_batches, mixed=settings.mixed_batches,
        )
        self.worker = worker_name()
        self.draining = threading.Event()

    def drain(self, budget_s: float) -> int:
        """Run batches until nothing is queued or `budget_s` has passed; returns jobs processed."""
        deadline = time.monotonic() + budget_s
        processed = 0
        self.draining.set()
        try:
            while time.monotonic() < deadline:
                plan = self._next_plan()
                if plan is None:
                    break
                processed += self.run_one(plan)
        finally:
            self.draining.clear()
        return processed

    def _next_plan(self) -> BatchPlan | None:
        with session_scope() as session:
            snapshot = queue_snapshot(session)
        plan = plan_next_batch(snapshot, self.state, self.policy)
        if plan is None or self.settings.batch_window_ms == 0:
            return plan
        if sum(snapshot.queued.get(a, 0) for a in plan.adapters) < plan.limit:
            # A short gather window lets a burst coalesce into one batch.
            time.sleep(self.settings.batch_window_ms / 1000)
            with session_scope() as session:
                plan = plan_next_batch(queue_snapshot(session), self.state, self.policy)
        return plan

    def run_one(self, plan: BatchPlan) -> int:
        with session_scope() as session:
            batch, jobs = claim_batch(session, plan, self.worker, self.settings.lease_seconds)
        if not jobs:
            return 0
        log.info("batch %s: %d job(s) on %s%s", batch.id, len(jobs), batch.adapters,
                 " (adapter switch)" if plan.switch else "")
        METRICS.batch_started(len(jobs))
        requests, unreadable = self._requests(jobs)
        try:
            with leases_kept(lambda: [batch.id], self.settings.lease_seconds):
                outcome = self._run_isolating(requests, plan.mixed)
        except Exception as exc:  # a bug must fail the batch visibly, not re-run it forever
            log.exception("batch %s failed", batch.id)
            failure = JobOutcome(status=JobStatus.FAILED, error_code="internal",
                                 error_message=f"{exc.__class__.__name__}: {exc}")
            with session_scope() as session:
                for job in jobs:
                    finish_job(session, job, batch.id, failure)
            METRICS.batch_failed(batch, jobs, failure.error_message)
            return len(jobs)
        self.state.advance(plan)
        by_id = {r.job_id: r for r in outcome.results}
        escalated: list[Job] = []
        with session_scope() as session:
            lost = 0
            for job in jobs:
                stored, child = settle_job(session, job, batch.id, unreadable.get(job.id) or by_id[job.id],
                                           outcome.switch_ms, self.settings)
                lost += not stored
                escalated += [child] if child is not None else []
            session.query(Batch).filter(Batch.id == batch.id).update({
                Batch.switch_ms: outcome.switch_ms, Batch.prefill_ms: outcome.prefill_ms,
                Batch.decode_ms: outcome.decode_ms, Batch.tokens: outcome.tokens,
                Batch.peak_vram_bytes: outcome.peak_vram_bytes, Batch.oom_splits: outcome.oom_splits,
                Batch.finished_at: datetime.now(timezone.utc),
            })
        METRICS.batch_finished(plan, batch, jobs, outcome, escalated=len(escalated), lost=lost)
        if lost:
            log.warning("batch %s: %d job(s) had lost their lease; their results were discarded", batch.id, lost)
        announce_escalations(escalated)
        return len(jobs)

    def _requests(self, jobs: list[Job]) -> tuple[list[GenerationRequest], dict[uuid.UUID, JobOutcome]]:
        """Each job's generation request; a row this worker cannot read (written by another version of the
        service, or by hand) fails alone with `invalid_input` instead of failing its batch."""
        requests, unreadable = [], {}
        for job in jobs:
            try:
                requests.append(generation_request(job, self.settings))
            except Exception as exc:
                unreadable[job.id] = JobOutcome(status=JobStatus.FAILED, error_code="invalid_input",
                                                error_message=f"the stored job cannot be read: "
                                                              f"{exc.__class__.__name__}: {exc}")
        return requests, unreadable

    def _run_isolating(self, requests: list[GenerationRequest], mixed: bool) -> BatchOutcome:
        """The batch in one go; should the runtime raise, each request alone, so that a job that breaks it fails
        by itself (`internal`, naming the exception) and its batch-mates still get their answers."""
        if not requests:
            return BatchOutcome(results=[], switch_ms=0.0, prefill_ms=0.0, decode_ms=0.0, tokens=0,
                                peak_vram_bytes=None)
        try:
            return self.runtime.run_batch(requests, mixed=mixed)
        except Exception:
            if len(requests) == 1:
                raise
            log.exception("a batch of %d jobs failed; running them one by one to isolate the cause", len(requests))
        outcomes = []
        for request in requests:
            try:
                outcomes.append(self.runtime.run_batch([request], mixed=mixed))
            except Exception as exc:
                log.exception("job %s fails the runtime even alone", request.job_id)
                outcomes.append(BatchOutcome(
                    results=[GenerationResult(job_id=request.job_id, text=None, prompt_tokens=0, completion_tokens=0,
                                              prefill_ms=0.0, decode_ms=0.0, error_code="internal",
                                              error_message=f"{exc.__class__.__name__}: {exc}")],
                    switch_ms=0.0, prefill_ms=0.0, decode_ms=0.0, tokens=0, peak_vram_bytes=None))
        peaks = [o.peak_vram_bytes for o in outcomes if o.peak_vram_bytes is not None]
        return BatchOutcome(
            results=[r for o in outcomes for r in o.results], switch_ms=sum(o.switch_ms for o in outcomes),
            prefill_ms=sum(o.prefill_ms for o in outcomes), decode_ms=sum(o.decode_ms for o in outcomes),
            tokens=sum(o.tokens for o in outcomes), peak_vram_bytes=max(peaks) if peaks else None,
            oom_splits=sum(o.oom_splits for o in outcomes))

