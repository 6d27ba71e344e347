"""Worker faults with real processes: the pool child killed while a slow model is loaded, the Celery main
process killed and restarted, a worker whose model cannot load. Every accepted job must end exactly once,
nothing may be left stuck, and the worker must serve again without a human."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest
import redis
from sqlalchemy import select

from shared.db import session_scope
from shared.models import Job, JobStatus
from tests.conftest import Notices, start_worker, submit, wait_finished, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.faults]

READY = re.compile(r"runtime ready on cpu in ([0-9.]+)s")


@pytest.fixture(scope="session")
def slow_model(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from worker.model_factory import build_random_model

    return build_random_model(tmp_path_factory.mktemp("slow-model"), "slow-load", seed=0)


@pytest.fixture
def notices(env):
    collector = Notices(env["KEVLAYA_REDIS_URL"])
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


def assert_every_job_ended_once(job_ids: list[str], notices: Notices) -> None:
    """All accepted jobs succeeded; no job is left running or queued; an `auto` job has its Kev stage's
    answer; each final state was reached (and announced) exactly once."""
    seen = notices.collect()
    with session_scope() as session:
        rows = session.scalars(select(Job)).all()
    by_id = {str(j.id): j for j in rows}
    assert [by_id[i].status for i in job_ids] == ["succeeded"] * len(job_ids), \
        [(by_id[i].status, by_id[i].error_message) for i in job_ids]
    assert [j.id for j in rows if j.status not in JobStatus.FINISHED] == []
    for job in rows:
        stages = [c for c in rows if c.parent_job_id == job.id]
        if stages:
            kev = max((c for c in stages if c.adapter == "kev"), key=lambda c: c.created_at)
            assert job.result_text == kev.result_text and job.status == kev.status
    # Laya's stage of an `auto` job is written as a record, already final; every other row got there once.
    announced = {str(j.id) for j in rows if not (j.parent_job_id is not None and j.adapter == "laya")}
    assert set(seen) == announced and set(seen.values()) == {1}, seen


@pytest.mark.slow  # three model loads of ~10 s and NF4 batches on the CPU: about 3 minutes per database
def test_pool_child_killed_three_times_with_a_slow_loading_model(env, api, start_process, slow_model, notices):
    env = {**env, "KEVLAYA_BASE_MODEL": str(slow_model["base"]), "KEVLAYA_KEV__PATH": str(slow_model["kev"]),
           "KEVLAYA_LAYA__PATH": str(slow_model["laya"]), "KEVLAYA_QUANTIZATION": "nf4", "KEVLAYA_MAX_ATTEMPTS": "10",
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
    env = {**env, "KEVLAYA_SWEEP_INTERVAL_S": "600"}
    broken = start_process("worker", {**env, "KEVLAYA_BASE_MODEL": str(tmp_path / "missing-model")})
    wait_until(lambda: "stopped consuming kevlaya.jobs" in broken.output(), 120, interval=0.5,
               what=f"the broken worker to stop consuming:\n{broken.output()}")
    job_ids = [submit(api, "laya", f"wake-up {i}", max_new_tokens=4) for i in range(3)]
    time.sleep(3)
    queue = redis.Redis.from_url(env["KEVLAYA_REDIS_URL"])
    assert queue.llen("kevlaya.jobs") == 3  # the wake-ups wait in Redis for a worker that can serve them
    assert all(api.get(f"/v1/jobs/{j}").json()["status"] == "queued" for j in job_ids)
    assert broken.process.poll() is None and "Task kevlaya.run_queued[" not in broken.output()

    start_worker(start_process, env, api)
    jobs = wait_finished(api, job_ids, timeout=120)
    assert [j["status"] for j in jobs] == ["succeeded"] * 3
    assert "Task kevlaya.run_queued[" not in broken.output()
