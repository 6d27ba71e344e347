"""The engine's loop: between decode steps it claims queued jobs into free slots, prefills them, and hands the
rows each step finishes to the result writer (docs/architecture.md §3, §14). A job is claimed when it takes a
slot; jobs claimed together are one claim group (a `batches` row)."""

from __future__ import annotations

import functools
import logging
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

from shared.db import session_scope, write_scope
from shared.models import ClaimGroup, Job, Priority
from shared.settings import Settings
from worker.engine.build import build_decoder
from worker.engine.policy import (
    PrefillPacer,
    apart_from_batch_lines,
    latency_jobs_apart,
    plan_slots,
    prefill_group,
    prefill_order,
    reserved_slots,
    unpaced_prefix,
)
from worker.engine.token_stream import TokenPublisher
from worker.engine.writer import ResultWriter
from worker.generation import GenerationRequest, GenerationResult
from worker.ledger.claims import claim_group, claimable, queue_snapshot, worker_name
from worker.ledger.fair_share import KeyTurns
from worker.ledger.leases import leases_kept
from worker.ledger.settle import failed, generation_request, unreadable
from worker.memory import (
    CARD_FULL_PAUSE_S,
    GIB,
    after_prefill_out_of_memory,
    after_step_out_of_memory,
    alone_out_of_memory,
    is_out_of_memory,
    memory_taken_elsewhere,
)
from worker.metrics import METRICS

if TYPE_CHECKING:  # torch is imported only in the worker child
    from worker.model.loading import LoadedModel

INTERACTIVE_QUIET_S = 10.0  # after this long without an interactive job, batch lines prefill unbounded

log = logging.getLogger("kevlaya.worker")
# After a look at the queue found nothing to claim, the next look waits this long, unless a reserved slot stands
# unused: then a job of its role may come at any step and is looked for at every step (a look runs inside the step,
# while the GPU computes; docs/architecture.md §4).
IDLE_POLL_S = 0.02


class Claimed(NamedTuple):
    """A job that holds a slot and waits for its prefill."""

    request: GenerationRequest
    prompt_tokens: int
    claimed_at: float  # time.monotonic()


def _caught(work: Callable[[], None], raised: list[BaseException]) -> None:
    """Run `work`, keeping what it raises in `raised`."""
    try:
        work()
    except BaseException as exc:
        raised.append(exc)


