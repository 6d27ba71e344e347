"""Faults with real processes: the pool child killed while a slow model is loaded, the Celery main process
killed and restarted, a worker whose model cannot load, Redis restarted with and without its data, the database
unreachable with submits in flight, the API killed mid-submission, a poison job in every batch, two workers on
one queue with one of them killed mid-batch. Every accepted job must end exactly once, nothing may be left
stuck, and the worker must serve again without a human. RELIABILITY.md lists each with its latest run."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import threading
import time
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path

import httpx
import pytest
import redis
from sqlalchemy import func, select

from modellab.bench.chaos import DatabaseOutage
from shared.db import session_scope
from shared.heartbeat import live_workers
from shared.models import ApiKey, ClaimGroup, Job, JobStatus
from shared.queue import publish_wakeup
from tests.conftest import (
    AUTH,
    TEXT,
    Notices,
    RedisServer,
    reset_process_state,
    start_api,
    start_worker,
    submit,
    wait_finished,
    wait_until,
)

pytestmark = [pytest.mark.integration, pytest.mark.faults]

READY = re.compile(r"runtime ready on cpu in ([0-9.]+)s")


@pytest.fixture(scope="session")
def slow_model(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from modellab.model_factory import build_random_model

    return build_random_model(tmp_path_factory.mktemp("slow-model"), "slow-load", seed=0)


@pytest.fixture
def notices(env):
    collector = Notices(env["KEVLAYA_REDIS__URL"])
    yield collector
    collector.close()


def pool_child(main_pid: int) -> int | None:
    children = Path(f"/proc/{main_pid}/task/{main_pid}/children").read_text().split()
    return int(children[0]) if children else None


def submit_mix(api, round_: int) -> list[str]:  # noqa: ANN001
    return [submit(api, adapter, f"Round {round_}: options A cost {i}, B cost {9 - i}. Pick.", max_new_tokens=16)
            for i, adapter in enumerate(["kev", "laya", "auto", "kev", "laya", "auto"])]


def running_job() -> bool:
    with session_scope() as session:
        return session.scalar(select(Job.id).where(Job.status == JobStatus.RUNNING, Job.lease_owner.is_not(None)))


def is_stage_record(job: Job) -> bool:
    """Laya's stage of an escalated `auto` job: written as a record, already final, never claimed."""
    return job.parent_job_id is not None and job.adapter == "laya"


def ledger_problems() -> list[str]:
    """What the sweeper exists to repair, as it stands now: a `running` job without a live lease that waits on
    no unfinished stage, or an `auto` parent still waiting on a Kev stage that has finished."""
    now = datetime.now(timezone.utc)
    with session_scope() as session:
        rows = session.scalars(select(Job)).all()
    problems = []
    for job in (j for j in rows if j.status == JobStatus.RUNNING):
        stages = [c for c in rows if c.parent_job_id == job.id]
        kev = sorted((c for c in stages if c.adapter == "kev"), key=lambda c: c.created_at)
        if job.lease_owner is not None:
            if job.lease_expires_at is None or job.lease_expires_at < now - timedelta(seconds=30):
                problems.append(f"{job.id}: running on a lease that expired at {job.lease_expires_at}")
        elif not kev:
            problems.append(f"{job.id}: running without a lease and without a stage to wait on")
        elif kev[-1].status in JobStatus.FINISHED:
            problems.append(f"{job.id}: waiting on its Kev stage {kev[-1].id}, which is {kev[-1].status}")
    return problems


