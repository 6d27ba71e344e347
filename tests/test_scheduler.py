"""The scheduler's plans on plain data (worker/engine/scheduler.py; docs/architecture.md §4): what each iteration
of the drain loop does — claim first or inside the step, which jobs to prefill and how, the next pass of a prefill
under way, the step, the end of the drain — and how many rows each adapter claims. No model, no database."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

import pytest

from shared.settings import Settings
from worker.engine.scheduler import IDLE_POLL_S, INTERACTIVE_QUIET_S, Claimed, Decoding, Plan, Scheduler
from worker.generation import GenerationRequest
from worker.ledger.claims import QueueSnapshot


def scheduler(deadline: float = 1000.0, laya_reserved: int = 4, **engine: object) -> Scheduler:
    """Eight slots (Laya reserves two of them: a quarter), share 0.25, fairness bound 2 s."""
    made = Scheduler(Settings(_env_file=None, laya={"reserved_slots": laya_reserved},
                              engine={"max_batch": 8, "prefill_share": 0.25, "max_wait_ms": 2000, **engine}),
                     ["kev", "laya"])
    made.start(deadline)
    return made


def job(adapter: str, at: float = 0.0, new_tokens: int = 50, prompt: int = 20, line: bool = False) -> Claimed:
    request = GenerationRequest(job_id=uuid.uuid4(), adapter=adapter, messages=[], max_new_tokens=new_tokens,
                                temperature=0.0, top_p=1.0, seed=None, background=line)
    return Claimed(request, prompt, at)


def decoding(*rows: str, free: int | None = None, limit: int = 8) -> Decoding:
    """Rows named by adapter; "kev-line": a Kev file batch's line."""
    held = [(row.split("-")[0], row.endswith("-line")) for row in rows]
    return Decoding(held, limit - len(held) if free is None else free, limit)


def never() -> bool:
    raise AssertionError("the queue was asked while something was in flight")


def adapters(plan: Plan) -> list[str]:
    return [c.request.adapter for c in plan.prefill]


def test_with_nothing_decoding_it_claims_first_then_prefills_what_came_whole_and_steps_without_looking_again():
    plans = scheduler()
    assert plans.plan(decoding(), now=1.0, queued=never) == Plan(claim_now=True)
    plans.claimed([job("kev", 1.0), job("kev", 1.0)], interactive=True, now=1.0)
    plans.looked(2, decoding())
    plan = plans.plan(decoding(), now=1.01, queued=never)
    assert adapters(plan) == ["kev", "kev"] and not plan.between_steps and plan.paced
    assert plan.step and not plan.claim_in_step and not plan.claim_now  # looked already this iteration
    assert plans.waiting == []
    # rows decode now: the next look is inside the step (the last one claimed something: at once)
    plan = plans.plan(decoding("kev", "kev"), now=1.02, queued=never)
    assert plan.step and plan.claim_in_step and plan.prefill == ()


def test_a_look_that_found_nothing_waits_the_poll_interval_unless_a_reserved_slot_stands_unused():
    plans = scheduler(laya_reserved=0)
    rows = decoding("kev", "kev")
    assert plans.plan(rows, now=5.0, queued=never).claim_in_step
    plans.looked(0, rows)
    assert not plans.plan(rows, now=5.0 + IDLE_POLL_S / 2, queued=never).claim_in_step
    assert plans.plan(rows, now=5.0 + IDLE_POLL_S, queued=never).claim_in_step
    # Laya reserves two slots and holds none: its next job may come at any step, so every step looks
    reserving = scheduler()
    assert reserving.plan(rows, now=5.0, queued=never).claim_in_step
    reserving.looked(0, rows)
    assert reserving.plan(rows, now=5.001, queued=never).claim_in_step
    reserving.looked(0, decoding("kev", "laya", "laya"))  # its reservation in use: the poll interval again
    assert not reserving.plan(rows, now=5.002, queued=never).claim_in_step


