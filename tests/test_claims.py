"""The job ledger on SQLite and PostgreSQL: atomic claims, leases, idempotent finish."""

from __future__ import annotations

import threading
import uuid
from collections import Counter
from datetime import datetime, timedelta, timezone

from sqlalchemy import select, text, update

from shared import lifecycle
from shared.db import session_scope
from shared.lifecycle import JobOutcome
from shared.models import ApiKey, Job, JobStatus, Priority
from worker.ledger.claims import claim_group, queue_snapshot, renew_leases, stale_queued_adapters
from worker.ledger.fair_share import KeyTurns


def add_jobs(adapters: list[str], age_s: float = 0) -> list[uuid.UUID]:
    created = datetime.now(timezone.utc) - timedelta(seconds=age_s)
    jobs = [Job(adapter=a, requested_adapter=a, input="x", params={},
                created_at=created + timedelta(milliseconds=i)) for i, a in enumerate(adapters)]
    with session_scope() as session:
        session.add_all(jobs)
    return [j.id for j in jobs]


def test_snapshot_counts_and_ages_per_adapter(service_env):
    add_jobs(["kev", "kev"], age_s=5)
    add_jobs(["laya"])
    with session_scope() as session:
        snap = queue_snapshot(session)
    assert snap.queued == {"kev": 2, "laya": 1}
    assert snap.oldest_wait_ms["kev"] >= 5000 > snap.oldest_wait_ms["laya"]


def test_a_claim_takes_the_oldest_jobs_of_one_adapter_only(service_env):
    ids = add_jobs(["kev", "laya", "kev", "kev"])
    with session_scope() as session:
        batch, jobs = claim_group(session, "kev", 2, "w1", lease_s=30)
    assert [j.id for j in jobs] == [ids[0], ids[2]]
    assert all(j.status == "running" and j.attempts == 1 and j.batch_id == batch.id for j in jobs)
    with session_scope() as session:
        assert session.get(Job, ids[1]).status == "queued"


