"""The continuous engine: glue between the job ledger and the SlotDecoder (docs/architecture.md §14).

Between decode steps it claims queued jobs into free slots (the same claim, lease and exactly-once rules as
the batch engine: a job is claimed when it takes a slot); the rows a step finished are stored by a writer
thread at once, in one transaction, so the decode loop never waits on the database. Jobs claimed together form
one `batches` row.
"""

from __future__ import annotations

import copy
import gc
import logging
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import TYPE_CHECKING, NamedTuple

from shared import lifecycle
from shared.db import session_scope
from shared.models import Batch, Job, JobStatus
from shared.settings import Settings
from worker.claims import JobOutcome, claim_batch, queue_snapshot
from worker.engine import announce_escalations, generation_request, leases_kept, settle_job, worker_name
from worker.generation import BatchOutcome, GenerationRequest, GenerationResult
from worker.metrics import METRICS
from worker.scheduler import (
    BatchPlan,
    PrefillPacer,
    SchedulingPolicy,
    plan_slots,
    prefill_group,
    prefill_order,
    unpaced_prefix,
)
from worker.tokens import decode_with_spans

if TYPE_CHECKING:  # torch is imported only in the worker child
    from worker.continuous import SlotDecoder
    from worker.runtime import AdapterRuntime

log = logging.getLogger("kevlaya.worker")
# After a look at the queue found nothing to claim, the next look waits this long: a step is milliseconds, and a
# database query per step would cost the decode loop more than the few milliseconds a new job may wait.
IDLE_POLL_S = 0.02


@dataclass
class Wave:
    """Jobs claimed together (one `batches` row); closed when the last of them is stored."""

    batch: Batch
    jobs: dict[uuid.UUID, Job]
    results: list[GenerationResult] = field(default_factory=list)  # of the jobs that reached the model
    stored: int = 0
    escalated: int = 0
    lost: int = 0
    released: int = 0

    @property
    def done(self) -> bool:
        return self.stored + self.released == len(self.jobs)


class Claimed(NamedTuple):
    """A job that holds a slot and waits for its prefill."""

    request: GenerationRequest
    prompt_tokens: int
    claimed_at: float  # time.monotonic()