def test_no_look_without_a_slot_free_beyond_the_jobs_already_claimed_nor_after_the_deadline():
    plans = scheduler()
    plans.claimed([job("kev"), job("kev")], interactive=True, now=0.0)
    full = decoding("kev", free=2)
    assert not plans.plan(full, now=1.0, queued=never).claim_in_step  # both free slots are the claimed jobs'
    late = scheduler(deadline=10.0)
    assert not late.plan(decoding("kev"), now=10.0, queued=never).claim_in_step
    assert late.plan(decoding(), now=10.0, queued=never) == Plan()  # nothing to do: the drain may be over
    assert late.plan(decoding(), now=10.0, queued=never).done  # past the deadline the queue is not asked


def test_the_drain_ends_when_nothing_is_in_flight_and_nothing_is_queued_and_looks_again_at_once_otherwise():
    plans = scheduler(laya_reserved=0)
    assert plans.plan(decoding(), now=1.0, queued=never).claim_now
    plans.looked(0, decoding())  # nothing claimable: the next look would wait
    assert plans.plan(decoding(), now=1.0, queued=never) == Plan()  # nothing claimed to prefill, nothing to step
    asked = []
    assert plans.plan(decoding(), now=1.001, queued=lambda: asked.append(1) or True).claim_now  # queued: at once
    assert asked == [1]
    plans.looked(0, decoding())
    assert plans.plan(decoding(), now=1.002, queued=never) == Plan()
    assert plans.plan(decoding(), now=1.003, queued=lambda: False).done


def test_a_whole_prefill_whose_rows_all_finished_in_it_leaves_the_step_nothing_and_the_drain_may_end():
    plans = scheduler(deadline=0.0)
    plans.claimed([job("kev")], interactive=True, now=0.0)
    plan = plans.plan(decoding(), now=1.0, queued=never)
    assert adapters(plan) == ["kev"] and plan.step
    plans.nothing_stepped()  # its one token was its last
    assert plans.plan(decoding(), now=1.0, queued=never).done


def test_while_rows_decode_kev_jobs_prefill_between_steps_one_prefill_at_a_time_and_a_laya_job_goes_first():
    plans = scheduler(deadline=0.0)
    rows = decoding("kev")
    plans.claimed([job("kev"), job("kev")], interactive=True, now=0.0)
    plan = plans.plan(rows, now=1.0, queued=never)
    assert adapters(plan) == ["kev", "kev"] and plan.between_steps and plan.next_pass and plan.step
    assert [c.request.adapter for c in plans.prefilling] == ["kev", "kev"]
    plans.claimed([job("laya"), job("kev")], interactive=True, now=1.0)
    rows = decoding("kev", free=4)  # two slots held by the prefill under way
    plan = plans.plan(rows, now=1.01, queued=never)
    assert adapters(plan) == ["laya"] and not plan.between_steps and not plan.paced  # whole, before the next pass
    assert plan.next_pass
    plan = plans.plan(decoding("kev", "laya", free=3), now=1.02, queued=never)
    assert plan.prefill == () and plan.next_pass  # the Kev job waits: one prefill under way at a time
    plans.prefill_over()  # its last pass ran: its rows joined
    plan = plans.plan(decoding("kev", "laya", "kev", "kev", free=3), now=1.03, queued=never)
    assert adapters(plan) == ["kev"] and plan.between_steps


def test_with_prefills_between_steps_off_every_prefill_is_whole():
    plans = scheduler(deadline=0.0, prefill_between_steps=False)
    plans.claimed([job("kev")], interactive=True, now=0.0)
    plan = plans.plan(decoding("kev"), now=1.0, queued=never)
    assert adapters(plan) == ["kev"] and not plan.between_steps and not plan.next_pass


def test_laya_jobs_leading_the_prefill_order_go_without_the_kev_jobs_claimed_with_them():
    plans = scheduler(deadline=0.0)
    plans.claimed([job("kev", new_tokens=200), job("laya", new_tokens=20), job("kev", new_tokens=200)],
                  interactive=True, now=0.0)
    plan = plans.plan(decoding(), now=0.5, queued=never)
    assert adapters(plan) == ["laya"] and not plan.paced  # shortest first, and alone
    plan = plans.plan(decoding("laya"), now=0.6, queued=never)
    assert adapters(plan) == ["kev", "kev"] and plan.between_steps