class Engine:
    """The slots of one worker process and the loop that fills them."""

    def __init__(self, loaded: LoadedModel, settings: Settings):
        self.loaded, self.settings = loaded, settings
        self.decoder = build_decoder(loaded, settings)
        self.expected_tokens = {a: settings.adapter_profile(a).max_new_tokens for a in loaded.adapters}
        if reserved := self._reserved():
            log.info("engine: slots reserved per adapter %s of %d", reserved, self.decoder.limit)
        self.worker = worker_name()
        self.turns = KeyTurns()  # whom this worker's claims served last: keys take turns (docs/architecture.md §3)
        self.draining = threading.Event()
        self.to_prefill: list[Claimed] = []  # claimed, not yet prefilled
        self.prefilling: list[Claimed] = []  # the jobs of the decoder's prefill under way (passes between steps)
        self.pacer = PrefillPacer(settings.engine.prefill_share)
        self.interactive_at = -INTERACTIVE_QUIET_S  # time.monotonic() of the last interactive job claimed
        self.stream = TokenPublisher(settings, lambda: list(self.decoder.rows), self.decoder.grammars.token_bytes)
        self.writer = ResultWriter(loaded.tokenizer, settings, self._peak, self.stream)
        # what the decoder counted (steps launched, seconds waiting for the GPU) up to the last step's metrics
        self.counted = (0, 0.0)
        # The writer's work must not hold the decode loop at each lock hand-back (settings: engine.switch_interval_ms).
        sys.setswitchinterval(settings.engine.switch_interval_ms / 1000)

    def drain(self, budget_s: float) -> int:
        """Claim and decode until nothing is queued or in flight; stop claiming after `budget_s`. Returns the jobs
        claimed."""
        self.draining.set()
        try:
            with leases_kept(self.writer.live_groups, self.settings.reliability.lease_seconds):
                claimed = self._loop(time.monotonic() + budget_s)
                self.writer.wait()  # every result stored before the task ends
        finally:
            self.draining.clear()
        return claimed

    def _loop(self, deadline: float) -> int:
        claimed, next_look = 0, 0.0

        def claim() -> None:
            nonlocal claimed, next_look
            with METRICS.engine_phase.labels("claim").time():
                took = self._claim()
            claimed += took
            next_look = 0.0 if took or self._reservation_unused() else now + IDLE_POLL_S

        while True:
            now = time.monotonic()
            due = now < deadline and now >= next_look and self.decoder.free > len(self.to_prefill)
            if due and not self.decoder.rows:
                claim()
                due = False
            self._prefill_some()
            if not self.decoder.rows:
                if not self.to_prefill and not self.prefilling and (now >= deadline or not self._queued()):
                    return claimed
                next_look = 0.0  # nothing in flight: look again at once
                continue
            # With rows in flight, the claim's database work runs while the GPU computes the step: the jobs it
            # claims are prefilled after the step, and no row waits for the claim. A claim that raises is raised
            # here, after the step, as it would be on its own; it is not the step's failure.
            raised: list[BaseException] = []
            with METRICS.engine_phase.labels("step").time():
                self._step(functools.partial(_caught, claim, raised) if due else None)
            if raised:
                raise raised[0]

    def _queued(self) -> bool:
        with session_scope() as session:
            return queue_snapshot(session).has_work()

    # -- claiming ----------------------------------------------------------------------------------------------

    def _claim(self) -> int:
        """Claim jobs for the free slots; returns how many were claimed."""
        free = self.decoder.free - len(self.to_prefill)
        with session_scope() as session:
            plan = plan_slots(queue_snapshot(session), free, self.settings.engine.max_wait_ms, self.expected_tokens,
                              self._reserved(), self._in_flight(), self._batch_room())
            # Slots the plan leaves free (a reservation's) are spare already; a claim keeps only the rest.
            unplanned = free - sum(count for _, count in plan)
            spare = max(0, min(self.settings.engine.key_spare_slots, self.decoder.limit - 1) - unplanned)
            plan = [(a, count) for a, count in plan if claimable(session, a, count, self.turns, spare)]
        claimed = 0
        for adapter, count in plan:
            with write_scope() as session:
                group, jobs = claim_group(session, adapter, count, self.worker, self.settings.reliability.lease_seconds,
                                          self.turns, spare)
            if jobs:
                claimed += len(jobs)
                self._start(group, jobs)
        return claimed

    def _reserved(self) -> dict[str, int]:
        # From the current limit: after an out-of-memory shrank it, a reservation must not take the last slots.
        return reserved_slots(self.settings, self.loaded.adapters,
                              min(self.settings.engine.max_batch, self.decoder.limit))

    def _reservation_unused(self) -> bool:
        """Whether a role with reserved slots holds fewer rows than it reserves: its next job takes one at once."""
        in_flight = self._in_flight()
        return any(in_flight[adapter] < count for adapter, count in self._reserved().items())

    def _interactive(self) -> bool:
        """Whether interactive jobs come now: one was claimed in the last INTERACTIVE_QUIET_S."""
        return time.monotonic() - self.interactive_at < INTERACTIVE_QUIET_S

    def _batch_room(self) -> int | None:
        """How many more batch lines may take slots: while interactive jobs come, lines hold at most half of
        KEVLAYA_ENGINE__MAX_BATCH, so an interactive row decodes beside fewer of them; else no bound."""
        if not self._interactive():
            return None
        held = sum(row.request.background for row in self.decoder.rows)
        held += sum(c.request.background for c in self.to_prefill + self.prefilling)
        return max(0, self.settings.engine.max_batch // 2 - held)

    def _in_flight(self) -> Counter[str]:
        """Slots each adapter's interactive jobs hold or are about to hold (claimed, waiting for or in their
        prefill): what its reservation is counted against."""
        return Counter([self.decoder.adapters[row.adapter] for row in self.decoder.rows if not row.request.background]
                       + [c.request.adapter for c in self.to_prefill + self.prefilling if not c.request.background])

    def _start(self, group: ClaimGroup, jobs: list[Job]) -> None:
        self.writer.add(group, jobs)
        self.stream.started(jobs)
        METRICS.rows_in_flight.set(len(self.decoder.rows) + len(jobs))
        log.info("claim group %s: %d job(s) on %s take free slots", group.id, len(jobs), group.adapters)
        if any(job.priority == Priority.INTERACTIVE for job in jobs):
            self.interactive_at = time.monotonic()
        for job in jobs:
            try:  # a row this worker cannot read or check fails alone, never the loop or its group-mates
                request = generation_request(job, self.settings)
                tokens, problem = self._check(request)
            except Exception as exc:
                self.writer.store([(job.id, unreadable(exc))])
                continue
            if problem is not None:
                self.writer.store([(job.id, failed(*problem))])
                continue
            self.to_prefill.append(Claimed(request, tokens, time.monotonic()))

    def _check(self, request: GenerationRequest) -> tuple[int, tuple[str, str] | None]:
        """The job's prompt tokens, and why it cannot take a slot (it fails alone, with a code) or None."""
        if reason := self.loaded.refusal(request.adapter):
            return 0, ("adapter_unavailable", reason)
        tokens, problem = self.loaded.check(request)
        if problem is not None:
            return tokens, ("invalid_input", problem)
        if not self.decoder.fits(tokens, request.max_new_tokens):
            return tokens, ("invalid_input", f"the prompt is {tokens} tokens; with max_new_tokens "
                            f"{request.max_new_tokens} that is over this worker's window of {self.decoder.window} "
                            "tokens (KEVLAYA_ENGINE__WINDOW_TOKENS)")
        return tokens, None

    # -- prefill and decode ------------------------------------------------------------------------------------

    def _prefill_some(self) -> None:
        """Prefill claimed jobs up to KEVLAYA_ENGINE__PREFILL_TOKENS padded tokens (at least one job), so rows
        already decoding wait one bounded prefill per step, not a whole burst's, and its memory is the one
        measured at start. While rows decode, a prefill of other roles' jobs runs one pass per step
        (KEVLAYA_ENGINE__PREFILL_BETWEEN_STEPS), and a latency role's job claimed meanwhile goes first. While a
        latency role's row decodes, other roles' prefills are paced (PrefillPacer, KEVLAYA_ENGINE__PREFILL_SHARE)."""
        now = time.monotonic()
        waited = [(now - c.claimed_at) * 1000 for c in self.to_prefill]
        order = prefill_order([c.request.max_new_tokens for c in self.to_prefill], waited,
                              self.settings.engine.max_wait_ms, [c.request.background for c in self.to_prefill])
        self.to_prefill, waited = [self.to_prefill[i] for i in order], [waited[i] for i in order]
        tokens = [c.prompt_tokens for c in self.to_prefill]
        # Batch lines go a few at a time only while interactive jobs come: alone, a batch drains at full speed.
        count = apart_from_batch_lines(prefill_group(tokens, self.decoder.free, self.settings.engine.prefill_tokens),
                                       [c.request.background for c in self.to_prefill], tokens,
                                       self.settings.engine.batch_prefill_tokens if self._interactive() else None)
        roles = set(self._reserved())
        latency = [c.request.adapter in roles and not c.request.background for c in self.to_prefill]
        paced = not self.pacer.allows(now, any(self.decoder.adapters[r.adapter] in roles and not r.request.background
                                               for r in self.decoder.rows))
        if paced:
            count = min(count, unpaced_prefix(latency, waited, self.settings.engine.max_wait_ms))
        count = latency_jobs_apart(count, latency)
        between_steps = (count > 0 and not latency[0] and bool(self.decoder.rows)
                         and self.settings.engine.prefill_between_steps)
        if between_steps and self.prefilling:
            count = 0  # one prefill under way at a time
        chosen = self.to_prefill[:count]
        del self.to_prefill[:count]
        if between_steps and chosen:
            self.decoder.begin_prefill([c.request for c in chosen], time.perf_counter())
            self.prefilling = chosen
        elif chosen:
            self._prefill_whole([c.request for c in chosen], latency=all(latency[:count]))
        if self.prefilling and (not paced or self._held_past_bound(self.prefilling, now)):
            self._prefill_pass()

    def _held_past_bound(self, claimed: list[Claimed], now: float) -> bool:
        return any((now - c.claimed_at) * 1000 > self.settings.engine.max_wait_ms for c in claimed)

    def _prefill_whole(self, chosen: list[GenerationRequest], latency: bool) -> None:
        handed_at, started = time.perf_counter(), time.monotonic()
        with METRICS.engine_phase.labels("prefill").time():
            try:
                finished = self.decoder.prefill(chosen, handed_at)
            except Exception as exc:
                finished = self._prefill_one_by_one(chosen, handed_at, exc)
        if not latency:
            self.pacer.ran(started, time.monotonic())
        self._finished(finished)

    def _prefill_pass(self) -> None:
        """The next pass of the prefill under way; when it fails, its jobs are dealt with as a whole prefill's."""
        started = time.monotonic()
        with METRICS.engine_phase.labels("prefill").time():
            try:
                finished = self.decoder.prefill_pass()
            except Exception as exc:
                requests = self.decoder.cancel_prefill()
                finished = self._prefill_one_by_one(requests, time.perf_counter(), exc)
        self.pacer.ran(started, time.monotonic())
        self._finished(finished)

    def _prefill_one_by_one(self, requests: list[GenerationRequest], handed_at: float,
                            error: Exception) -> list[GenerationResult]:
        """The group's prefill raised: out of memory puts them back in the queue; anything else is retried
        row by row, so a job that breaks it fails alone (`internal`) and the others still run."""
        if is_out_of_memory(error):
            if len(requests) == 1 and not self.decoder.rows:  # alone, it can never run here
                self._out_of_memory_alone(requests[0])
                return []
            self.decoder.limit = after_prefill_out_of_memory(len(self.decoder.rows))
            log.warning("out of memory prefilling %d job(s); they go back to the queue, at most %d row(s) from now",
                        len(requests), self.decoder.limit)
            self.writer.release([r.job_id for r in requests])
            METRICS.oom_give_backs.inc(len(requests))
            return []
        log.exception("prefilling %d job(s) failed; prefilling them one by one to isolate the cause", len(requests),
                      exc_info=error)
        finished = []
        for request in requests:
            try:
                finished += self.decoder.prefill([request], handed_at)
            except Exception as exc:
                log.exception("job %s fails the decoder even alone", request.job_id)
                self.writer.store([(request.job_id, failed("internal", f"{exc.__class__.__name__}: {exc}"))])
        return finished

    def _step(self, meanwhile: Callable[[], None] | None) -> None:
        try:
            finished = self.decoder.step(meanwhile)
        except Exception as exc:
            if is_out_of_memory(exc):
                # a prefill under way would join a step that no longer fits: its jobs go back first
                aside, self.prefilling = self.decoder.cancel_prefill(), []
                if len(self.decoder.rows) == 1 and not aside:  # alone, it can never run here
                    self._out_of_memory_alone(self.decoder.clear()[0])
                    return
                count, self.decoder.limit = after_step_out_of_memory(len(self.decoder.rows))
                given_back = aside + self.decoder.drop_newest(count)
                log.warning("out of memory in a step; %d newest job(s) go back to the queue, at most %d row(s) "
                            "from now", len(given_back), self.decoder.limit)
                self.writer.release([r.job_id for r in given_back])
                METRICS.oom_give_backs.inc(len(given_back))
                return
            log.exception("a decode step failed; the %d job(s) in flight fail", len(self.decoder.rows))
            failure = failed("internal", f"{exc.__class__.__name__}: {exc}")
            self.writer.store([(request.job_id, failure) for request in self.decoder.clear()])
            return
        steps, waited_s = self.decoder.steps, self.decoder.waited_s  # only a step launches
        METRICS.engine_phase.labels("wait").observe(waited_s - self.counted[1])
        METRICS.steps.inc(steps - self.counted[0])
        self.counted = (steps, waited_s)
        self._finished(finished)

    def _out_of_memory_alone(self, request: GenerationRequest) -> None:
        """A job that runs out of memory with nothing beside it fails, rather than going back to the queue again;
        unless another process filled the card, which says nothing of whether the job fits the budget."""
        if memory_taken_elsewhere(int(self.settings.engine.vram_budget_gb * GIB)):
            log.warning("job %s: out of memory on a card another process filled; it goes back to the queue",
                        request.job_id)
            self.writer.release([request.job_id])
            METRICS.oom_give_backs.inc()
            time.sleep(CARD_FULL_PAUSE_S)
            return
        message = alone_out_of_memory(request.max_new_tokens)
        log.warning("job %s: %s", request.job_id, message)
        self.writer.store([(request.job_id, failed("out_of_memory", message))])

    def _finished(self, results: list[GenerationResult]) -> None:
        if self.decoder.prefilling is None:  # its last pass ran (or a step ran it, near the window's end)
            self.prefilling = []
        self.stream.tick()
        self.writer.store([(result.job_id, result) for result in results])  # one transaction for the step's rows
        METRICS.rows_in_flight.set(len(self.decoder.rows))

    def _peak(self) -> int | None:
        if self.loaded.device != "cuda":
            return None
        import torch

        return torch.cuda.max_memory_allocated()


