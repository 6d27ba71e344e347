"""Adapter-affinity batching (docs/architecture.md §4). Pure: decides *what* runs next from plain data, never touches
the model or the database, so it can be tested exhaustively."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class QueueSnapshot:
    """What is waiting, per adapter: how many jobs and how long the oldest has waited."""

    queued: dict[str, int]
    oldest_wait_ms: dict[str, float]

    def waiting(self) -> list[str]:
        return sorted((a for a, n in self.queued.items() if n > 0), key=lambda a: -self.oldest_wait_ms[a])


@dataclass(frozen=True)
class SchedulingPolicy:
    max_batch: int
    max_wait_ms: float
    max_consecutive_batches: int
    mixed: bool = False


@dataclass(frozen=True)
class BatchPlan:
    adapters: tuple[str, ...]
    limit: int
    switch: bool  # the active adapter changes for this batch

    @property
    def mixed(self) -> bool:
        return len(self.adapters) > 1


@dataclass
class SchedulerState:
    active_adapter: str | None = None
    consecutive_batches: int = 0
    switches: int = field(default=0)

    def advance(self, plan: BatchPlan) -> None:
        """Record that `plan` ran."""
        if plan.mixed:
            self.consecutive_batches = 0
            return
        adapter = plan.adapters[0]
        if adapter == self.active_adapter:
            self.consecutive_batches += 1
        else:
            if self.active_adapter is not None:  # the first adapter of a worker is a load, not a switch
                self.switches += 1
            self.active_adapter, self.consecutive_batches = adapter, 1


def plan_next_batch(snapshot: QueueSnapshot, state: SchedulerState, policy: SchedulingPolicy,
                    capacity: int | None = None) -> BatchPlan | None:
    """The next batch: stay on the active adapter unless it is empty, another adapter's oldest job has
    waited past `max_wait_ms`, or the active one has had `max_consecutive_batches` in a row.

    `capacity` is how many sequences the memory budget admits; the batch never exceeds it."""
    waiting = snapshot.waiting()
    if not waiting:
        return None
    limit = policy.max_batch if capacity is None else max(1, min(policy.max_batch, capacity))
    if policy.mixed and len(waiting) > 1:
        return BatchPlan(adapters=tuple(sorted(waiting)), limit=limit, switch=False)

    active = state.active_adapter
    others = [a for a in waiting if a != active]
    if active in waiting:
        starving = [a for a in others if snapshot.oldest_wait_ms[a] > policy.max_wait_ms]
        if starving:
            chosen = starving[0]
        elif others and state.consecutive_batches >= policy.max_consecutive_batches:
            chosen = others[0]
        else:
            chosen = active
    else:
        chosen = waiting[0]  # the adapter whose oldest job has waited longest
    return BatchPlan(adapters=(chosen,), limit=limit, switch=chosen != active)


def plan_slots(snapshot: QueueSnapshot, free: int, policy: SchedulingPolicy, expected_tokens: dict[str, int],
               reserved: Mapping[str, int] | None = None,
               in_flight: Mapping[str, int] | None = None) -> list[tuple[str, int]]:
    """Who takes the continuous engine's `free` slots, as (adapter, count) in claiming order.

    A slot costs nothing to switch, so affinity no longer pays; what matters is who waits. Adapters whose
    oldest job has waited past `max_wait_ms` come first (oldest first): the fairness bound. Then the adapter
    with the shortest expected jobs (fewest new tokens), so a fast decider never queues behind a deliberate
    analyst's backlog (docs/architecture.md §4).

    `reserved` slots belong to one adapter: while it holds fewer than that (`in_flight`), the difference stays
    free for it even when another adapter's backlog is starving, so its next job starts at the next step
    instead of waiting for a row of the backlog to finish."""
    reserved, in_flight = reserved or {}, in_flight or {}
    unused = {a: max(0, n - in_flight.get(a, 0)) for a, n in reserved.items()}
    waiting = snapshot.waiting()
    starving = [a for a in waiting if snapshot.oldest_wait_ms[a] > policy.max_wait_ms]
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
    return plan


def prefill_order(new_tokens: list[int], waited_ms: list[float], max_wait_ms: float) -> list[int]:
    """In which order claimed jobs are prefilled (indices): those that waited past the fairness bound first, then
    the shortest jobs (a Laya answer starts at the next step instead of after a wave of Kev prompts); claim
    order otherwise."""
    return sorted(range(len(new_tokens)), key=lambda i: (waited_ms[i] <= max_wait_ms, new_tokens[i]))


def prefill_group(prompt_tokens: list[int], free: int, budget_tokens: int) -> int:
    """How many of the claimed jobs (in claim order, by prompt tokens) to prefill together before the next step:
    at most `free`, and the padded block (jobs × longest prompt) within `budget_tokens`, the size that sets a
    prefill's time and memory; the first job always goes."""
    taken, longest = 0, 0
    for tokens in prompt_tokens[:free]:
        longest = max(longest, tokens)
        if taken and (taken + 1) * longest > budget_tokens:
            break
        taken += 1
    return taken


@dataclass
class PrefillPacer:
    """Keeps other roles' prefills to `share` of the engine's time while a row of a latency role (one with reserved
    slots) decodes: a prefill of d seconds runs only after d × (1 − share) / share seconds of decoding, counted
    from the previous one or from when latency rows started decoding (d: the last such prefill's length). A wave
    of Kev prompts then stretches a Laya row's decode by at most 1 / (1 − share), instead of by every prefill the
    wave needs (docs/architecture.md §14). share 1 paces nothing."""

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
