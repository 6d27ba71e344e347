"""The slot policy, on plain data (docs/architecture.md §4): who takes a free slot, and when a claimed job is
prefilled."""

from __future__ import annotations

import random

import pytest

from shared.settings import Settings
from worker.engine.scheduler import (
    PrefillPacer,
    apart_from_batch_lines,
    latency_jobs_apart,
    plan_slots,
    prefill_group,
    prefill_order,
    reserved_slots,
    unpaced_prefix,
)
from worker.ledger.claims import QueueSnapshot

MAX_WAIT_MS = 2000
EXPECTED = {"kev": 256, "laya": 64}


def snapshot(kev: int = 0, laya: int = 0, kev_wait: float = 0, laya_wait: float = 0) -> QueueSnapshot:
    return QueueSnapshot(queued={"kev": kev, "laya": laya}, oldest_wait_ms={"kev": kev_wait, "laya": laya_wait})


def simulate(arrivals: list[tuple[float, str]], slots: int, steps: dict[str, int], step_ms: float,
             max_wait_ms: float, reserved: dict[str, int]) -> dict[str, float]:
    """The slot policy over a queue: each step the free slots are planned and claimed; a job holds its slot for
    `steps[adapter]` steps. Returns the worst wait (arrival to claim) per adapter."""
    pending, queue = sorted(arrivals), []
    running: list[tuple[int, str]] = []  # (steps left, adapter)
    now, worst = 0.0, {"kev": 0.0, "laya": 0.0}
    while pending or queue or running:
        while pending and pending[0][0] <= now:
            queue.append(pending.pop(0))
        snap = QueueSnapshot(
            queued={a: sum(1 for _, x in queue if x == a) for a in ("kev", "laya")},
            oldest_wait_ms={a: max([now - t for t, x in queue if x == a], default=0) for a in ("kev", "laya")})
        held = {a: sum(1 for _, x in running if x == a) for a in ("kev", "laya")}
        for adapter, count in plan_slots(snap, slots - len(running), max_wait_ms, EXPECTED, reserved, held):
            for job in [j for j in queue if j[1] == adapter][:count]:
                queue.remove(job)
                worst[adapter] = max(worst[adapter], now - job[0])
                running.append((steps[adapter], adapter))
        running = [(left - 1, a) for left, a in running if left > 1]
        now += step_ms
    return worst


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("max_wait_ms", [500, 2000])
def test_a_flooded_kev_backlog_does_not_starve_laya(seed, max_wait_ms):
    """Kev arrives faster than its slots serve it, so its backlog is soon past the fairness bound; Laya's reserved
    slots still take each Laya job within a few steps, where without them it waits for the Kev backlog."""
    rng = random.Random(seed)
    kev = [(i * 8.0, "kev") for i in range(400)]  # 125 jobs/s against 10 slots of 10 steps of 10 ms: 100 jobs/s
    laya = [(rng.uniform(0, 3_000), "laya") for _ in range(30)]
    steps = {"kev": 10, "laya": 2}
    worst = simulate(kev + laya, slots=10, steps=steps, step_ms=10, max_wait_ms=max_wait_ms, reserved={"laya": 2})
    assert worst["laya"] <= 3 * 10
    # without the reservation, Laya waits behind the starving Kev backlog until a slot frees
    unreserved = simulate(kev + laya, slots=10, steps=steps, step_ms=10, max_wait_ms=max_wait_ms, reserved={})
    assert unreserved["laya"] > worst["laya"]


def test_free_slots_go_to_the_shortest_jobs_unless_someone_waited_too_long():
    both = QueueSnapshot(queued={"kev": 10, "laya": 3}, oldest_wait_ms={"kev": 500, "laya": 10})
    assert plan_slots(both, 5, MAX_WAIT_MS, EXPECTED) == [("laya", 3), ("kev", 2)]
    assert plan_slots(both, 2, MAX_WAIT_MS, EXPECTED) == [("laya", 2)]
    starving = QueueSnapshot(queued={"kev": 10, "laya": 3}, oldest_wait_ms={"kev": 2500, "laya": 10})
    assert plan_slots(starving, 4, MAX_WAIT_MS, EXPECTED) == [("kev", 4)]  # the fairness bound comes first
    assert plan_slots(QueueSnapshot({}, {}), 4, MAX_WAIT_MS, EXPECTED) == []