def assert_every_job_ended_once(job_ids: list[str], notices: Notices | None, expected: dict[str, str] | None = None,
                                announced_since: datetime | None = None) -> list[Job]:
    """All accepted jobs reached their expected final state (succeeded unless `expected` says otherwise); no job
    is left running or queued; an `auto` job has its Kev stage's answer; each final state was reached (and
    announced) exactly once. With `announced_since` (a Redis restart lost the subscription), only the jobs
    that finished after it must have been announced, and none twice. Returns every row."""
    with session_scope() as session:
        rows = session.scalars(select(Job)).all()
    # every job that is no Kev stage of an `auto` job is announced once it is stored
    announced = {str(j.id) for j in rows if not is_stage_record(j)}
    seen = notices.collect(expected=announced if announced_since is None else None) if notices is not None else None
    by_id = {str(j.id): j for j in rows}
    expected = expected or {}
    assert [by_id[i].status for i in job_ids] == [expected.get(i, "succeeded") for i in job_ids], \
        [(by_id[i].status, by_id[i].error_code, by_id[i].error_message) for i in job_ids]
    assert [j.id for j in rows if j.status not in JobStatus.FINISHED] == []
    assert ledger_problems() == []
    for job in rows:
        stages = [c for c in rows if c.parent_job_id == job.id]
        if stages:
            kev = max((c for c in stages if c.adapter == "kev"), key=lambda c: c.created_at)
            assert job.result_text == kev.result_text and job.status == kev.status
    if seen is None:
        return rows
    if announced_since is None:
        assert set(seen) == announced and set(seen.values()) == {1}, seen
    else:
        after = {str(j.id) for j in rows if not is_stage_record(j) and j.finished_at >= announced_since}
        assert after <= set(seen) <= announced and set(seen.values()) <= {1}, (after - set(seen), seen)
    return rows


@pytest.mark.slow  # three model loads of ~10 s and NF4 batches on the CPU: about 3 minutes per database
def test_pool_child_killed_three_times_with_a_slow_loading_model(env, api, start_process, slow_model, notices):
    env = {**env, "KEVLAYA_MODEL__BASE": str(slow_model["base"]), "KEVLAYA_KEV__PATH": str(slow_model["kev"]),
           "KEVLAYA_LAYA__PATH": str(slow_model["laya"]), "KEVLAYA_MODEL__QUANTIZATION": "nf4",
           "KEVLAYA_RELIABILITY__MAX_ATTEMPTS": "10",
           "KEVLAYA_KEV__MAX_NEW_TOKENS": "16"}  # an escalated Kev stage would otherwise write up to 512 tokens
    worker = start_worker(start_process, env, api)
    load_s = float(READY.search(worker.output()).group(1))
    assert load_s > 4, f"the model loaded in {load_s} s: too fast to test Celery's 4 s default"
    main_pid = worker.process.pid

    job_ids: list[str] = []
    for round_ in range(3):
        job_ids += submit_mix(api, round_)
        wait_until(running_job, 120, interval=0.05, what="a batch to start")
        child = pool_child(main_pid)
        os.kill(child, signal.SIGKILL)
        wait_until(lambda: pool_child(main_pid) not in (None, child), 30, what="a replacement child")
        wait_until(lambda: len(READY.findall(worker.log_path.read_text(errors="replace"))) == round_ + 2,
                   180, interval=0.5, what=f"replacement child {round_ + 1} to load the model")

    job_ids.append(submit(api, "laya", "after the kills", max_new_tokens=4))
    wait_finished(api, job_ids, timeout=300)
    log = worker.log_path.read_text(errors="replace")
    assert worker.process.poll() is None and "Timed out waiting for UP message" not in log
    assert_every_job_ended_once(job_ids, notices)


def test_main_process_killed_then_restarted_loses_nothing(env, api, start_process, notices):
    worker = start_worker(start_process, env, api)
    job_ids = submit_mix(api, 0) + [submit(api, "kev", f"long {i}", max_new_tokens=300) for i in range(4)]
    wait_until(running_job, 60, interval=0.02, what="a batch to start")
    child = pool_child(worker.process.pid)
    os.kill(worker.process.pid, signal.SIGKILL)  # the main process only: the child dies with it (pdeathsig)
    worker.process.wait(10)
    wait_until(lambda: not Path(f"/proc/{child}").exists(), 10, what="the pool child to die with its parent")

    start_worker(start_process, env, api)
    job_ids.append(submit(api, "laya", "after the restart", max_new_tokens=4))
    wait_finished(api, job_ids, timeout=240)
    assert_every_job_ended_once(job_ids, notices)


