"""Whose jobs a claim takes (docs/architecture.md §3). Pure: decides from plain data, so it can be tested on its own.

Within each priority, every free slot goes to the key that holds the fewest slots of that adapter and priority
for its weight, counting the slots this claim has already given it. A slot decodes one token per step, so keys
holding equal slots get equal token rates, without anyone predicting how long a job runs. Ties go to the key this
worker served longest ago, then to the oldest job: with one slot at a time and nothing held, keys take turns."""

from __future__ import annotations

import heapq
import itertools
import uuid
from dataclasses import dataclass
from datetime import datetime

Key = uuid.UUID | None  # None: jobs stored without a key (tests, tools) share one turn


@dataclass(frozen=True)
class KeyQueue:
    """One key's queued jobs of one adapter and priority, and the slots it holds there now."""

    priority: int
    key: Key
    queued: int
    held: int
    oldest: datetime
    weight: float = 1.0


class KeyTurns:
    """When this worker last gave each key a slot: the tie-break that makes keys take turns."""

    def __init__(self) -> None:
        self._claims = itertools.count(1)
        self._last: dict[Key, int] = {}

    def last(self, key: Key) -> int:
        return self._last.get(key, 0)

    def served(self, keys: set[Key]) -> None:
        claim = next(self._claims)
        for key in keys:
            self._last[key] = claim


def share_slots(queues: list[KeyQueue], limit: int, turns: KeyTurns | None = None,
                spare: int = 0) -> list[tuple[int, Key, int]]:
    """(priority, key, count) for up to `limit` slots: every interactive job before any batch line; within a
    priority, each slot to the lowest (held + given + 1) / weight. A key that holds a slot there already leaves
    the last `spare` slots free: they wait for a key that holds none, whose first job then starts at the next step
    instead of when another key's row finishes (a key holding none may always take one)."""
    last = turns.last if turns is not None else (lambda _key: 0)

    def entry(i: int) -> tuple:
        q = queues[i]
        return q.priority, (q.held + given[i] + 1) / q.weight, last(q.key), q.oldest, i

    given = [0] * len(queues)
    heap = [entry(i) for i, q in enumerate(queues) if q.queued > 0]
    heapq.heapify(heap)
    left = limit
    while heap and left > 0:
        i = heapq.heappop(heap)[-1]
        if queues[i].held + given[i] > 0 and left <= spare:
            continue  # this key holds a slot already: what is left is spare
        given[i] += 1
        left -= 1
        if given[i] < queues[i].queued:
            heapq.heappush(heap, entry(i))
    return [(q.priority, q.key, n) for q, n in zip(queues, given, strict=True) if n > 0]