def test_reserved_slots_stay_free_for_their_adapter_while_another_backlog_starves():
    starving_kev = QueueSnapshot(queued={"kev": 40}, oldest_wait_ms={"kev": 9000})
    reserve = {"laya": 2}
    # Laya holds nothing: two of the free slots stay free for it, the starving Kev backlog takes the rest
    assert plan_slots(starving_kev, 5, MAX_WAIT_MS, EXPECTED, reserve, {"kev": 27}) == [("kev", 3)]
    assert plan_slots(starving_kev, 2, MAX_WAIT_MS, EXPECTED, reserve, {"kev": 30}) == []
    # Laya already holds one slot: only one more stays free for it
    assert plan_slots(starving_kev, 2, MAX_WAIT_MS, EXPECTED, reserve, {"kev": 29, "laya": 1}) == [("kev", 1)]
    # A Laya job arriving then takes a kept slot at once, although Kev waited far longer
    both = QueueSnapshot(queued={"kev": 40, "laya": 1}, oldest_wait_ms={"kev": 9000, "laya": 5})
    assert plan_slots(both, 2, MAX_WAIT_MS, EXPECTED, reserve, {"kev": 30}) == [("laya", 1)]
    # More Laya than its reservation: beyond it, Laya competes like anyone (the starving backlog first)
    many = QueueSnapshot(queued={"kev": 40, "laya": 9}, oldest_wait_ms={"kev": 9000, "laya": 5})
    assert plan_slots(many, 4, MAX_WAIT_MS, EXPECTED, reserve, {"kev": 28}) == [("kev", 2), ("laya", 2)]
    # Nobody reserved: as before
    assert plan_slots(both, 2, MAX_WAIT_MS, EXPECTED, {}, {"kev": 30}) == [("kev", 2)]


def test_a_reservation_is_at_most_a_quarter_of_the_slots():
    settings = Settings(_env_file=None)
    assert settings.laya.reserved_slots == 4 and settings.kev.reserved_slots == 0
    assert reserved_slots(settings, ["kev", "laya"], 32) == {"laya": 4}
    assert reserved_slots(settings, ["kev", "laya"], 8) == {"laya": 2}
    assert reserved_slots(settings, ["kev", "laya"], 3) == {}
    kev_too = Settings(_env_file=None, kev={"reserved_slots": 1})
    assert reserved_slots(kev_too, ["kev", "laya"], 16) == {"kev": 1, "laya": 4}


def test_a_prefill_group_is_bounded_by_its_padded_block_not_its_token_sum():
    # Jobs are padded to the longest prompt: one long prompt and many short ones are a large block
    assert prefill_group([1000, 10, 10, 10], free=8, budget_tokens=2048) == 2  # 2 × 1000; a third makes 3 × 1000
    assert prefill_group([100] * 30, free=32, budget_tokens=2048) == 20
    assert prefill_group([10, 10, 1000], free=8, budget_tokens=2048) == 2  # 3 × 1000 > 2048 though the sum is not
    assert prefill_group([3000, 10], free=8, budget_tokens=2048) == 1  # the first job always goes
    assert prefill_group([10] * 10, free=3, budget_tokens=2048) == 3  # never more than the free slots
    assert prefill_group([], free=3, budget_tokens=2048) == 0
    assert prefill_group([10], free=0, budget_tokens=2048) == 0


def test_the_shortest_claimed_jobs_are_prefilled_first_unless_one_waited_past_the_bound():
    # Kev prompts claimed in a wave, then a Laya job: the Laya job is prefilled at the next step
    assert prefill_order([128, 128, 128, 32], [40, 40, 40, 1], max_wait_ms=2000) == [3, 0, 1, 2]
    # a job held past the fairness bound goes first whatever its length; ties keep claim order
    assert prefill_order([128, 32, 32], [2500, 10, 5], max_wait_ms=2000) == [0, 1, 2]
    assert prefill_order([], [], max_wait_ms=2000) == []


def test_other_roles_prefills_take_at_most_their_share_while_a_latency_row_decodes():
    pacer = PrefillPacer(share=0.25)
    assert pacer.allows(now=0.0, latency_rows=True)  # nothing paced has run yet
    pacer.ran(started=10.0, ended=10.1)  # a 100 ms prefill of Kev prompts
    # the next one waits for 300 ms of decoding: 100 ms of prefill in 400 ms is a quarter
    assert not pacer.allows(now=10.39, latency_rows=True)
    assert pacer.allows(now=10.4, latency_rows=True)
    assert pacer.allows(now=10.2, latency_rows=False)  # with no Laya row in flight nothing waits
    # a Laya row that starts decoding later gets its 300 ms of decoding before the next Kev prefill too
    assert not pacer.allows(now=20.0, latency_rows=True) and not pacer.allows(now=20.29, latency_rows=True)
    assert pacer.allows(now=20.3, latency_rows=True)
    unpaced = PrefillPacer(share=1.0)
    unpaced.ran(started=10.0, ended=10.1)
    assert unpaced.allows(now=10.1, latency_rows=True)


