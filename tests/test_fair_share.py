"""Whose jobs a claim takes (worker/ledger/fair_share.py), on plain data."""

from __future__ import annotations

import random
import uuid
from datetime import datetime, timedelta, timezone

from worker.ledger.fair_share import KeyQueue, KeyTurns, share_slots

T0 = datetime(2025, 1, 1, tzinfo=timezone.utc)
A, B, C = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()


def queue(key, queued, held=0, priority=0, age_s=0.0, weight=1.0) -> KeyQueue:  # noqa: ANN001
    return KeyQueue(priority=priority, key=key, queued=queued, held=held, oldest=T0 - timedelta(seconds=age_s),
                    weight=weight)


def test_every_slot_is_given_and_no_key_gets_more_than_it_has_queued():
    rng = random.Random(0)
    for _ in range(500):
        queues = [queue(uuid.uuid4(), rng.randint(0, 20), rng.randint(0, 8), rng.randint(0, 1), rng.random(),
                        rng.choice([0.5, 1.0, 3.0])) for _ in range(rng.randint(0, 6))]
        limit = rng.randint(0, 40)
        shares = share_slots(queues, limit)
        given = {(p, k): n for p, k, n in shares}
        assert sum(given.values()) == min(limit, sum(q.queued for q in queues))
        assert all(given.get((q.priority, q.key), 0) <= q.queued for q in queues)
        if any(q.priority == 1 for q in queues if (1, q.key) in given):  # a line only once interactive ran out
            assert all(given.get((0, q.key), 0) == q.queued for q in queues if q.priority == 0)


def test_a_backlog_and_a_single_job_the_single_job_is_in_the_next_claim():
    """The engine's loop, simulated: slots free one or a few at a time while a key's 2,048 jobs wait; another
    key's job arriving at any point is in the next claim (held slots, or else the turns, put it first)."""
    rng = random.Random(1)
    for arrival in range(0, 60, 3):
        turns, held_a, backlog, claims_after = KeyTurns(), 0, 2048, None
        for claim in range(80):
            single = [queue(B, 1)] if claim >= arrival and claims_after is None else []
            free = rng.randint(1, 4)
            shares = share_slots([queue(A, backlog, held_a, age_s=60), *single], free, turns)
            turns.served({k for _, k, _ in shares})
            for _, key, n in shares:
                if key == A:
                    held_a, backlog = held_a + n, backlog - n
                elif claims_after is None:
                    claims_after = claim - arrival
            held_a = max(0, held_a - rng.randint(0, 4))  # some finish
        assert claims_after == 0


def test_keys_hold_slots_in_proportion_to_their_weights():
    held = {A: 0, B: 0, C: 0}
    weights = {A: 1.0, B: 2.0, C: 1.0}
    for _ in range(40):
        shares = share_slots([queue(k, 1000, held[k], weight=weights[k]) for k in held], 1)
        [(_, key, _)] = shares
        held[key] += 1
    assert held == {A: 10, B: 20, C: 10}


def test_ties_go_to_the_key_served_longest_ago_then_to_the_oldest_job():
    turns = KeyTurns()
    assert share_slots([queue(A, 5, age_s=1), queue(B, 5, age_s=2)], 1, turns) == [(0, B, 1)]
    turns.served({B})
    assert share_slots([queue(A, 5, age_s=1), queue(B, 5, age_s=2)], 1, turns) == [(0, A, 1)]


def test_spare_slots_wait_for_a_key_that_holds_none():
    assert share_slots([queue(A, 100)], 8, spare=1) == [(0, A, 7)]  # its first slot counts: one stays free
    assert share_slots([queue(A, 100, held=7)], 1, spare=1) == []
    assert share_slots([queue(A, 100, held=7), queue(B, 3, age_s=-1)], 1, spare=1) == [(0, B, 1)]
    assert share_slots([queue(A, 100)], 1, spare=1) == [(0, A, 1)]  # holding none, a key always gets one
    assert share_slots([queue(A, 100, held=3), queue(B, 100)], 4, spare=2) == [(0, B, 2)]