def test_a_worker_that_cannot_load_its_model_leaves_wake_ups_to_healthy_workers(env, api, start_process, tmp_path):
    # No sweeper re-publishing: a job runs only if its own wake-up reaches a worker that can serve it.
    env = {**env, "KEVLAYA_RELIABILITY__SWEEP_INTERVAL_S": "600"}
    broken = start_process("worker", {**env, "KEVLAYA_MODEL__BASE": str(tmp_path / "missing-model")})
    wait_until(lambda: "stopped consuming kevlaya.jobs" in broken.output(), 120, interval=0.5,
               what=f"the broken worker to stop consuming:\n{broken.output()}")
    job_ids = [submit(api, "laya", f"wake-up {i}", max_new_tokens=4) for i in range(3)]
    time.sleep(3)
    queue = redis.Redis.from_url(env["KEVLAYA_REDIS__URL"])
    # the wake-ups wait in Redis for a worker that can serve them (submits that met a publish in progress
    # share its wake-up: api/jobs/wakeups.py)
    assert 1 <= queue.llen("kevlaya.jobs") <= 3
    assert all(api.get(f"/v1/jobs/{j}").json()["status"] == "queued" for j in job_ids)
    assert broken.process.poll() is None and "Task kevlaya.run_queued[" not in broken.output()

    start_worker(start_process, env, api)
    jobs = wait_finished(api, job_ids, timeout=120)
    assert [j["status"] for j in jobs] == ["succeeded"] * 3
    assert "Task kevlaya.run_queued[" not in broken.output()


# -- Redis, the database and the API going away ------------------------------------------------------------

@pytest.fixture(params=["with-its-data", "without-its-data"])
def own_redis(request: pytest.FixtureRequest, tmp_path: Path) -> RedisServer:
    """A Redis of this test's own, so stopping it disturbs no other test. With its data: an append-only file,
    stopped cleanly, so queued wake-ups survive the restart; without: it comes back empty."""
    server = RedisServer(tmp_path / "own-redis", persistent=request.param == "with-its-data")
    server.start()
    yield server
    server.stop()


def test_redis_restarted_with_jobs_submitted_before_and_during_the_outage(env, start_process, own_redis,
                                                                          monkeypatch):
    env = {**env, "KEVLAYA_REDIS__URL": own_redis.url}
    monkeypatch.setenv("KEVLAYA_REDIS__URL", own_redis.url)
    reset_process_state()
    api = start_api(start_process, env)
    worker = start_worker(start_process, env, api)
    job_ids = submit_mix(api, 0) + [submit(api, "kev", f"long {i}", max_new_tokens=200) for i in range(3)]
    wait_until(running_job, 60, interval=0.02, what="a batch to start")

    own_redis.stop()  # mid-batch: the worker's message is unacked, its notices have nowhere to go
    during = [{"adapter": a, "input": f"during the outage {i}", "idempotency_key": f"outage-{i}",
               "params": {**TEXT, "max_new_tokens": 4}} for i, a in enumerate(["kev", "laya", "auto"])]
    with session_scope() as session:
        stored = session.scalar(select(func.count()).select_from(Job).where(Job.parent_job_id.is_(None)))
    for body in during:
        refused = api.post("/v1/jobs", json=body)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "queue_unavailable", refused.text
    time.sleep(3)
    with session_scope() as session:
        submitted = select(func.count()).select_from(Job).where(Job.parent_job_id.is_(None))  # not Kev stages
        assert session.scalar(submitted) == stored  # refused means not stored
    own_redis.start()
    notices = Notices(own_redis.url)
    listening_since = datetime.now(timezone.utc)  # what finished while Redis was down was announced to no one
    try:
        for body in during:  # the client retries what was refused
            response = api.post("/v1/jobs", json=body)
            assert response.status_code == 202, response.text
            job_ids.append(response.json()["id"])
        job_ids.append(submit(api, "laya", "after the restart", max_new_tokens=4))
        wait_finished(api, job_ids, timeout=240)
        assert worker.process.poll() is None
        assert_every_job_ended_once(job_ids, notices, announced_since=listening_since)
    finally:
        notices.close()
        api.close()


def stored_keys(keys: list[str]) -> dict[str, str]:
    """idempotency key -> job id, for the keys that are stored."""
    with session_scope() as session:
        return {k: str(i) for k, i in session.execute(
            select(Job.idempotency_key, Job.id).where(Job.idempotency_key.in_(keys))).all()}