def test_a_held_prefill_still_takes_the_latency_roles_jobs_and_those_past_the_fairness_bound():
    # claimed jobs in prefill order: a Laya job, a Kev job held past the bound, then fresh Kev jobs
    assert unpaced_prefix([True, False, False, False], [5, 2500, 10, 10], max_wait_ms=2000) == 2
    assert unpaced_prefix([False, True], [10, 10], max_wait_ms=2000) == 0  # stops at the first paced job
    assert unpaced_prefix([], [], max_wait_ms=2000) == 0


def test_batch_lines_take_only_the_slots_interactive_work_leaves_and_never_a_reserved_one():
    reserve = {"laya": 4}
    lines = QueueSnapshot(queued={}, oldest_wait_ms={}, batch_lines={"kev": 50, "laya": 50})
    # 10 free, Laya's 4 reserved kept free: the lines get 6, the shortest (Laya) first
    assert plan_slots(lines, 10, MAX_WAIT_MS, EXPECTED, reserve, {}) == [("laya", 6)]
    # Laya's interactive rows fill its reservation: every free slot may then take lines
    assert plan_slots(lines, 10, MAX_WAIT_MS, EXPECTED, reserve, {"laya": 4}) == [("laya", 10)]
    # interactive jobs come first, and one claim per adapter takes them before its lines
    both = QueueSnapshot(queued={"kev": 2}, oldest_wait_ms={"kev": 10}, batch_lines={"laya": 50, "kev": 50})
    assert plan_slots(both, 10, MAX_WAIT_MS, EXPECTED, reserve, {}) == [("kev", 2), ("laya", 4)]
    # lines that waited for hours set no fairness bound: a batch never starves interactive work
    old_lines = QueueSnapshot(queued={"laya": 1}, oldest_wait_ms={"laya": 5}, batch_lines={"kev": 50})
    assert plan_slots(old_lines, 5, MAX_WAIT_MS, EXPECTED, reserve, {}) == [("laya", 1), ("kev", 1)]
    # while interactive jobs come, the lines get at most the room the engine leaves them
    assert plan_slots(lines, 10, MAX_WAIT_MS, EXPECTED, reserve, {"laya": 4}, batch_room=3) == [("laya", 3)]
    assert plan_slots(both, 10, MAX_WAIT_MS, EXPECTED, reserve, {}, batch_room=0) == [("kev", 2)]


def test_a_prefill_never_mixes_interactive_jobs_and_batch_lines_and_lines_go_a_few_at_a_time():
    # prefill order puts interactive jobs first: they go alone, whatever the budget would still hold
    assert apart_from_batch_lines(6, [False, False, True, True, True, True], [50] * 6, 256) == 2
    # batch lines alone: at most the batch budget, padded (5 × 50 fits 256, a sixth does not)
    assert apart_from_batch_lines(8, [True] * 8, [50] * 8, 256) == 5
    assert apart_from_batch_lines(3, [True] * 8, [50] * 8, 256) == 3  # never more than the decoder's own count
    assert apart_from_batch_lines(8, [True] * 8, [400] * 8, 256) == 1  # one line always goes
    assert apart_from_batch_lines(8, [True] * 8, [400] * 8, None) == 8  # no interactive traffic: no bound


def test_a_latency_roles_jobs_that_lead_the_prefill_order_go_without_the_others():
    # Laya jobs first (prefill order): the Kev prompts claimed with them wait for the next pass
    assert latency_jobs_apart(5, [True, True, False, False, False]) == 2
    assert latency_jobs_apart(1, [True, True, False]) == 1  # never more than the budget's count
    assert latency_jobs_apart(3, [True, True, True]) == 3
    # no latency job leads (a Kev job held past the fairness bound comes first): the budget decides alone
    assert latency_jobs_apart(4, [False, True, False, True]) == 4
    assert latency_jobs_apart(0, []) == 0
