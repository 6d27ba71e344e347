"""Who runs next, decided in one place (docs/architecture.md §4). Each iteration of the drain loop
(worker/engine/loop.py) asks the `Scheduler` for a `Plan` — whether to look at the queue and when, which claimed
jobs to prefill and how, whether to run the next pass of the prefill under way, whether to step, whether the drain
is over — and does what it says; when it reads the queue it asks the scheduler how many rows each adapter claims
(`Claims`). The decoder only executes (prefill these requests, run a pass, step).

Pure: the scheduler decides from plain data (what the decoder holds as `Decoding`, the jobs claimed, the clock, a
queue snapshot) and never touches the model or the database, so it can be tested exhaustively (tests/test_scheduler.py
for its plans, tests/test_policy.py for the rules below them)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from shared.settings import Settings
from worker.generation import GenerationRequest
from worker.ledger.claims import QueueSnapshot

# After a look at the queue found nothing to claim, the next look waits this long, unless a reserved slot stands
# unused: then a job of its role may come at any step and is looked for at every step (a look runs inside the step,
# while the GPU computes).
IDLE_POLL_S = 0.02
INTERACTIVE_QUIET_S = 10.0  # after this long without an interactive job, batch lines prefill unbounded


class Claimed(NamedTuple):
    """A job that holds a slot and waits for its prefill."""

    request: GenerationRequest
    prompt_tokens: int
    claimed_at: float  # time.monotonic()


@dataclass(frozen=True)
class Decoding:
    """What the decoder holds, as the scheduler sees it."""

    rows: Sequence[tuple[str, bool]]  # each row decoding: its adapter, and whether it is a file batch's line
    free: int  # slots neither decoding nor held by the prefill under way
    limit: int  # rows admitted at most (lowered after an out-of-memory)


@dataclass(frozen=True)
class Plan:
    """One iteration of the drain loop, in the order it runs: a claim before anything else (then the loop plans
    again), else a prefill, the next pass of the prefill under way and a step with the claim inside it."""

    claim_now: bool = False  # nothing decodes: claim into the free slots first; the next plan prefills them
    prefill: tuple[Claimed, ...] = ()  # jobs to prefill now...
    between_steps: bool = False  # ...in passes that run between decode steps (their prefill begins); else whole
    paced: bool = False  # the whole prefill holds other roles' jobs: its time counts against their share
    next_pass: bool = False  # run the next pass of the prefill under way
    step: bool = False  # one decode step over the rows in flight
    claim_in_step: bool = False  # claim while the step computes (its database work overlaps the GPU's)
    done: bool = False  # nothing in flight, claimed or left to claim: the drain is over


@dataclass(frozen=True)
class Claims:
    """Who takes the free slots, decided when the queue is read: (adapter, rows) in claiming order, and the slots
    a claim keeps spare for API keys that hold none (docs/architecture.md §3)."""

    groups: list[tuple[str, int]]
    spare: int


class Scheduler:
    """The drain loop's decisions and what they depend on: the jobs claimed and not yet prefilled (`waiting`),
    those in the prefill under way (`prefilling`), the prefill pacer, when an interactive job last came and when
    the queue is looked at next. The engine tells it what happened (`claimed`, `looked`, `prefill_ran`,
    `nothing_stepped`, `prefill_over`)."""

    def __init__(self, settings: Settings, adapters: Iterable[str]):
        self.settings, self.adapters = settings, sorted(adapters)
        self.expected_tokens = {a: settings.adapter_profile(a).max_new_tokens for a in self.adapters}
        self.waiting: list[Claimed] = []  # claimed, not yet prefilled
        self.prefilling: list[Claimed] = []  # the jobs of the decoder's prefill under way (passes between steps)
        self.pacer = PrefillPacer(settings.engine.prefill_share)
        self.interactive_at = -INTERACTIVE_QUIET_S  # time.monotonic() of the last interactive job claimed
        self.deadline = 0.0  # time.monotonic() after which nothing more is claimed
        self.next_look = 0.0  # time.monotonic() from which the queue is looked at again
        self._looked_at = 0.0  # the `now` of the plan that looked: the next look is counted from it
        self._claimed_first = False  # the last plan claimed before anything else: this one prefills what came
        self._emptied = False  # the last iteration left nothing decoding: the drain may be over

    def start(self, deadline: float) -> None:
        """A drain begins: claim until `deadline`, looking at the queue at once."""
        self.deadline, self.next_look = deadline, 0.0
        self._claimed_first = self._emptied = False

    # -- the iteration's plan ----------------------------------------------------------------------------------

    def plan(self, decoding: Decoding, now: float, queued: Callable[[], bool]) -> Plan:
        """What the loop does next. `queued`: whether the queue holds work, asked only when nothing is in flight.

        An iteration claims first when nothing decodes, and then (in the plan after) prefills what came; with rows
        decoding it claims inside the step. After an iteration that left nothing decoding (nothing to step, or
        `nothing_stepped`), the drain is over once nothing is claimed or under way and the deadline is past or
        nothing is queued; else the queue is looked at again at once."""
        claimed_first, self._claimed_first = self._claimed_first, False
        emptied, self._emptied = self._emptied, False
        if emptied:
            if not self.waiting and not self.prefilling and (now >= self.deadline or not queued()):
                return Plan(done=True)
            self.next_look = 0.0  # nothing in flight: look again at once
        look = (not claimed_first and self.deadline > now >= self.next_look
                and decoding.free > len(self.waiting))
        if look:
            self._looked_at = now
        if look and not decoding.rows:
            self._claimed_first = True
            return Plan(claim_now=True)
        jobs, between_steps, paced, next_pass = self._prefill(decoding, now)
        step = bool(decoding.rows) or bool(jobs) or next_pass  # a whole prefill or a last pass brings rows
        self._emptied = not step
        return Plan(prefill=tuple(jobs), between_steps=between_steps, paced=paced, next_pass=next_pass, step=step,
                    claim_in_step=look)

    def _prefill(self, decoding: Decoding, now: float) -> tuple[list[Claimed], bool, bool, bool]:
        """Which claimed jobs to prefill now (in prefill order), whether in passes between steps, whether their
        time counts against the pacer, and whether the next pass of the prefill under way runs. Up to
        KEVLAYA_ENGINE__PREFILL_TOKENS padded tokens (at least one job), so rows already decoding wait one bounded
        prefill per step, not a whole burst's, and its memory is the one measured at start. While rows decode, a
        prefill of other roles' jobs runs one pass per step (KEVLAYA_ENGINE__PREFILL_BETWEEN_STEPS), and a latency
        role's job claimed meanwhile goes first. While a latency role's row decodes, other roles' prefills are
        paced (PrefillPacer, KEVLAYA_ENGINE__PREFILL_SHARE)."""
        engine = self.settings.engine
        waited = [(now - c.claimed_at) * 1000 for c in self.waiting]
        order = prefill_order([c.request.max_new_tokens for c in self.waiting], waited, engine.max_wait_ms,
                              [c.request.background for c in self.waiting])
        self.waiting, waited = [self.waiting[i] for i in order], [waited[i] for i in order]
        tokens = [c.prompt_tokens for c in self.waiting]
        # Batch lines go a few at a time only while interactive jobs come: alone, a batch drains at full speed.
        count = apart_from_batch_lines(prefill_group(tokens, decoding.free, engine.prefill_tokens),
                                       [c.request.background for c in self.waiting], tokens,
                                       engine.batch_prefill_tokens if self._interactive(now) else None)
        roles = set(self.reserved(decoding.limit))
        latency = [c.request.adapter in roles and not c.request.background for c in self.waiting]
        held = not self.pacer.allows(now, any(adapter in roles and not line for adapter, line in decoding.rows))
        if held:
            count = min(count, unpaced_prefix(latency, waited, engine.max_wait_ms))
        count = latency_jobs_apart(count, latency)
        between_steps = count > 0 and not latency[0] and bool(decoding.rows) and engine.prefill_between_steps
        if between_steps and self.prefilling:
            count = 0  # one prefill under way at a time
        chosen, self.waiting = self.waiting[:count], self.waiting[count:]
        if between_steps and chosen:
            self.prefilling = chosen
        next_pass = bool(self.prefilling) and (not held or self._held_past_bound(self.prefilling, now))
        return chosen, between_steps and bool(chosen), not all(latency[:count]), next_pass

    def _held_past_bound(self, claimed: list[Claimed], now: float) -> bool:
        return any((now - c.claimed_at) * 1000 > self.settings.engine.max_wait_ms for c in claimed)

    # -- who takes the free slots ------------------------------------------------------------------------------

    def claims(self, snapshot: QueueSnapshot, decoding: Decoding, now: float) -> Claims:
        """How many rows each adapter claims from the queue as `snapshot` shows it (`plan_slots`), and the spare
        slots the claims keep."""
        engine = self.settings.engine
        free = decoding.free - len(self.waiting)
        for adapter in (snapshot.queued.keys() | snapshot.batch_lines.keys()) - self.expected_tokens.keys():  # new roles
            self.expected_tokens[adapter] = self.settings.adapter_profile(adapter).max_new_tokens
        groups = plan_slots(snapshot, free, engine.max_wait_ms, self.expected_tokens, self.reserved(decoding.limit),
                            self._in_flight(decoding), self._batch_room(decoding, now))
        # Slots the plan leaves free (a reservation's) are spare already; a claim keeps only the rest.
        unplanned = free - sum(count for _, count in groups)
        return Claims(groups, spare=max(0, min(engine.key_spare_slots, decoding.limit - 1) - unplanned))

    def reserved(self, limit: int) -> dict[str, int]:
        """Each role's reserved slots, from the decoder's current `limit`: after an out-of-memory shrank it, a
        reservation must not take the last slots."""
        return reserved_slots(self.settings, self.adapters, min(self.settings.engine.max_batch, limit))

    def _in_flight(self, decoding: Decoding) -> Counter[str]:
        """Slots each adapter's interactive jobs hold or are about to hold (claimed, waiting for or in their
        prefill): what its reservation is counted against."""
        return Counter([adapter for adapter, line in decoding.rows if not line]
                       + [c.request.adapter for c in self.waiting + self.prefilling if not c.request.background])

    def _interactive(self, now: float) -> bool:
        """Whether interactive jobs come now: one was claimed in the last INTERACTIVE_QUIET_S."""
        return now - self.interactive_at < INTERACTIVE_QUIET_S

    def _batch_room(self, decoding: Decoding, now: float) -> int | None:
        """How many more batch lines may take slots: while interactive jobs come, lines hold at most half of
        KEVLAYA_ENGINE__MAX_BATCH, so an interactive row decodes beside fewer of them; else no bound."""
        if not self._interactive(now):
            return None
        held = sum(line for _, line in decoding.rows)
        held += sum(c.request.background for c in self.waiting + self.prefilling)
        return max(0, self.settings.engine.max_batch // 2 - held)

    # -- what happened -----------------------------------------------------------------------------------------

    def claimed(self, jobs: list[Claimed], interactive: bool, now: float) -> None:
        """A claim group's jobs that passed their checks wait for their prefill; `interactive`: the group held an
        interactive job."""
        if interactive:
            self.interactive_at = now
        self.waiting += jobs

    def looked(self, took: int, decoding: Decoding) -> None:
        """A look at the queue claimed `took` jobs: after one that found nothing the next waits IDLE_POLL_S, unless
        a role with reserved slots holds fewer rows than it reserves (its next job takes one at once)."""
        in_flight = self._in_flight(decoding)
        unused = any(in_flight[adapter] < count for adapter, count in self.reserved(decoding.limit).items())
        self.next_look = 0.0 if took or unused else self._looked_at + IDLE_POLL_S

    def prefill_ran(self, started: float, ended: float) -> None:
        """A prefill of other roles' jobs, or a pass of the one under way, ran from `started` to `ended`."""
        self.pacer.ran(started, ended)

    def nothing_stepped(self) -> None:
        """The plan's step found no row: every row of the prefill before it finished there."""
        self._emptied = True

    def prefill_over(self) -> None:
        """The decoder's prefill under way is no more: its rows joined, or it was given up."""
        self.prefilling = []