def test_database_unreachable_for_ten_seconds_with_submits_in_flight(env, api, start_process, notices,
                                                                     database_url, request):
    admin_url = request.getfixturevalue("postgres_admin_url") if database_url.startswith("postgresql") else None
    worker = start_worker(start_process, {**env, "KEVLAYA_KEV__MAX_NEW_TOKENS": "16"}, api)
    job_ids = submit_mix(api, 0)
    sent: list[tuple[list[dict], int, float]] = []  # (bodies, status, seconds) of every request
    stop = threading.Event()

    def submitter(thread: int) -> None:
        with httpx.Client(base_url=str(api.base_url), headers=AUTH, timeout=60) as client:
            for n in range(10_000):
                if stop.is_set():
                    return
                size = 1 if n % 2 == 0 else 4  # single submits and batch submits
                bodies = [{"adapter": ["kev", "laya", "auto"][(n + i) % 3], "input": f"in flight {thread}.{n}.{i}",
                           "idempotency_key": f"t{thread}-{n}-{i}", "params": {**TEXT, "max_new_tokens": 4}}
                          for i in range(size)]  # `auto` escalates to Kev, capped by KEVLAYA_KEV__MAX_NEW_TOKENS
                started = time.monotonic()
                response = (client.post("/v1/jobs", json=bodies[0]) if size == 1
                            else client.post("/v1/jobs/batch", json={"jobs": bodies}))
                sent.append((bodies, response.status_code, time.monotonic() - started))
                time.sleep(0.2)

    threads = [threading.Thread(target=submitter, args=(t,)) for t in range(3)]
    for thread in threads:
        thread.start()
    time.sleep(1)
    outage = DatabaseOutage(database_url, admin_url)
    outage.begin()
    try:
        time.sleep(10)
    finally:
        outage.end()
    time.sleep(2)
    stop.set()
    for thread in threads:
        thread.join(90)

    assert {status for _, status, _ in sent} <= {202, 503}, [s for _, s, _ in sent]
    if admin_url:
        assert any(status == 503 for _, status, _ in sent)  # the outage was real, and said so
    else:
        assert all(status == 202 for _, status, _ in sent) and max(s for _, _, s in sent) > 5  # waited it out
    for bodies, status, _ in sent:
        keys = [b["idempotency_key"] for b in bodies]
        stored = stored_keys(keys)
        # A 503 stored nothing, except when the connection died after its commit was made: then all of it.
        assert len(stored) == len(keys) if status == 202 else len(stored) in (0, len(keys)), (status, stored)
        for body in bodies if len(stored) < len(keys) else []:  # the client retries what was refused
            response = api.post("/v1/jobs", json=body)
            assert response.status_code == 202, response.text
        job_ids += stored_keys(keys).values()
    job_ids.append(submit(api, "laya", "after the outage", max_new_tokens=4))
    wait_finished(api, job_ids, timeout=300)
    assert worker.process.poll() is None
    assert_every_job_ended_once(job_ids, notices)


