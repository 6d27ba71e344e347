"""The engine's loop: plan, claim, run, store. Each iteration the scheduler (worker/engine/scheduler.py) decides
what happens — claim jobs into free slots, prefill them, run a pass of a prefill under way, step every row in
flight — and the loop does it: claims through the ledger, prefills and steps through the decoder, and hands the
rows each prefill and step finishes to the result writer (docs/architecture.md §3, §4, §14). A job is claimed when
it takes a slot; jobs claimed together are one claim group (a `batches` row)."""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from shared.db import session_scope, write_scope
from shared.models import ClaimGroup, Job, Priority
from shared.settings import ADAPTERS, Settings
from worker.engine.adapters import AdapterSwitcher
from worker.engine.build import build_decoder
from worker.engine.scheduler import Claimed, Decoding, Plan, Scheduler
from worker.engine.token_stream import TokenPublisher
from worker.engine.writer import ResultWriter
from worker.generation import GenerationRequest, GenerationResult
from worker.ledger.claims import QueueSnapshot, claim_group, claimable, queue_snapshot, worker_name
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

log = logging.getLogger("kevlaya.worker")


class Engine:
    """The slots of one worker process and the loop that fills them."""

    def __init__(self, loaded: LoadedModel, settings: Settings):
        self.loaded, self.settings = loaded, settings
        self.decoder = build_decoder(loaded, settings)
        self.scheduler = Scheduler(settings, loaded.adapters)
        if reserved := self.scheduler.reserved(self.decoder.limit):
            log.info("engine: slots reserved per adapter %s of %d", reserved, self.decoder.limit)
        self.worker = worker_name()
        self.turns = KeyTurns()  # whom this worker's claims served last: keys take turns (docs/architecture.md §3)
        self.draining = threading.Event()
        self.stream = TokenPublisher(settings, lambda: list(self.decoder.rows), self.decoder.grammars.token_bytes)
        self.writer = ResultWriter(loaded.tokenizer, settings, self._peak, self.stream)
        # the adapters asked for at run time (docs/architecture.md §10): followed now, then while draining
        self.adapters = AdapterSwitcher(loaded, settings)
        self._follow_adapters(force=True)
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
        """Plan, claim, run, store, until the plan says the drain is over: the scheduler decides, this loop does
        (each prefill, pass and step stores the rows it finished). Returns the jobs claimed."""
        self.scheduler.start(deadline)
        self._follow_adapters(force=True)
        claimed = 0
        while True:
            self._follow_adapters()
            plan = self.scheduler.plan(self._decoding(), time.monotonic(), self._queued)
            if plan.done:
                return claimed
            if plan.claim_now:  # nothing decodes: claim first, then plan again (that plan prefills what came)
                claimed += self._claim()
                continue
            self._prefill(plan)
            if plan.step:  # a claim the plan puts in the step runs while the GPU computes it
                claimed += self._step(claim=plan.claim_in_step)

    def _decoding(self) -> Decoding:
        """What the decoder holds, as the scheduler reads it."""
        rows = [(self.decoder.adapters[row.adapter], row.request.background) for row in self.decoder.rows]
        return Decoding(rows, self.decoder.free, self.decoder.limit)

    def _queued(self) -> bool:
        with session_scope() as session:
            return self._claimable_roles(queue_snapshot(session)).has_work()

    # -- adapters switched at run time -------------------------------------------------------------------------

    def _follow_adapters(self, force: bool = False) -> None:
        """Notice a role asked to change (at most every KEVLAYA_MODEL__ADAPTER_POLL_S) and switch each changed
        role at its safe point: when none of its rows is decoding, prefilling or waiting for its prefill. Its jobs
        are not claimed meanwhile, so the rows claimed before finish on the version they started with."""
        try:
            self.adapters.poll(force)
        except Exception as exc:  # the database may be away: the roles keep what they serve
            log.warning("could not read the adapters asked for: %s", exc)
        # unloads first: a new role's unload frees the spare block another new role's load may need
        for role in sorted(self.adapters.pending, key=lambda r: not self.adapters.pending[r].unloaded):
            if not self._runs(role):
                self.adapters.switch(role, self.decoder.lora)

    def _runs(self, role: str) -> bool:
        """Whether a job of `role` holds a slot: decoding, in the prefill under way, or claimed and waiting."""
        return (any(self.decoder.adapters[row.adapter] == role for row in self.decoder.rows)
                or any(c.request.adapter == role for c in self.scheduler.waiting + self.scheduler.prefilling))

    def _claimable_roles(self, snapshot: QueueSnapshot) -> QueueSnapshot:
        """The queue without the roles held (unloaded, switching, or blocked) and the new roles this worker does
        not serve yet (it has not seen their load): their jobs wait. Kev's and Laya's are claimed when their
        adapter failed to load, to fail with the reason."""
        held = self.adapters.held() | {a for a in snapshot.queued.keys() | snapshot.batch_lines.keys()
                                       if a not in ADAPTERS and a not in self.loaded.adapters}
        if not held:
            return snapshot
        return QueueSnapshot({a: n for a, n in snapshot.queued.items() if a not in held},
                             {a: w for a, w in snapshot.oldest_wait_ms.items() if a not in held},
                             {a: n for a, n in snapshot.batch_lines.items() if a not in held})

    # -- claiming ----------------------------------------------------------------------------------------------

    def _claim(self) -> int:
        """Claim as many jobs for each adapter as the scheduler says for the free slots; returns how many."""
        with METRICS.engine_phase.labels("claim").time():
            with session_scope() as session:
                claims = self.scheduler.claims(self._claimable_roles(queue_snapshot(session)), self._decoding(),
                                               time.monotonic())
                groups = [(a, count) for a, count in claims.groups
                          if claimable(session, a, count, self.turns, claims.spare)]
            took = 0
            for adapter, count in groups:
                with write_scope() as session:
                    group, jobs = claim_group(session, adapter, count, self.worker,
                                              self.settings.reliability.lease_seconds, self.turns, claims.spare)
                if jobs:
                    took += len(jobs)
                    self._start(group, jobs)
        self.scheduler.looked(took, self._decoding())
        return took

    def _start(self, group: ClaimGroup, jobs: list[Job]) -> None:
        """A claim group's jobs: each checked alone (one that cannot run fails at once), the rest wait for their
        prefill."""
        # each job records the version its claim found: a switch waits for these rows (`_follow_adapters`)
        self.writer.add(group, jobs, self.adapters.versions(), dict(self.adapters.calibrations))
        self.stream.started(jobs)
        METRICS.rows_in_flight.set(len(self.decoder.rows) + len(jobs))
        log.info("claim group %s: %d job(s) on %s take free slots", group.id, len(jobs), group.adapters)
        started, ready = time.monotonic(), []
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
            ready.append(Claimed(request, tokens, time.monotonic()))
        self.scheduler.claimed(ready, any(job.priority == Priority.INTERACTIVE for job in jobs), started)

    def _check(self, request: GenerationRequest) -> tuple[int, tuple[str, str] | None]:
        """The job's prompt tokens, and why it cannot take a slot (it fails alone, with a code) or None."""
        if reason := self.loaded.refusal(request.adapter):
            return 0, ("adapter_unavailable", reason)
        tokens, problem = self.loaded.check(request)
        if problem is not None:
            return tokens, ("invalid_input", problem)
        if not request.chose_max_new_tokens and tokens < self.decoder.window:
            # as the API counted it: a role's default is at most what the window leaves after the prompt
            request.max_new_tokens = min(request.max_new_tokens, self.decoder.window - tokens)
        if not self.decoder.fits(tokens, request.max_new_tokens):
            return tokens, ("invalid_input", f"the prompt is {tokens} tokens; with max_new_tokens "
                            f"{request.max_new_tokens} that is over this worker's window of {self.decoder.window} "
                            "tokens (KEVLAYA_ENGINE__WINDOW_TOKENS)")
        return tokens, None

    # -- prefill and decode ------------------------------------------------------------------------------------

    def _prefill(self, plan: Plan) -> None:
        """The plan's prefill: its jobs whole, or a prefill of them begun whose passes run between steps; then the
        next pass of the prefill under way, if the plan says so."""
        requests = [c.request for c in plan.prefill]
        if plan.between_steps:
            self.decoder.begin_prefill(requests, time.perf_counter())
        elif requests:
            self._prefill_whole(requests, plan.paced)
        if plan.next_pass:
            self._prefill_pass()

    def _prefill_whole(self, requests: list[GenerationRequest], paced: bool) -> None:
        handed_at, started = time.perf_counter(), time.monotonic()
        with METRICS.engine_phase.labels("prefill").time():
            try:
                finished = self.decoder.prefill(requests, handed_at)
            except Exception as exc:
                finished = self._prefill_one_by_one(requests, handed_at, exc)
        if paced:
            self.scheduler.prefill_ran(started, time.monotonic())
        self._store(finished)

    def _prefill_pass(self) -> None:
        """The next pass of the prefill under way; when it fails, its jobs are dealt with as a whole prefill's."""
        started = time.monotonic()
        with METRICS.engine_phase.labels("prefill").time():
            try:
                finished = self.decoder.prefill_pass()
            except Exception as exc:
                requests = self.decoder.cancel_prefill()
                finished = self._prefill_one_by_one(requests, time.perf_counter(), exc)
        self.scheduler.prefill_ran(started, time.monotonic())
        self._store(finished)

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

    def _step(self, claim: bool) -> int:
        """One decode step over the rows in flight; with `claim`, a claim runs inside it, once it is launched and
        before its logits are read: its database work overlaps the GPU's and no row waits for it, and the jobs it
        claims are prefilled after the step. A claim that raises is raised after the step, as it would be on its
        own: it is not the step's failure. Returns the jobs claimed."""
        if not self.decoder.rows:  # every row of the prefill before it finished there
            self.scheduler.nothing_stepped()
            return 0
        took, raised = [0], []

        def claim_meanwhile() -> None:
            try:
                took[0] = self._claim()
            except BaseException as exc:
                raised.append(exc)

        with METRICS.engine_phase.labels("step").time():
            self._decode_step(claim_meanwhile if claim else None)
        if raised:
            raise raised[0]
        return took[0]

    def _decode_step(self, meanwhile: Callable[[], None] | None) -> None:
        """The decoder's step; out of memory gives the newest rows back, any other failure fails the rows."""
        try:
            finished = self.decoder.step(meanwhile)
        except Exception as exc:
            if is_out_of_memory(exc):
                # a prefill under way would join a step that no longer fits: its jobs go back first
                aside = self.decoder.cancel_prefill()
                self.scheduler.prefill_over()
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
        self._store(finished)

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

    def _store(self, results: list[GenerationResult]) -> None:
        """Hand the rows a prefill, a pass or a step finished to the result writer (one transaction)."""
        if self.decoder.prefilling is None:  # its last pass ran (or a step ran it, near the window's end)
            self.scheduler.prefill_over()
        self.stream.tick()
        self.writer.store([(result.job_id, result) for result in results])  # one transaction for the step's rows
        METRICS.rows_in_flight.set(len(self.decoder.rows))

    def _peak(self) -> int | None:
        if self.loaded.device != "cuda":
            return None
        import torch

        return torch.cuda.max_memory_allocated()