# -- the rules -------------------------------------------------------------------------------------------------


def reserved_slots(settings: Settings, adapters: Iterable[str], rows: int) -> dict[str, int]:
    """Each adapter's `reserved_slots`, at most a quarter of `rows`, so a reservation never starves the rest."""
    reserved = {a: min(settings.adapter_profile(a).reserved_slots, rows // 4) for a in sorted(adapters)}
    return {a: n for a, n in reserved.items() if n > 0}


def plan_slots(snapshot: QueueSnapshot, free: int, max_wait_ms: float, expected_tokens: dict[str, int],
               reserved: Mapping[str, int] | None = None,
               in_flight: Mapping[str, int] | None = None, batch_room: int | None = None) -> list[tuple[str, int]]:
    """Who takes the `free` slots, as (adapter, count) in claiming order.

    A slot costs nothing to switch, so adapter affinity does not pay; what matters is who waits. Adapters whose
    oldest job has waited past `max_wait_ms` come first (oldest first): the fairness bound. Then the adapter
    with the shortest expected jobs (fewest new tokens), so a fast decider never queues behind a deliberate
    analyst's backlog.

    `reserved` slots belong to one adapter: while it holds fewer than that (`in_flight`, its interactive rows),
    the difference stays free for it even when another adapter's backlog is starving, so its next job starts at
    the next step instead of waiting for a row of the backlog to finish.

    The lines of file batches (`snapshot.batch_lines`) take what is left after that, shortest jobs first, and
    never a reserved slot, and at most `batch_room` more of them (None: no bound): a batch drains in the slots
    interactive work leaves free. An adapter's share is still one claim, which takes its interactive jobs
    first."""
    reserved, in_flight = reserved or {}, in_flight or {}
    unused = {a: max(0, n - in_flight.get(a, 0)) for a, n in reserved.items()}
    waiting = snapshot.waiting()
    starving = [a for a in waiting if snapshot.oldest_wait_ms[a] > max_wait_ms]
    rest = sorted((a for a in waiting if a not in starving), key=lambda a: (expected_tokens.get(a, 0), a))
    plan, left = [], free
    for adapter in starving + rest:
        kept_for_others = sum(n for a, n in unused.items() if a != adapter)
        count = min(left - kept_for_others, snapshot.queued[adapter])
        if count > 0:
            plan.append((adapter, count))
            left -= count
            if adapter in unused:
                unused[adapter] = max(0, unused[adapter] - count)
    left -= sum(unused.values())
    if batch_room is not None:
        left = min(left, batch_room)
    shares = dict(plan)
    for adapter in sorted(snapshot.batch_lines, key=lambda a: (expected_tokens.get(a, 0), a)):
        count = min(left, snapshot.batch_lines[adapter])
        if count > 0:
            shares[adapter] = shares.get(adapter, 0) + count
            left -= count
    return list(shares.items())


def prefill_group(prompt_tokens: list[int], free: int, budget_tokens: int | None) -> int:
    """How many of these jobs (in order, by prompt tokens) one prefill takes: at most `free`, and the padded block
    (jobs × longest prompt) within `budget_tokens` (None: no bound), the size that sets a prefill's time and
    memory; the first job always goes."""
    taken, longest = 0, 0
    for tokens in prompt_tokens[:free]:
        longest = max(longest, tokens)
        if taken and budget_tokens is not None and (taken + 1) * longest > budget_tokens:
            break
        taken += 1
    return taken


def prefill_order(new_tokens: list[int], waited_ms: list[float], max_wait_ms: float,
                  background: list[bool] | None = None) -> list[int]:
    """In which order claimed jobs are prefilled (indices): interactive jobs before the lines of file batches
    (`background`); among them, those that waited past the fairness bound first, then the shortest jobs (a Laya
    answer starts at the next step instead of after a wave of Kev prompts); claim order otherwise."""
    background = background or [False] * len(new_tokens)
    return sorted(range(len(new_tokens)), key=lambda i: (background[i], waited_ms[i] <= max_wait_ms, new_tokens[i]))


def apart_from_batch_lines(count: int, background: list[bool], prompt_tokens: list[int],
                           batch_budget_tokens: int | None) -> int:
    """How many of the first `count` jobs (in prefill order: interactive ones first) to prefill now. A prefill
    never mixes the two: interactive jobs go on their own, and lines of file batches at most
    `batch_budget_tokens` padded tokens at a time (None: as many as `count`), so an interactive job that arrives
    while a batch drains waits for one short prefill at most, never a whole claim group's."""
    interactive = next((i for i, line in enumerate(background[:count]) if line), count)
    if interactive:
        return interactive
    return prefill_group(prompt_tokens[:count], count, batch_budget_tokens)


def latency_jobs_apart(count: int, latency: list[bool]) -> int:
    """How many of the first `count` jobs (in prefill order) to prefill now: when a latency role's jobs lead, only
    them. A prefill pass lasts as long as all its tokens take, and each row's first token waits for the whole
    pass, so a Laya job prefilled with a wave of Kev prompts would wait for theirs too."""
    if not latency or not latency[0]:
        return count
    return next((i for i, is_latency in enumerate(latency[:count]) if not is_latency), count)


@dataclass
class PrefillPacer:
    """Keeps other roles' prefills to `share` of the engine's time while a row of a latency role (one with reserved
    slots) decodes: a prefill of d seconds runs only after d × (1 − share) / share seconds of decoding, counted
    from the previous one or from when latency rows started decoding (d: the last such prefill's length). A wave
    of Kev prompts then stretches a Laya row's decode by at most 1 / (1 − share), instead of by every prefill the
    wave needs (docs/architecture.md §4). share 1 paces nothing."""

    share: float
    next_at: float = 0.0  # time.monotonic() from which the next paced prefill may run
    last_s: float = 0.0  # how long the last paced prefill took
    latency_rows: bool = False  # whether latency rows were decoding at the last look

    @property
    def _wait_per_second(self) -> float:
        return (1 - self.share) / self.share

    def allows(self, now: float, latency_rows: bool) -> bool:
        started, self.latency_rows = latency_rows and not self.latency_rows, latency_rows
        if not latency_rows:
            return True
        if started:  # a latency row has just started: it gets its decoding time first
            self.next_at = max(self.next_at, now + self.last_s * self._wait_per_second)
        return now >= self.next_at

    def ran(self, started: float, ended: float) -> None:
        """A paced prefill (one with jobs of other roles) ran from `started` to `ended`."""
        self.last_s = ended - started
        self.next_at = ended + self.last_s * self._wait_per_second


def unpaced_prefix(latency: list[bool], waited_ms: list[float], max_wait_ms: float) -> int:
    """How many of the claimed jobs (in prefill order) may be prefilled while the pacer holds the rest: the
    leading ones of a latency role or held past the fairness bound."""
    count = 0
    for is_latency, waited in zip(latency, waited_ms):
        if not (is_latency or waited > max_wait_ms):
            break
        count += 1
    return count