def test_concurrent_claims_never_take_the_same_job(service_env):
    ids = add_jobs(["kev"] * 60)
    claimed: list[list[uuid.UUID]] = []
    barrier = threading.Barrier(4)

    def claimer(name: str) -> None:
        mine = []
        barrier.wait()
        while True:
            with session_scope() as session:
                _, jobs = claim_group(session, "kev", 5, name, lease_s=30)
            if not jobs:
                break
            mine += [j.id for j in jobs]
        claimed.append(mine)

    threads = [threading.Thread(target=claimer, args=(f"w{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    everything = [job_id for mine in claimed for job_id in mine]
    assert sorted(everything) == sorted(ids)  # each job claimed exactly once


def test_finish_is_conditional_on_holding_the_lease(service_env):
    [job_id] = add_jobs(["laya"])
    with session_scope() as session:
        first_batch, [job] = claim_group(session, "laya", 100, "w1", lease_s=30)
        # the lease expires (worker presumed dead) and another worker re-runs the job
        session.execute(update(Job).values(lease_expires_at=datetime.now(timezone.utc) - timedelta(seconds=1)))
    with session_scope() as session:
        assert lifecycle.expire_leases(session, max_attempts=3) == [job_id]
    with session_scope() as session:
        second_batch, [rerun] = claim_group(session, "laya", 100, "w2", lease_s=30)
    assert rerun.attempts == 2

    done = JobOutcome(status=JobStatus.SUCCEEDED, result_text="second")
    with session_scope() as session:
        assert lifecycle.finish(session, rerun, second_batch.id, done)
        # the first worker comes back late: its result must not overwrite or duplicate anything
        assert not lifecycle.finish(session, job, first_batch.id, JobOutcome(status=JobStatus.SUCCEEDED, result_text="first"))
    with session_scope() as session:
        row = session.get(Job, job_id)
    assert row.status == "succeeded" and row.result_text == "second" and row.batch_id == second_batch.id
    assert row.queue_ms is not None and row.total_ms >= row.queue_ms


def test_renewed_leases_do_not_expire_and_repeated_deaths_fail_the_job(service_env):
    [job_id] = add_jobs(["kev"])
    with session_scope() as session:
        batch, _ = claim_group(session, "kev", 100, "w1", lease_s=0.001)
    with session_scope() as session:
        assert renew_leases(session, batch.id, lease_s=30) == 1
        assert lifecycle.expire_leases(session, max_attempts=3) == []
    for attempt in range(1, 4):
        with session_scope() as session:
            session.execute(update(Job).values(lease_expires_at=datetime.now(timezone.utc) - timedelta(seconds=1)))
            requeued = lifecycle.expire_leases(session, max_attempts=3)
        if attempt < 3:
            assert requeued == [job_id]
            with session_scope() as session:
                claim_group(session, "kev", 100, "w1", lease_s=30)
    with session_scope() as session:
        row = session.get(Job, job_id)
    assert row.status == "failed" and row.error_code == "internal" and row.attempts == 3


def test_stale_queued_adapters_finds_old_jobs_only(service_env):
    add_jobs(["kev"], age_s=60)
    add_jobs(["laya"])
    with session_scope() as session:
        assert stale_queued_adapters(session, older_than_s=30) == ["kev"]
        assert session.scalar(select(Job.status).where(Job.adapter == "kev")) == "queued"


def test_interactive_jobs_are_claimed_before_older_batch_lines_of_their_adapter(service_env):
    lines = add_jobs(["laya", "laya", "laya"], age_s=60)
    interactive = add_jobs(["laya", "kev"])
    with session_scope() as session:
        session.execute(update(Job).where(Job.id.in_(lines)).values(priority=Priority.BATCH))
    with session_scope() as session:
        snap = queue_snapshot(session)
        assert snap.queued == {"laya": 1, "kev": 1} and snap.batch_lines == {"laya": 3}
        assert snap.oldest_wait_ms["laya"] < 60_000  # the lines' wait sets no bound
        _, jobs = claim_group(session, "laya", 2, "w1", lease_s=30)
    assert {j.id for j in jobs} == {interactive[0], lines[0]}


# -- fair share per key (docs/architecture.md §3) ---------------------------------------------------------------------

def add_key(name: str, **columns) -> uuid.UUID:
    key = ApiKey(name=name, key_hash=uuid.uuid4().hex + uuid.uuid4().hex, **columns)
    with session_scope() as session:
        session.add(key)
    return key.id


def add_key_jobs(key: uuid.UUID, count: int, adapter: str = "laya", age_s: float = 0,
                 priority: int = Priority.INTERACTIVE) -> list[uuid.UUID]:
    created = datetime.now(timezone.utc) - timedelta(seconds=age_s)
    jobs = [Job(adapter=adapter, requested_adapter=adapter, input="x", params={}, api_key_id=key, priority=priority,
                created_at=created + timedelta(microseconds=i)) for i in range(count)]
    with session_scope() as session:
        session.add_all(jobs)
    return [j.id for j in jobs]


def claim_one(turns: KeyTurns | None = None, adapter: str = "laya") -> Job:
    with session_scope() as session:
        _, [job] = claim_group(session, adapter, 1, "w1", lease_s=30, **({"turns": turns} if turns else {}))
    return job


def test_a_key_with_a_backlog_holds_back_another_keys_job_by_one_claim_at_most(service_env):
    a, b = add_key("a"), add_key("b")
    add_key_jobs(a, 200, age_s=60)
    [single] = add_key_jobs(b, 1)
    assert claim_one().api_key_id == a  # nothing held: the oldest job
    assert claim_one().id == single  # a holds a slot, b none: b's turn


def test_keys_take_turns_when_every_claim_finds_no_slot_held(service_env):
    """One slot at a time, each job finished before the next claim: the turns this worker remembers decide."""
    a, b = add_key("a"), add_key("b")
    add_key_jobs(a, 20, age_s=60)
    add_key_jobs(b, 20, age_s=30)
    turns, served = KeyTurns(), []
    for _ in range(6):
        job = claim_one(turns)
        served.append(job.api_key_id)
        with session_scope() as session:  # it finishes: no key holds a slot at the next claim
            session.execute(update(Job).where(Job.id == job.id).values(status=JobStatus.SUCCEEDED, lease_owner=None))
    assert served == [a, b] * 3


def test_a_claim_splits_its_slots_between_keys_by_the_slots_they_hold(service_env):
    a, b, c = add_key("a"), add_key("b"), add_key("c")
    add_key_jobs(a, 100, age_s=60)
    with session_scope() as session:
        claim_group(session, "laya", 4, "w1", lease_s=30)  # a holds 4
    add_key_jobs(b, 100, age_s=30)
    add_key_jobs(c, 2)
    with session_scope() as session:
        _, jobs = claim_group(session, "laya", 8, "w1", lease_s=30)
    taken = Counter(job.api_key_id for job in jobs)
    assert taken == {b: 5, c: 2, a: 1}  # b and c catch up with a's 4 slots, c runs out, then one each


def test_interactive_jobs_come_before_every_keys_batch_lines_and_lines_take_turns_by_key(service_env):
    a, b = add_key("a"), add_key("b")
    add_key_jobs(a, 2000, age_s=60, priority=Priority.BATCH)
    [line] = add_key_jobs(b, 1, age_s=30, priority=Priority.BATCH)
    [interactive] = add_key_jobs(a, 1)
    assert claim_one().id == interactive
    assert claim_one().api_key_id == a  # the oldest line, nothing held
    assert claim_one().id == line  # a's lines hold a slot: b's one line is next


def test_a_key_of_weight_two_holds_twice_the_slots_of_a_key_of_weight_one(service_env):
    heavy, light = add_key("heavy", share_weight=2.0), add_key("light")
    add_key_jobs(heavy, 50, age_s=60)
    add_key_jobs(light, 50, age_s=30)
    with session_scope() as session:
        _, jobs = claim_group(session, "laya", 9, "w1", lease_s=30)
    assert Counter(job.api_key_id for job in jobs) == {heavy: 6, light: 3}


def test_a_lease_renewal_skips_the_rows_a_writer_holds_instead_of_waiting(service_env):
    """The result writer holds some of a group's rows (finishing them) while the leases are renewed: the renewal
    takes the others at once (PostgreSQL; before, it waited, and with the writer waiting in turn it deadlocked)."""
    first, second = add_jobs(["kev", "kev"])
    with session_scope() as session:
        batch, _ = claim_group(session, "kev", 100, "w1", lease_s=1)
    with session_scope() as writer:
        writer.execute(update(Job).where(Job.id == first).values(decode_ms=1.0))  # holds the row, uncommitted
        if writer.get_bind().dialect.name == "sqlite":
            return  # one writer at a time: nothing to skip
        with session_scope() as renewal:
            renewal.execute(text("SET LOCAL lock_timeout = '2s'"))
            assert renew_leases(renewal, batch.id, lease_s=30) == 1  # before: LockNotAvailable after 2 s
    with session_scope() as session:
        renewed = session.get(Job, second).lease_expires_at
    assert renewed > datetime.now(timezone.utc) + timedelta(seconds=20)