def test_api_killed_mid_batch_submit_stores_each_batch_whole_or_not_at_all(env, api, start_process, notices):
    api_process = start_process.started[-1]
    sent: dict[str, tuple[list[dict], int | str]] = {}  # batch name -> (bodies, status or the transport error)

    def submitter(thread: int) -> None:
        with httpx.Client(base_url=str(api.base_url), headers=AUTH, timeout=60) as client:
            for n in range(1000):
                name = f"b{thread}-{n}"
                bodies = [{"adapter": "kev" if i % 2 else "laya", "input": f"{name} job {i}: A or B?",
                           "idempotency_key": f"{name}-{i}", "metadata": {"batch": name, "i": i},
                           "params": {**TEXT, "max_new_tokens": 1}} for i in range(32)]
                try:
                    sent[name] = (bodies, client.post("/v1/jobs/batch", json={"jobs": bodies}).status_code)
                except httpx.TransportError as exc:
                    sent[name] = (bodies, exc.__class__.__name__)
                    return

    threads = [threading.Thread(target=submitter, args=(t,)) for t in range(3)]
    for thread in threads:
        thread.start()
    wait_until(lambda: sum(s == 202 for _, s in list(sent.values())) >= 3, 60, interval=0.01,
               what="batch submits to be accepted")
    api_process.kill(signal.SIGKILL)
    for thread in threads:
        thread.join(60)
    cut = [name for name, (_, status) in sent.items() if status != 202]
    assert cut and {s for _, s in sent.values()} - {202} <= {"ReadError", "RemoteProtocolError", "ConnectError"}, \
        {n: s for n, (_, s) in sent.items()}

    job_ids: list[str] = []
    for name, (bodies, status) in sent.items():
        stored = stored_keys([b["idempotency_key"] for b in bodies])
        assert len(stored) in ((len(bodies),) if status == 202 else (0, len(bodies))), (name, status, len(stored))
        job_ids += stored.values()
    with session_scope() as session:  # nothing half-written: every stored row whole, none without its batch
        rows = session.scalars(select(Job)).all()
        assert len(rows) == len(job_ids) and all(
            j.status == JobStatus.QUEUED and j.api_key_id and j.meta["batch"] in sent and j.params["output"] == "text"
            and j.input == f"{j.meta['batch']} job {j.meta['i']}: A or B?" for j in rows)

    api = start_api(start_process, env)  # restarted by its supervisor; clients retry what got no answer
    try:
        for name in cut:
            response = api.post("/v1/jobs/batch", json={"jobs": sent[name][0]})
            assert response.status_code == 202, response.text
            ids = [j["id"] for j in response.json()["jobs"]]
            assert set(stored_keys([b["idempotency_key"] for b in sent[name][0]]).values()) == set(ids)
            job_ids += [i for i in ids if i not in job_ids]
        start_worker(start_process, {**env, "KEVLAYA_ENGINE__MAX_BATCH": "64"}, api)
        job_ids.append(submit(api, "laya", "after the restart", max_new_tokens=1))
        wait_finished(api, job_ids, timeout=300)
        assert_every_job_ended_once(job_ids, notices)
    finally:
        api.close()


# -- what runs: a poison job in every batch, two workers on one queue ----------------------------------------

def stored_job(adapter: str, job_input: object, params: dict) -> str:
    """A row written without the API (by another version of the service, or by hand), with its wake-up."""
    with session_scope() as session:
        key_id = session.scalar(select(ApiKey.id).where(ApiKey.name == "bootstrap"))
        job = Job(id=uuid.uuid4(), adapter=adapter, requested_adapter=adapter, status=JobStatus.QUEUED,
                  input=job_input, params=params, api_key_id=key_id, created_at=datetime.now(timezone.utc))
        session.add(job)
    publish_wakeup(job.id, adapter)
    return str(job.id)


def test_poison_jobs_among_good_ones_fail_alone_and_the_others_succeed(env, api, start_process):
    """Each poison is queued behind three good jobs of its adapter, and the worker holds four rows: every poison is
    claimed beside good jobs, fails alone with its code, and every good job succeeds on its first attempt."""
    # Over the context on the worker only: its Laya system prompt is longer than the API's (a changed setting
    # rolled out to the workers first). The API's own answer says how many new tokens would just fit there.
    long_input = "Options: " + " ".join(f"option {i} costs {i * 7 % 13}." for i in range(40))
    too_long = api.post("/v1/jobs", json={"adapter": "laya", "input": long_input,
                                           "params": {**TEXT, "max_new_tokens": 1024}})
    assert too_long.status_code == 422, too_long.text
    fits = int(re.search(r"at most (\d+) new tokens would fit", too_long.text).group(1))
    poisons = {
        "over the context on the worker": ("laya", lambda: submit(api, "laya", long_input, max_new_tokens=fits),
                                           "invalid_input"),
        "params the worker cannot use": ("laya", lambda: stored_job(
            "laya", "a stored job", {**TEXT, "max_new_tokens": 4, "temperature": "warm"}), "invalid_input"),
        "input that is not messages": ("kev", lambda: stored_job(
            "kev", {"messages": [{"role": "user"}]}, {**TEXT, "max_new_tokens": 4}), "invalid_input"),
        "kev params the worker cannot use": ("kev", lambda: stored_job(
            "kev", "a stored job", {**TEXT, "max_new_tokens": "four"}), "invalid_input"),
    }
    job_ids, expected = [], {}
    for n, (what, (adapter, make, code)) in enumerate(poisons.items()):
        job_ids += [submit(api, adapter, f"batch {n}, job {i}: A or B?", max_new_tokens=4) for i in range(3)]
        poison = make()
        job_ids.append(poison)
        expected[poison] = ("failed", code, what)
    worker_env = {**env, "KEVLAYA_ENGINE__MAX_BATCH": "4",
                  "KEVLAYA_LAYA__SYSTEM_PROMPT": "You are Laya. " + "Decide fast and answer in JSON. " * 12}
    start_worker(start_process, worker_env, api)
    wait_until(lambda: ledger_problems() == [] and all(
        j.status in JobStatus.FINISHED for j in job_rows(job_ids)), 180, interval=0.5, what="every job to end")

    rows = assert_every_job_ended_once(job_ids, None, {j: status for j, (status, _, _) in expected.items()})
    by_id = {str(j.id): j for j in rows}
    for job_id, (_, code, what) in expected.items():
        assert by_id[job_id].error_code == code and by_id[job_id].error_message, (what, by_id[job_id].error_message)
    assert all(by_id[job_id].attempts == 1 for job_id in job_ids)
    assert [by_id[j].status for j in job_ids if j not in expected] == ["succeeded"] * 3 * len(poisons)
    assert "invalid_input" in api.get(f"/v1/jobs/{job_ids[3]}").json()["error"]["code"]