def test_while_a_laya_row_decodes_kev_passes_take_their_share_but_a_job_past_the_fairness_bound_is_not_held():
    plans = scheduler(deadline=0.0)
    rows = decoding("laya", "kev")
    plans.claimed([job("kev", at=9.9)], interactive=True, now=9.9)
    plan = plans.plan(rows, now=10.0, queued=never)  # nothing paced ran yet
    assert adapters(plan) == ["kev"] and plan.between_steps and plan.next_pass
    plans.prefill_ran(10.0, 10.1)  # a 100 ms pass: the next waits 300 ms of decoding (share 0.25)
    assert not plans.plan(rows, now=10.39, queued=never).next_pass
    assert plans.plan(rows, now=10.4, queued=never).next_pass
    plans.prefill_ran(10.4, 10.5)
    plans.prefill_over()
    plans.claimed([job("kev", at=10.5)], interactive=True, now=10.5)
    plan = plans.plan(rows, now=10.6, queued=never)
    assert plan.prefill == () and not plan.next_pass and plan.step  # held: it waits in its slot
    plans.claimed([job("kev", at=8.0)], interactive=True, now=10.6)  # waited 2.6 s: past the bound
    plan = plans.plan(rows, now=10.61, queued=never)
    assert [c.claimed_at for c in plan.prefill] == [8.0] and plan.between_steps
    assert plan.next_pass  # its pass runs too: it is held past the bound
    plans.prefill_over()
    plan = plans.plan(decoding("kev", "kev"), now=10.62, queued=never)  # the Laya row finished: nothing paced
    assert [c.claimed_at for c in plan.prefill] == [10.5] and plan.next_pass


def test_batch_lines_never_share_a_prefill_with_interactive_jobs_and_go_a_few_at_a_time_while_those_come():
    plans = scheduler(deadline=0.0, batch_prefill_tokens=128)
    lines = [job("kev", prompt=100, line=True) for _ in range(3)]
    plans.claimed(lines, interactive=False, now=0.0)
    plans.claimed([job("kev", prompt=100)], interactive=True, now=0.0)
    plan = plans.plan(decoding(), now=1.0, queued=never)
    assert [c.request.background for c in plan.prefill] == [False]  # interactive first, alone
    plan = plans.plan(decoding("kev"), now=1.1, queued=never)
    assert len(plan.prefill) == 1 and plan.prefill[0].request.background  # 128 padded tokens: one line
    plans.prefill_over()
    plan = plans.plan(decoding("kev", "kev-line"), now=INTERACTIVE_QUIET_S + 1, queued=never)
    assert len(plan.prefill) == 2  # no interactive job for a while: the batch drains at full speed


def test_the_claims_keep_a_reservation_free_and_bound_the_batch_lines_while_interactive_jobs_come():
    plans = scheduler()
    starving = QueueSnapshot(queued={"kev": 20, "laya": 0}, oldest_wait_ms={"kev": 5000, "laya": 0},
                             batch_lines={"kev": 10})
    claims = plans.claims(starving, decoding(), now=1.0)
    assert claims.groups == [("kev", 6)]  # two of the eight slots stay free for Laya
    plans.claimed([job("laya")], interactive=True, now=1.0)
    claims = plans.claims(starving, decoding("kev-line", "kev-line", "kev-line", free=4), now=1.5)
    assert claims.groups == [("kev", 2)]  # three free (one is the Laya job's), one still Laya's; no line
    quiet = QueueSnapshot(queued={"kev": 0, "laya": 0}, oldest_wait_ms={"kev": 0, "laya": 0}, batch_lines={"kev": 9})
    # while interactive jobs come lines hold at most half of max_batch: three held, one more
    assert plans.claims(quiet, decoding("kev-line", "kev-line", "kev-line", free=4), now=2.0).groups == [("kev", 1)]
    # no interactive job for a while: lines take every free slot but the one Laya still reserves
    assert plans.claims(quiet, decoding(free=8), now=2.0 + INTERACTIVE_QUIET_S).groups == [("kev", 6)]
    assert plans.reserved(limit=4) == {"laya": 1}  # after an out-of-memory, a quarter of what is left


