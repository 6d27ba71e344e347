"""Long-polls (`/wait`, chat completions) wait on "job finished" notices: many waiters hold no database
connection, leave the API responsive, and return as soon as their jobs finish."""

from __future__ import annotations

import os
import statistics
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path

import httpx
import pytest
from sqlalchemy import create_engine, text, update
from sqlalchemy.engine import make_url

from shared.db import session_scope
from shared.keys import create_key
from shared.models import Job
from tests.conftest import AUTH, TEXT, free_port, start_worker, wait_until

pytestmark = pytest.mark.integration

WAITERS = 60  # more than the API's database pool holds (SQLite 5 + 10 overflow, PostgreSQL 10 + 20)
CHATS = 5


@pytest.fixture
def env(worker_env: dict[str, str]) -> dict[str, str]:
    # Re-checks every 60 s: a prompt return can only come from the notice.
    return {**worker_env, "KEVLAYA_API__PORT": str(free_port()), "KEVLAYA_LIMITS__WAIT_RECHECK_S": "60",
            "KEVLAYA_LIMITS__WAIT_TIMEOUT_S": "150", "KEVLAYA_LIMITS__CHAT_TIMEOUT_S": "150"}


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def connections_in_transaction(database_url: str) -> int | None:
    """PostgreSQL connections held inside a transaction (a waiter holding one shows here); None on SQLite."""
    url = make_url(database_url)
    if url.get_backend_name() != "postgresql":
        return None
    engine = create_engine(url)
    try:
        with engine.connect() as connection:
            return connection.scalar(text(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = :db AND state LIKE 'idle in transaction%'"
            ), {"db": url.database})
    finally:
        engine.dispose()


def test_sixty_waiters_hold_no_connection_keep_the_api_fast_and_return_when_their_jobs_finish(
        env, api, start_process):
    api_pid = start_process.started[0].process.pid
    with session_scope() as session:
        _, plain = create_key(session, "waiters")  # an ordinary key: its check reads the database
    base = f"http://127.0.0.1:{env['KEVLAYA_API__PORT']}"
    client = httpx.Client(base_url=base, headers={"Authorization": f"Bearer {plain}"}, timeout=200,
                          limits=httpx.Limits(max_connections=WAITERS + CHATS + 10))
    response = client.post("/v1/jobs/batch", json={"jobs": [
        {"adapter": "laya", "input": f"Decide {i}", "params": {**TEXT, "max_new_tokens": 4}} for i in range(WAITERS)]})
    job_ids = [j["id"] for j in response.json()["jobs"]]

    def wait(job_id: str) -> tuple[dict, float]:
        body = client.get(f"/v1/jobs/{job_id}/wait", params={"timeout": 140}).json()
        return body, time.time()

    def chat(i: int) -> tuple[httpx.Response, float]:
        answer = client.post("/v1/chat/completions", json={
            "model": "laya", "max_tokens": 4, "messages": [{"role": "user", "content": f"Chat {i}"}]})
        return answer, time.time()

    with ThreadPoolExecutor(WAITERS + CHATS) as pool:
        waits = [pool.submit(wait, job_id) for job_id in job_ids]
        chats = [pool.submit(chat, i) for i in range(CHATS)]
        time.sleep(3)  # every waiter is in its wait now (no worker runs yet)
        assert not any(f.done() for f in waits + chats)
        cpu_before = cpu_seconds(api_pid)
        time.sleep(3)
        idle_cpu_s = cpu_seconds(api_pid) - cpu_before  # waiters that poll the database keep the API busy

        latencies = []
        for _ in range(20):
            started = time.perf_counter()
            assert api.get("/healthz").status_code == 200
            latencies.append(time.perf_counter() - started)
        started = time.perf_counter()
        assert api.get(f"/v1/jobs/{job_ids[0]}").json()["status"] == "queued"  # the pool has connections to spare
        read_s = time.perf_counter() - started
        in_transaction = connections_in_transaction(env["KEVLAYA_DATABASE__URL"])

        start_worker(start_process, env, api)
        results = [f.result(timeout=180) for f in waits]
        chat_results = [f.result(timeout=180) for f in chats]
    client.close()

    assert statistics.median(latencies) < 0.05 and max(latencies) < 0.5, latencies
    assert read_s < 1.0
    assert idle_cpu_s < 0.5, f"the API used {idle_cpu_s:.2f} s of CPU in 3 s while {WAITERS + CHATS} requests waited"
    assert in_transaction in (None, 0)
    lags = []
    for body, returned_at in results:
        assert body["status"] == "succeeded", body
        lags.append(returned_at - datetime.fromisoformat(body["finished_at"]).timestamp())
    assert max(lags) < 3.0, sorted(lags)[-5:]  # well under the 60 s re-check
    for answer, returned_at in chat_results:
        assert answer.status_code == 200, answer.text
        job = api.get(f"/v1/jobs/{answer.json()['kevlaya']['job_id']}").json()
        assert returned_at - datetime.fromisoformat(job["finished_at"]).timestamp() < 3.0


def test_a_waiter_finds_its_job_by_re_checking_when_the_notice_is_lost(env, start_process):
    port = free_port()
    process = start_process("api", {**env, "KEVLAYA_API__PORT": str(port), "KEVLAYA_LIMITS__WAIT_RECHECK_S": "1"})
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", headers=AUTH, timeout=30)
    wait_until(lambda: process.process.poll() is None and _answers(client), 60, what="the API to answer")
    job_id = client.post("/v1/jobs", json={"adapter": "laya", "input": "x", "params": TEXT}).json()["id"]

    with ThreadPoolExecutor(1) as pool:
        started = time.monotonic()
        waiting = pool.submit(lambda: client.get(f"/v1/jobs/{job_id}/wait", params={"timeout": 20}).json())
        time.sleep(0.5)
        # Finished behind the notices' back (as when Redis was down at that moment): only a re-check finds it.
        with session_scope() as session:
            session.execute(update(Job).where(Job.id == uuid.UUID(job_id)).values(status="succeeded",
                                                                                  result_text="done"))
        body = waiting.result(timeout=30)
    assert body["status"] == "succeeded" and time.monotonic() - started < 5
    client.close()


def _answers(client: httpx.Client) -> bool:
    try:
        return client.get("/healthz").status_code == 200
    except httpx.TransportError:
        return False


def test_stopping_a_background_task_that_swallowed_its_cancellation_still_ends_it():
    """redis-py's asyncio client can swallow a cancellation that lands while it starts a command (seen with the
    job stream reader's blocking XREAD): the API's background readers are cancelled until they end."""
    import asyncio

    from api.streams.notices import stop

    async def stubborn() -> None:
        try:
            await asyncio.sleep(20)
        except asyncio.CancelledError:
            pass  # swallowed: the task goes on
        await asyncio.sleep(10)

    async def main() -> tuple[bool, float]:
        task = asyncio.get_running_loop().create_task(stubborn())
        await asyncio.sleep(0)
        started = time.monotonic()
        await stop(task)
        return task.cancelled(), time.monotonic() - started

    cancelled, took = asyncio.run(main())
    assert cancelled and took < 5
