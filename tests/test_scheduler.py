"""The batching policy, on plain data (docs/architecture.md §4)."""

from __future__ import annotations

import random

import pytest

from worker.scheduler import (
    PrefillPacer,
    QueueSnapshot,
    SchedulerState,
    SchedulingPolicy,
    plan_next_batch,
    prefill_group,
    prefill_order,
    unpaced_prefix,
)

POLICY = SchedulingPolicy(max_batch=8, max_wait_ms=1000, max_consecutive_batches=3)


def snapshot(kev: int = 0, laya: int = 0, kev_wait: float = 0, laya_wait: float = 0) -> QueueSnapshot:
    return QueueSnapshot(queued={"kev": kev, "laya": laya}, oldest_wait_ms={"kev": kev_wait, "laya": laya_wait})


def test_nothing_queued_means_no_batch():
    assert plan_next_batch(snapshot(), SchedulerState(), POLICY) is None


def test_first_batch_takes_the_adapter_with_the_oldest_job():
    plan = plan_next_batch(snapshot(kev=3, laya=3, kev_wait=10, laya_wait=50), SchedulerState(), POLICY)
    assert plan.adapters == ("laya",) and plan.limit == 8


def test_stays_on_the_active_adapter_while_it_has_work():
    state = SchedulerState(active_adapter="kev", consecutive_batches=1)
    plan = plan_next_batch(snapshot(kev=5, laya=5, kev_wait=10, laya_wait=500), state, POLICY)
    assert plan.adapters == ("kev",) and not plan.switch


def test_switches_when_the_active_adapter_is_empty():
    state = SchedulerState(active_adapter="kev", consecutive_batches=1)
    plan = plan_next_batch(snapshot(laya=2, laya_wait=5), state, POLICY)
    assert plan.adapters == ("laya",) and plan.switch


def test_switches_when_the_other_adapter_waited_past_max_wait():
    state = SchedulerState(active_adapter="kev", consecutive_batches=1)
    plan = plan_next_batch(snapshot(kev=5, laya=1, kev_wait=10, laya_wait=1001), state, POLICY)
    assert plan.adapters == ("laya",)


def test_switches_after_max_consecutive_batches():
    state = SchedulerState(active_adapter="kev", consecutive_batches=3)
    plan = plan_next_batch(snapshot(kev=5, laya=1, kev_wait=10, laya_wait=5), state, POLICY)
    assert plan.adapters == ("laya",)
    # ...but not when nobody else is waiting
    plan = plan_next_batch(snapshot(kev=5, kev_wait=10), state, POLICY)
    assert plan.adapters == ("kev",)


def test_mixed_mode_takes_both_adapters_without_a_switch():
    mixed = SchedulingPolicy(max_batch=8, max_wait_ms=1000, max_consecutive_batches=3, mixed=True)
    plan = plan_next_batch(snapshot(kev=1, laya=1), SchedulerState(active_adapter="kev"), mixed)
    assert plan.adapters == ("kev", "laya") and plan.mixed and not plan.switch


def test_capacity_bounds_the_batch():
    assert plan_next_batch(snapshot(kev=50), SchedulerState(), POLICY, capacity=3).limit == 3
    assert plan_next_batch(snapshot(kev=50), SchedulerState(), POLICY, capacity=0).limit == 1


def simulate(arrivals: list[tuple[float, str]], policy: SchedulingPolicy,
             step_ms: float) -> tuple[int, dict[str, float]]:
    """Run the policy over a queue; each batch takes `step_ms`. Returns (switches, worst wait per adapter)."""
    pending = sorted(arrivals)
    queue: list[tuple[float, str]] = []
    state, now, worst = SchedulerState(), 0.0, {"kev": 0.0, "laya": 0.0}
    while pending or queue:
        while pending and pending[0][0] <= now:
            queue.append(pending.pop(0))
        if not queue:
            now = pending[0][0]
            continue
        snap = QueueSnapshot(
            queued={a: sum(1 for _, x in queue if x == a) for a in ("kev", "laya")},
            oldest_wait_ms={a: max([now - t for t, x in queue if x == a], default=0) for a in ("kev", "laya")},
        )
        plan = plan_next_batch(snap, state, policy)
        taken = [job for job in queue if job[1] in plan.adapters][: plan.limit]
        for job in taken:
            queue.remove(job)
            worst[job[1]] = max(worst[job[1]], now - job[0])
        state.advance(plan)
        now += step_ms
    return state.switches, worst


def test_alternating_backlog_needs_few_switches():
    arrivals = [(0.0, "kev" if i % 2 else "laya") for i in range(40)]
    switches, _ = simulate(arrivals, SchedulingPolicy(16, 10_000, 8), step_ms=100)
    assert switches <= 2  # 20 + 20 jobs: at most one run of each (plus a tail)


@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize("max_wait_ms", [500, 2000])
def test_a_flooded_adapter_does_not_starve_the_other(seed, max_wait_ms):
    """Kev arrives faster than it can be served, so its queue never empties; Laya still gets its turn
    within the fairness bound (plus the batch already running)."""
    rng = random.Random(seed)
    kev = [(i * 10.0, "kev") for i in range(1000)]  # 100 jobs/s against 80 jobs/s of capacity
    laya = [(rng.uniform(0, 10_000), "laya") for _ in range(30)]
    policy = SchedulingPolicy(max_batch=4, max_wait_ms=max_wait_ms, max_consecutive_batches=10**6)
    _, worst = simulate(kev + laya, policy, step_ms=50)
    assert worst["laya"] <= max_wait_ms + 2 * 50
    # without the bound, Laya waits behind the whole Kev flood
    _, unfair = simulate(kev + laya, SchedulingPolicy(4, 10**9, 10**6), step_ms=50)
    assert unfair["laya"] > 4 * max_wait_ms


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
