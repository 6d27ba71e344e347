"""Who takes a free slot, and which claimed jobs are prefilled when (docs/architecture.md §4). Pure: decides from
plain data, never touches the model or the database, so it can be tested exhaustively."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from shared.settings import Settings
from worker.ledger.claims import QueueSnapshot


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