def reserved_slots(settings: Settings, adapters: Iterable[str], rows: int) -> dict[str, int]:
    """Each adapter's `reserved_slots`, at most a quarter of `rows`, so a reservation never starves the rest."""
    reserved = {a: min(settings.adapter_profile(a).reserved_slots, rows // 4) for a in sorted(adapters)}
    return {a: n for a, n in reserved.items() if n > 0}


def build_decoder(runtime: AdapterRuntime, settings: Settings) -> SlotDecoder:
    """A decoder with `max_batch` slots plus the reserved ones (docs/architecture.md §14), fewer where the memory
    budget holds fewer (CUDA): sized first from `KEVLAYA_ENGINE_WORKSPACE_GB`, then measured (graphs captured,
    the largest prefill run) and rebuilt with fewer slots until the measured peak fits the budget."""
    import torch

    from worker.admission import SlotBudget, kv_bytes_per_token
    from worker.continuous import SlotDecoder
    from worker.kv_slots import kv_shape

    context = getattr(runtime.model.config, "max_position_embeddings", None) or settings.engine_window_tokens
    window = min(settings.engine_window_tokens, context)
    # Reserved slots come on top of max_batch, so a role's backlog keeps max_batch rows when memory allows.
    wanted = settings.max_batch + sum(reserved_slots(settings, runtime.adapters, settings.max_batch).values())
    graphs = settings.engine_cuda_graphs and runtime.device == "cuda"

    def decoder(slots: int) -> SlotDecoder:
        return SlotDecoder(runtime.model, runtime.tokenizer, sorted(runtime.adapters), slots=slots, window=window,
                           eos_ids=runtime.eos_ids, ignore_eos=settings.ignore_eos, graphs=graphs, texts=False)

    if runtime.device != "cuda":
        return decoder(wanted)
    torch.cuda.empty_cache()  # what loading left cached is not the decoder's to count
    budget = SlotBudget(
        budget_bytes=int(settings.vram_budget_gb * 2**30), resident_bytes=torch.cuda.memory_allocated(),
        workspace_bytes=int(settings.engine_workspace_gb * 2**30),
        kv_per_token=kv_bytes_per_token(*kv_shape(runtime.model.config), dtype_bytes=2), window=window)
    slots = budget.slots(wanted)
    log.info("continuous engine: %s", budget.explain(wanted))
    while slots > 0:
        built, peak = _measured(decoder, slots, settings.engine_prefill_tokens)
        fewer = budget.after_measuring(slots, peak)
        if fewer == slots:
            log.info("continuous engine: %d slot(s); measured peak %.2f GiB of the %.2f GiB budget (workspace "
                     "%.2f GiB)", slots, peak / 2**30, settings.vram_budget_gb,
                     (peak - budget.resident_bytes - slots * budget.per_slot) / 2**30)
            return built
        log.warning("continuous engine: %d slot(s) %s the %.2f GiB budget; trying %d", slots,
                    "ran out of memory within" if peak is None else f"peaked at {peak / 2**30:.2f} GiB over",
                    settings.vram_budget_gb, fewer)
        if built is not None:
            built.close()
        del built
        gc.collect()  # the decoder and its graphs hold each other: free their memory before the next build
        torch.cuda.empty_cache()
        slots = fewer
    raise RuntimeError(f"the VRAM budget holds no slot: {budget.explain(wanted)}; lower "
                       "KEVLAYA_ENGINE_WINDOW_TOKENS or KEVLAYA_ENGINE_PREFILL_TOKENS, or raise KEVLAYA_VRAM_BUDGET_GB")


def _measured(decoder: Callable[[int], SlotDecoder], slots: int,
              prefill_tokens: int) -> tuple[SlotDecoder | None, int | None]:
    """A decoder of `slots` and the peak memory it reserved, graphs captured and the largest prefill the engine
    runs (KEVLAYA_ENGINE_PREFILL_TOKENS, padded, whole windows) done; (None, None) when that ran out of memory."""
    import torch

    from worker.runtime import is_out_of_memory

    torch.cuda.reset_peak_memory_stats()
    built = None
    try:
        built = decoder(slots)
        built.throwaway_prefill(rows=-(-max(prefill_tokens, built.window) // built.window), width=built.window)
        torch.cuda.synchronize()
        return built, torch.cuda.max_memory_reserved()
    except Exception as exc:
        if built is not None:
            built.close()  # the model gets its PEFT path back whatever happened
        if not is_out_of_memory(exc):
            raise
        return None, None


class SlotEngine:
    """Owns the loaded runtime (through its decoder) and the slots of one worker process."""

    def __init__(self, runtime: AdapterRuntime, settings: Settings):
        self.runtime, self.settings = runtime, settings
        self.decoder = build_decoder(runtime, settings)
        self.policy = SchedulingPolicy(max_batch=self.decoder.limit, max_wait_ms=settings.max_wait_ms,
                                       max_consecutive_batches=settings.max_consecutive_batches)
        self.expected_tokens = {a: settings.adapter_profile(a).max_new_tokens for a in runtime.adapters}
        if reserved := self._reserved():
            log.info("continuous engine: slots reserved per adapter %s of %d", reserved, self.decoder.limit)
        self.worker = worker_name()
        self.draining = threading.Event()
        self.waves: dict[uuid.UUID, Wave] = {}  # by batch id
        self.wave_of: dict[uuid.UUID, Wave] = {}  # by job id, while the job is claimed by this engine
        self.to_prefill: list[Claimed] = []  # claimed, not yet prefilled
        self.pacer = PrefillPacer(settings.engine_prefill_share)
        self.writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="result-writer")
        # The writer makes the results' text with its own tokenizer: the decode loop's one changes its padding
        # settings while it encodes, which a decode on another thread must not see.
        self.text_tokenizer = copy.deepcopy(runtime.tokenizer)
        # The writer's work must not hold the decode loop at each lock hand-back (settings: engine_switch_interval_ms).
        sys.setswitchinterval(settings.engine_switch_interval_ms / 1000)
        self.pending: list[Future] = []
        self._lock = threading.Lock()  # waves are read by the lease thread and written by the writer

    # -- the loop ----------------------------------------------------------------------------------------------

    def drain(self, budget_s: float) -> int:
        """Admit and decode until nothing is queued or in flight; stop admitting after `budget_s`."""
        self.draining.set()
        try:
            with leases_kept(self._live_batches, self.settings.lease_seconds):
                processed = self._loop(time.monotonic() + budget_s)
                for future in self.pending:  # every result stored before the task ends
                    future.result()
        finally:
            self.pending.clear()
            self.draining.clear()
        return processed

    def _loop(self, deadline: float) -> int:
        processed, next_look = 0, 0.0
        while True:
            now = time.monotonic()
            if now < deadline and now >= next_look and self.decoder.free > len(self.to_prefill):
                with METRICS.engine_phase.labels("claim").time():
                    claimed = self._claim()
                processed += claimed
                next_look = 0.0 if claimed else now + IDLE_POLL_S
            self._prefill_some()
            if not self.decoder.rows:
                if not self.to_prefill and (now >= deadline or not self._queued()):
                    return processed
                next_look = 0.0  # nothing in flight: look again at once
                continue
            with METRICS.engine_phase.labels("step").time():
                self._step()

    def _queued(self) -> bool:
        with session_scope() as session:
            return bool(queue_snapshot(session).waiting())

    def _claim(self) -> int:
        """Claim jobs for the free slots; returns how many were claimed."""
        free = self.decoder.free - len(self.to_prefill)
        with session_scope() as session:
            plan = plan_slots(queue_snapshot(session), free, self.policy, self.expected_tokens, self._reserved(),
                              self._in_flight())
        claimed = 0
        for adapter, count in plan:
            with session_scope() as session:
                batch, jobs = claim_batch(session, BatchPlan((adapter,), count, switch=False), self.worker,
                                          self.settings.lease_seconds)
            if jobs:
                claimed += len(jobs)
                self._start(batch, jobs)
        return claimed

    def _reserved(self) -> dict[str, int]:
        # From the current limit: after an out-of-memory shrank it, a reservation must not take the last slots.
        return reserved_slots(self.settings, self.runtime.adapters, min(self.settings.max_batch, self.decoder.limit))

    def _in_flight(self) -> Counter[str]:
        """Slots each adapter holds or is about to hold (claimed, waiting for its prefill)."""
        return Counter([self.decoder.adapters[row.adapter] for row in self.decoder.rows]
                       + [claimed.request.adapter for claimed in self.to_prefill])

    def _start(self, batch: Batch, jobs: list[Job]) -> None:
        wave = Wave(batch=batch, jobs={job.id: job for job in jobs})
        with self._lock:
            self.waves[batch.id] = wave
        METRICS.rows_in_flight.set(len(self.decoder.rows) + len(jobs))
        log.info("batch %s: %d job(s) on %s take free slots", batch.id, len(jobs), batch.adapters)
        for job in jobs:
            try:  # a row this worker cannot read or check fails alone, never the loop or its batch-mates
                request = generation_request(job, self.settings)
                tokens, problem = self._check(request)
            except Exception as exc:
                self._store(wave, job, JobOutcome(status=JobStatus.FAILED, error_code="invalid_input",
                                                  error_message=f"the stored job cannot be read: "
                                                                f"{exc.__class__.__name__}: {exc}"))
                continue
            if problem is not None:
                code, message = problem
                self._store(wave, job, JobOutcome(status=JobStatus.FAILED, error_code=code, error_message=message))
                continue
            self.wave_of[job.id] = wave
            self.to_prefill.append(Claimed(request, tokens, time.monotonic()))

    def _check(self, request: GenerationRequest) -> tuple[int, tuple[str, str] | None]:
        """The job's prompt tokens, and why it cannot take a slot (it fails alone, with a code) or None."""
        if reason := self.runtime.refusal(request.adapter):
            return 0, ("adapter_unavailable", reason)
        tokens, problem = self.runtime.check(request)
        if problem is not None:
            return tokens, ("invalid_input", problem)
        if not self.decoder.fits(tokens, request.max_new_tokens):
            return tokens, ("invalid_input", f"the prompt is {tokens} tokens; with max_new_tokens "
                            f"{request.max_new_tokens} that is over this worker's window of {self.decoder.window} "
                            "tokens (KEVLAYA_ENGINE_WINDOW_TOKENS)")
        return tokens, None

    def _prefill_some(self) -> None:
        """Prefill claimed jobs up to KEVLAYA_ENGINE_PREFILL_TOKENS padded tokens (at least one job), so rows
        already decoding wait one bounded prefill per step, not a whole burst's, and its memory is the one
        measured at start (build_decoder). While a latency role's row decodes, other roles' jobs are paced
        (PrefillPacer, KEVLAYA_ENGINE_PREFILL_SHARE)."""
        now = time.monotonic()
        waited = [(now - c.claimed_at) * 1000 for c in self.to_prefill]
        order = prefill_order([c.request.max_new_tokens for c in self.to_prefill], waited, self.settings.max_wait_ms)
        self.to_prefill, waited = [self.to_prefill[i] for i in order], [waited[i] for i in order]
        count = prefill_group([c.prompt_tokens for c in self.to_prefill], self.decoder.free,
                              self.settings.engine_prefill_tokens)
        roles = set(self._reserved())
        latency = [c.request.adapter in roles for c in self.to_prefill]
        if not self.pacer.allows(now, any(self.decoder.adapters[r.adapter] in roles for r in self.decoder.rows)):
            count = min(count, unpaced_prefix(latency, waited, self.settings.max_wait_ms))
        chosen = [c.request for c in self.to_prefill[:count]]
        del self.to_prefill[:count]
        if not chosen:
            return
        admitted_at, started = time.perf_counter(), time.monotonic()
        with METRICS.engine_phase.labels("prefill").time():
            try:
                finished = self.decoder.admit(chosen, admitted_at)
            except Exception as exc:
                finished = self._admit_one_by_one(chosen, admitted_at, exc)
        if not all(latency[:count]):
            self.pacer.ran(started, time.monotonic())
        self._finished(finished)

    def _admit_one_by_one(self, requests: list[GenerationRequest], admitted_at: float,
                          error: Exception) -> list[GenerationResult]:
        """The group's prefill raised: out of memory puts them back in the queue; anything else is retried
        row by row, so a job that breaks it fails alone (`internal`) and the others still run."""
        from worker.runtime import is_out_of_memory

        if is_out_of_memory(error):
            self.decoder.limit = max(1, len(self.decoder.rows))
            log.warning("out of memory admitting %d job(s); they go back to the queue, at most %d row(s) from now",
                        len(requests), self.decoder.limit)
            self._release([r.job_id for r in requests])
            return []
        log.exception("admitting %d job(s) failed; admitting them one by one to isolate the cause", len(requests),
                      exc_info=error)
        finished = []
        for request in requests:
            try:
                finished += self.decoder.admit([request], admitted_at)
            except Exception as exc:
                log.exception("job %s fails the decoder even alone", request.job_id)
                wave = self.wave_of.pop(request.job_id)
                self._store(wave, wave.jobs[request.job_id], JobOutcome(
                    status=JobStatus.FAILED, error_code="internal", error_message=f"{exc.__class__.__name__}: {exc}"))
        return finished

    def _step(self) -> None:
        from worker.runtime import is_out_of_memory

        try:
            finished = self.decoder.step()
        except Exception as exc:
            if is_out_of_memory(exc):
                given_back = self.decoder.give_back_newest(max(1, len(self.decoder.rows) // 2))
                log.warning("out of memory in a step; %d newest job(s) go back to the queue, at most %d row(s) "
                            "from now", len(given_back), self.decoder.limit)
                self._release([r.job_id for r in given_back])
                return
            log.exception("a decode step failed; the %d job(s) in flight fail", len(self.decoder.rows))
            failure = JobOutcome(status=JobStatus.FAILED, error_code="internal",
                                 error_message=f"{exc.__class__.__name__}: {exc}")
            for request in self.decoder.clear():
                wave = self.wave_of.pop(request.job_id)
                self._store(wave, wave.jobs[request.job_id], failure)
            return
        self._finished(finished)

    # -- results, off the decode loop --------------------------------------------------------------------------

    def _finished(self, results: list[GenerationResult]) -> None:
        items = []
        for result in results:
            wave = self.wave_of.pop(result.job_id)
            items.append((wave, wave.jobs[result.job_id], result))
        if items:  # the rows one step finished are stored in one transaction
            self._store_all(items)
        METRICS.rows_in_flight.set(len(self.decoder.rows))

    def _store(self, wave: Wave, job: Job, result: GenerationResult | JobOutcome) -> None:
        self._store_all([(wave, job, result)])

    def _store_all(self, items: list[tuple[Wave, Job, GenerationResult | JobOutcome]]) -> None:
        self.pending.append(self.writer.submit(self._write, items))
        self.pending = [f for f in self.pending if not f.done() or f.exception() is not None]

    def _write(self, items: list[tuple[Wave, Job, GenerationResult | JobOutcome]]) -> None:
        """Store what became of `items` in one transaction (one commit for a whole wave of rows, so the writer
        holds the process's interpreter lock for less of the decode loop's time); if that fails, each alone,
        so one job that cannot be stored does not take the others with it."""
        started = time.perf_counter()
        try:
            for _wave, _job, result in items:
                if isinstance(result, GenerationResult) and result.text is None:  # the decoder left it to us
                    result.text, result.token_spans = decode_with_spans(self.text_tokenizer, result.token_ids)
            with session_scope() as session:
                settled = [settle_job(session, job, wave.batch.id, result, 0.0, self.settings)
                           for wave, job, result in items]
        except Exception:
            if len(items) == 1:
                raise
            log.exception("storing %d results together failed; storing them one by one", len(items))
            for item in items:
                self._write([item])
            return
        for (wave, job, result), (stored, child) in zip(items, settled):
            METRICS.job_finished(job, result, 0.0)
            if not stored:
                log.warning("job %s had lost its lease; its result was discarded", job.id)
            announce_escalations([child] if child is not None else [])
            with self._lock:
                wave.lost += not stored
                wave.escalated += child is not None
                wave.stored += 1
                if isinstance(result, GenerationResult):
                    wave.results.append(result)
                if wave.done:
                    self._close(wave)
        METRICS.engine_phase.labels("store").observe(time.perf_counter() - started)

    def _close(self, wave: Wave) -> None:
        """Store the batch row's figures once its last job is stored."""
        self.waves.pop(wave.batch.id, None)
        results = wave.results
        outcome = BatchOutcome(
            results=results, switch_ms=0.0, prefill_ms=max((r.prefill_ms for r in results), default=0.0),
            decode_ms=max((r.decode_ms for r in results), default=0.0),
            tokens=sum(r.completion_tokens for r in results), peak_vram_bytes=self._peak())
        with session_scope() as session:
            session.query(Batch).filter(Batch.id == wave.batch.id).update({
                Batch.switch_ms: 0.0, Batch.prefill_ms: outcome.prefill_ms, Batch.decode_ms: outcome.decode_ms,
                Batch.tokens: outcome.tokens, Batch.peak_vram_bytes: outcome.peak_vram_bytes, Batch.oom_splits: 0,
                Batch.finished_at: datetime.now(timezone.utc),
            })
        METRICS.batch_closed(wave.batch, len(wave.jobs), outcome, mixed=False, switch=False,
                             escalated=wave.escalated, lost=wave.lost)

    def _peak(self) -> int | None:
        if self.runtime.device != "cuda":
            return None
        import torch

        return torch.cuda.max_memory_allocated()

    def _release(self, job_ids: list[uuid.UUID]) -> None:
        """Give jobs back to the queue unrun (not an attempt); their wave closes without them."""
        by_batch: dict[uuid.UUID, list[uuid.UUID]] = {}
        for job_id in job_ids:
            by_batch.setdefault(self.wave_of.pop(job_id).batch.id, []).append(job_id)
        for batch_id, ids in by_batch.items():
            with session_scope() as session:
                released = lifecycle.release(session, ids, batch_id)
            wave = self.waves[batch_id]
            with self._lock:
                wave.released += len(released)
                if wave.done:
                    self.pending.append(self.writer.submit(self._close_locked, wave))

    def _close_locked(self, wave: Wave) -> None:
        with self._lock:
            self._close(wave)

    def _live_batches(self) -> list[uuid.UUID]:
        with self._lock:
            return list(self.waves)