def job_rows(job_ids: list[str]) -> list[Job]:
    with session_scope() as session:
        return session.scalars(select(Job).where(Job.id.in_([uuid.UUID(j) for j in job_ids]))).all()


def worker_of(process) -> str:  # noqa: ANN001
    """The name a worker's pool child writes into leases and batches."""
    return f"{socket.gethostname()}:{pool_child(process.process.pid)}"


def test_two_workers_share_one_queue_and_one_killed_mid_batch_runs_nothing_twice(env, api, start_process, notices):
    env = {**env, "KEVLAYA_ENGINE__MAX_BATCH": "2"}
    workers = [start_worker(start_process, env, api), start_worker(start_process, env, api)]

    def loaded(worker) -> bool:  # noqa: ANN001 - /readyz is ready with one worker; each reports on its own
        return pool_child(worker.process.pid) and live_workers().get(worker_of(worker), {}).get("model_loaded")

    for worker in workers:
        wait_until(lambda: loaded(worker), 120, interval=0.5, what=f"worker {worker.process.pid} to load its model")
    names = [worker_of(w) for w in workers]
    job_ids = [submit(api, "kev" if i % 2 else "laya", f"job {i}: weigh A against B.", max_new_tokens=150)
               for i in range(16)]

    def leases() -> dict[str, list[uuid.UUID]]:
        with session_scope() as session:
            running = session.execute(select(Job.lease_owner, Job.id).where(
                Job.status == JobStatus.RUNNING, Job.lease_owner.is_not(None))).all()
        held: dict[str, list[uuid.UUID]] = {}
        for owner, job_id in running:
            held.setdefault(owner, []).append(job_id)
        return held

    wait_until(lambda: set(leases()) == set(names), 60, interval=0.02, what="both workers to run a batch at once")
    workers[0].kill(signal.SIGKILL)
    killed = {str(j) for j in leases().get(names[0], [])}
    assert killed  # it really died mid-batch
    job_ids.append(submit(api, "laya", "after the kill", max_new_tokens=4))
    wait_finished(api, job_ids, timeout=300)

    rows = assert_every_job_ended_once(job_ids, notices)
    assert workers[1].process.poll() is None
    with session_scope() as session:
        batches = {b.id: b for b in session.scalars(select(ClaimGroup)).all()}
    by_id = {str(j.id): j for j in rows}
    assert {b.worker for b in batches.values()} == set(names)  # both were busy (they held leases at once)
    stored_by_the_killed = 0
    for job_id in job_ids:
        job = by_id[job_id]
        group = batches[job.batch_id]
        assert job.attempts == (2 if job_id in killed else 1), (job_id, job.attempts)
        if job_id in killed:
            assert group.worker == names[1] and group.finished_at is not None
        elif group.finished_at is None:  # stored by the killed worker before the kill took the rest of its group
            assert group.worker == names[0], job_id
            stored_by_the_killed += 1
    # Every claim that finished is one run of one job: no job was run twice to completion.
    assert sum(b.size for b in batches.values() if b.finished_at) + stored_by_the_killed == len(job_ids)
    # and the claims that never finished are the killed worker's (one batch, or one claim group per free slot)
    assert {b.worker for b in batches.values() if not b.finished_at} == {names[0]}