@pytest.mark.parametrize("spare_setting, free, expected_spare", [(1, 8, 1), (1, 1, 0), (2, 8, 2), (0, 8, 0)])
def test_a_claim_keeps_spare_slots_for_keys_that_hold_none(spare_setting: int, free: int, expected_spare: int):
    plans = scheduler(laya_reserved=0, key_spare_slots=spare_setting)
    backlog = QueueSnapshot(queued={"kev": 50, "laya": 0}, oldest_wait_ms={"kev": 10, "laya": 0})
    claims = plans.claims(backlog, decoding(free=free, limit=free), now=0.0)
    assert claims.spare == min(expected_spare, free - 1) and claims.groups == [("kev", free)]


@dataclass
class Simulated:
    """A decoder and a queue as plain numbers: a row decodes `steps` steps, a prefill between steps takes two
    passes, a step takes 10 ms."""

    slots: int = 6
    queue: list[tuple[str, int]] = field(default_factory=list)  # (adapter, steps) not yet claimed
    rows: list[list] = field(default_factory=list)  # [adapter, steps left]
    block: list[Claimed] = field(default_factory=list)  # the prefill under way
    passes_left: int = 0
    now: float = 0.0
    done: list[str] = field(default_factory=list)

    def decoding(self) -> Decoding:
        return Decoding([(adapter, False) for adapter, _ in self.rows], self.slots - len(self.rows) - len(self.block),
                        self.slots)

    def claim(self, plans: Scheduler) -> None:
        snapshot = QueueSnapshot(queued={a: sum(x == a for x, _ in self.queue) for a in ("kev", "laya")},
                                 oldest_wait_ms={"kev": 0.0, "laya": 0.0})
        took = 0
        for adapter, count in plans.claims(snapshot, self.decoding(), self.now).groups:
            mine = [item for item in self.queue if item[0] == adapter][:count]
            for item in mine:
                self.queue.remove(item)
            took += len(mine)
            plans.claimed([job(adapter, at=self.now, new_tokens=steps) for _, steps in mine], True, self.now)
        plans.looked(took, self.decoding())

    def run(self, plans: Scheduler) -> int:
        iterations = 0
        while True:
            iterations += 1
            assert iterations < 10_000, "the drain never ended"
            plan = plans.plan(self.decoding(), self.now, lambda: bool(self.queue))
            if plan.done:
                return iterations
            if plan.claim_now:
                self.claim(plans)
                continue
            assert len(plan.prefill) <= self.decoding().free
            if plan.between_steps:
                self.block, self.passes_left = list(plan.prefill), 2
            else:
                self.rows += [[c.request.adapter, c.request.max_new_tokens] for c in plan.prefill]
            if plan.next_pass:
                plans.prefill_ran(self.now, self.now + 0.005)
                self.passes_left -= 1
                if not self.passes_left:
                    self.rows += [[c.request.adapter, c.request.max_new_tokens] for c in self.block]
                    self.block = []
                    plans.prefill_over()
            if plan.step:
                if not self.rows:
                    plans.nothing_stepped()
                    continue
                if plan.claim_in_step:
                    self.claim(plans)
                for row in self.rows:
                    row[1] -= 1
                self.done += [adapter for adapter, left in self.rows if left == 0]
                self.rows = [row for row in self.rows if row[1] > 0]
                self.now += 0.01


def test_a_simulated_drain_claims_prefills_and_steps_every_job_once_and_ends():
    queue = [("kev", 30)] * 10 + [("laya", 4)] * 5 + [("kev", 3)] * 4
    simulated = Simulated(queue=list(queue))
    simulated.run(scheduler(laya_reserved=1))
    assert sorted(simulated.done) == sorted(adapter for adapter, _ in queue)
    assert not simulated.rows and not simulated.block and not simulated.queue


def test_a_role_loaded_at_run_time_is_ordered_by_its_own_expected_length_not_ahead_of_every_role():
    """Its jobs expect `KEVLAYA_ROLES__MAX_NEW_TOKENS` (256): after Laya's (128), before Kev's (512)."""
    plans = scheduler(laya_reserved=0)
    queue = QueueSnapshot({"kev": 3, "laya": 3, "mira": 3}, {"kev": 10.0, "laya": 10.0, "mira": 10.0}, {})
    assert [adapter for adapter, _ in plans.claims(queue, decoding(free=8), now=1.0).groups] == ["laya", "mira",
                                                                                                 "kev"]