def batch_line(i: int) -> str:
    model = ["laya", "kev", "auto"][i % 3]
    # text answers (a chat answer is otherwise the role's decision, which 4 tokens cannot close)
    body = {"model": model, "messages": [{"role": "user", "content": f"Line {i}: options A cost {i}, B cost 3."}],
            "max_tokens": 4, "response_format": {"type": "text"}}
    return json.dumps({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body})


def lines_done(api, batch_id: str) -> int:  # noqa: ANN001
    counts = api.get(f"/v1/batches/{batch_id}").json()["request_counts"]
    return counts["completed"] + counts["failed"]


@pytest.mark.parametrize("own_redis", ["without-its-data"], indirect=True)  # the harder case: wake-ups lost
def test_a_batch_survives_worker_api_redis_and_database_faults_with_each_line_answered_once(
        env, start_process, own_redis, monkeypatch, database_url, request):
    """One batch through every fault in turn: the API killed just after the batch is created (mid-validation),
    the worker killed mid-drain, Redis restarted (here without its data), the database away for 10 s."""
    admin_url = request.getfixturevalue("postgres_admin_url") if database_url.startswith("postgresql") else None
    env = {**env, "KEVLAYA_REDIS__URL": own_redis.url, "KEVLAYA_BATCH__LEASE_S": "3"}
    monkeypatch.setenv("KEVLAYA_REDIS__URL", own_redis.url)
    reset_process_state()
    api = start_api(start_process, env)
    worker = start_worker(start_process, env, api)
    count = 120
    content = "\n".join([*(batch_line(i) for i in range(count)), json.dumps(
        {"custom_id": "bad", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "laya", "messages": [{"role": "user", "content": "x"}], "top_p": 2}})]).encode()
    file_id = api.post("/v1/files", files={"file": ("lines.jsonl", content)}, data={"purpose": "batch"}).json()["id"]
    batch_id = api.post("/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/chat/completions",
                                             "completion_window": "24h"}).json()["id"]
    start_process.started[0].kill()  # the API, while its keeper stores the lines
    api.close()
    api = start_api(start_process, env)
    try:
        wait_until(lambda: lines_done(api, batch_id) > 10, 120, interval=0.2, what="the drain to start")
        worker.kill()
        worker = start_worker(start_process, env, api)
        wait_until(lambda: lines_done(api, batch_id) > 40, 120, interval=0.2, what="the drain to go on")
        own_redis.stop()
        time.sleep(3)
        own_redis.start()
        wait_until(lambda: lines_done(api, batch_id) > 70, 120, interval=0.5, what="the drain after Redis")
        outage = DatabaseOutage(database_url, admin_url)
        outage.begin()
        try:
            time.sleep(10)
        finally:
            outage.end()
        batch = wait_until(lambda: (b := api.get(f"/v1/batches/{batch_id}").json())["status"] in
                           ("completed", "failed", "expired", "cancelled") and b, 300, interval=0.5,
                           what="the batch to finish")
        assert batch["status"] == "completed", batch
        assert batch["request_counts"] == {"total": count + 1, "completed": count, "failed": 1}

        def lines(file_id: str) -> list[dict]:
            return [json.loads(raw) for raw in api.get(f"/v1/files/{file_id}/content").text.splitlines()]

        output, errors = lines(batch["output_file_id"]), lines(batch["error_file_id"])
        assert sorted(o["custom_id"] for o in output) == sorted(f"line-{i}" for i in range(count))  # once each
        assert [e["custom_id"] for e in errors] == ["bad"]
        job_ids = [o["response"]["request_id"] for o in output]
        assert_every_job_ended_once(job_ids, None)
        assert worker.process.poll() is None
    finally:
        api.close()
