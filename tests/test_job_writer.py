"""The API's job writer (api/jobs/writer.py), on a real database and Redis: submits handed over together are
stored in one commit, each gets its own answer, and what must not be stored is not."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import uuid
from collections.abc import Iterator
from concurrent.futures import Future
from datetime import datetime, timezone

import pytest
from sqlalchemy import event, select

from api.http.errors import ApiError
from api.jobs import writer as job_writer
from api.jobs.submission import Accepted, new_job
from api.jobs.writer import JobWriter
from api.jobs.writer_process import WriterProcess
from api.ops.metrics import ApiMetrics
from shared import db
from shared.clock import db_now
from shared.keys import create_key
from shared.models import ApiKey, Job
from shared.schemas import JobCreate
from tests.conftest import AUTH, free_port, job_count


class NotingPublisher:
    def __init__(self) -> None:
        self.noted: list[Job] = []

    def note(self, jobs: list[Job]) -> None:
        self.noted += jobs


@pytest.fixture
def keys(service_env) -> list[ApiKey]:  # noqa: ANN001
    with db.session_scope() as session:
        rows = [create_key(session, name)[0] for name in ("one", "two")]
    return rows


@pytest.fixture
def held_writer(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[JobWriter, NotingPublisher, threading.Event]]:
    """A writer whose first unit waits at its broker check until the test sets the event: what is handed over
    meanwhile is the next unit."""
    first_unit, release = threading.Event(), threading.Event()
    real_check = job_writer.check_queue

    def check_queue() -> None:
        if not first_unit.is_set():
            first_unit.set()
            assert release.wait(30)
        real_check()

    monkeypatch.setattr(job_writer, "check_queue", check_queue)
    publisher = NotingPublisher()
    writer = JobWriter(publisher)  # type: ignore[arg-type]
    writer.hand_over(_key_nobody_holds(), [])  # the first unit: held
    assert first_unit.wait(10)
    yield writer, publisher, release
    release.set()
    writer.close(30)


def _key_nobody_holds() -> ApiKey:
    return ApiKey(id=uuid.uuid4(), name="nobody", key_hash="-", is_admin=False)


def job(n: int, idempotency_key: str | None = None) -> JobCreate:
    return JobCreate(adapter="kev", input=f"job {n}", idempotency_key=idempotency_key)


def test_submits_handed_over_together_are_stored_in_one_commit(keys, held_writer):
    writer, publisher, release = held_writer
    commits: list[int] = []
    event.listen(db.get_engine(), "commit", lambda _connection: commits.append(1))
    futures = [writer.hand_over(keys[n % 2], [job(n)]) for n in range(20)]
    futures.append(writer.hand_over(keys[0], [job(100), job(101), job(102)]))  # a batch submit among them
    release.set()
    answers = [future.result(30) for future in futures]
    assert len(commits) == 1  # the held unit stored nothing (no valid key); the 21 submits: one commit
    ids = [stored_job.id for answer in answers for stored_job, created in answer]
    assert len(ids) == len(set(ids)) == 23 and all(created for answer in answers for _, created in answer)
    with db.new_session() as session:
        rows = {row.id: row for row in session.scalars(select(Job))}
    assert set(rows) == set(ids)
    assert [rows[answers[n][0][0].id].input for n in range(20)] == [f"job {n}" for n in range(20)]
    assert rows[answers[1][0][0].id].api_key_id == keys[1].id  # each job is its own submitter's
    assert {noted.id for noted in publisher.noted} == set(ids)  # and gets its wake-up


def test_each_insert_is_measured_with_its_submits(keys):
    """/metrics has every unit that inserted rows: how many submits it stored and how long its insert took."""
    metrics = ApiMetrics()
    writer = JobWriter(NotingPublisher(), metrics.note_unit)  # type: ignore[arg-type]
    futures = [writer.hand_over(keys[0], [job(n)]) for n in range(5)]
    futures.append(writer.hand_over(keys[1], [job(5), job(6)]))  # one submit of two jobs: one submit
    for future in futures:
        future.result(30)
    writer.close(30)
    registry = metrics.registry
    units = registry.get_sample_value("kevlaya_submit_unit_submits_count")
    assert registry.get_sample_value("kevlaya_submit_unit_submits_sum") == 6 and 1 <= units <= 6
    assert registry.get_sample_value("kevlaya_submit_write_seconds_count") == units
    assert 0 < registry.get_sample_value("kevlaya_submit_write_seconds_sum") < 30


def test_a_stored_row_holds_the_request_and_the_defaults_a_worker_counts_on(keys):
    """The rows go in as a bulk insert: every field of the request, and the column defaults (attempts 0)."""
    writer = JobWriter(NotingPublisher())  # type: ignore[arg-type]
    messages = {"messages": [{"role": "user", "content": "A or B?"}]}
    request = JobCreate(adapter="auto", input=messages,
                        params={"max_new_tokens": 12, "temperature": 0.5}, metadata={"ticket": 7},
                        idempotency_key="row-check")
    [(answer, created)] = writer.hand_over(keys[0], [request]).result(30)
    writer.close(30)
    with db.new_session() as session:
        row = session.get(Job, answer.id)
    assert created and row is not None
    assert (row.adapter, row.requested_adapter, row.status, row.attempts) == ("laya", "auto", "queued", 0)
    assert row.input == messages
    assert (row.params["max_new_tokens"], row.params["temperature"], row.meta) == (12, 0.5, {"ticket": 7})
    assert (row.idempotency_key, row.api_key_id, row.parent_job_id, row.batch_id) == ("row-check", keys[0].id,
                                                                                      None, None)
    assert row.created_at is not None and row.lease_owner is None


def test_one_idempotency_key_in_several_submits_of_a_unit_is_one_job_per_api_key(keys, held_writer):
    writer, _, release = held_writer
    first = writer.hand_over(keys[0], [job(1, "same")])
    again = writer.hand_over(keys[0], [job(2, "same")])
    other_key = writer.hand_over(keys[1], [job(3, "same")])
    release.set()
    [(first_job, first_created)], [(again_job, again_created)] = first.result(30), again.result(30)
    [(other_job, _)] = other_key.result(30)
    assert (first_created, again_created) == (True, False) and again_job.id == first_job.id
    assert other_job.id != first_job.id
    assert job_count() == 2


def test_a_submit_whose_client_left_before_its_turn_is_not_stored(keys, held_writer):
    writer, _, release = held_writer
    left: Future = writer.hand_over(keys[0], [job(1)])
    stays = writer.hand_over(keys[0], [job(2)])
    assert left.cancel()
    release.set()
    [(stored, _)] = stays.result(30)
    with db.new_session() as session:
        assert session.scalars(select(Job.input)).all() == ["job 2"]


def test_an_idempotency_race_with_another_process_fails_no_other_submit_of_the_unit(keys, held_writer,
                                                                                      monkeypatch):
    """The other process commits its job between this unit's lookup and its commit: the unit's insert hits
    the unique constraint, and each submit is then stored on its own."""
    writer, _, release = held_writer
    real_resolve = job_writer.resolve
    raced: list[Job] = []

    def resolve_then_lose_the_race(session, key, requests, seen):  # noqa: ANN001, ANN202
        answer = real_resolve(session, key, requests, seen)
        if requests[0].idempotency_key and not raced:
            with db.session_scope() as other:
                raced.append(new_job(requests[0], key, db_now(other)))
                other.add(raced[0])
        return answer

    monkeypatch.setattr(job_writer, "resolve", resolve_then_lose_the_race)
    before = writer.hand_over(keys[0], [job(1)])
    racing = writer.hand_over(keys[0], [job(2, "raced")])
    after = writer.hand_over(keys[1], [job(3)])
    release.set()
    [(racing_job, created)] = racing.result(30)
    assert racing_job.id == raced[0].id and not created
    assert before.result(30)[0][1] and after.result(30)[0][1]
    assert job_count() == 3


def test_a_key_revoked_after_the_api_read_it_stores_nothing(client):
    body = {"adapter": "kev", "input": "before"}
    assert client.post("/v1/jobs", json=body, headers=AUTH).status_code == 202  # the key is read, and kept
    with db.session_scope() as session:
        session.scalar(select(ApiKey).where(ApiKey.name == "bootstrap")).revoked_at = datetime.now(timezone.utc)
    for path, payload in (("/v1/jobs", body), ("/v1/jobs/batch", {"jobs": [body, body]}),
                          ("/v1/chat/completions", {"model": "kev", "messages": [{"role": "user", "content": "hi"}]})):
        refused = client.post(path, json=payload, headers=AUTH)
        assert refused.status_code == 401 and "revoked" in refused.json()["error"]["message"], (path, refused.text)
    assert job_count() == 1


def test_the_api_moves_what_it_loaded_at_start_out_of_the_collectors_sight(service_env):
    import gc

    from fastapi.testclient import TestClient

    from api.main import create_app

    gc.unfreeze()
    with TestClient(create_app()):
        assert gc.get_freeze_count() > 10_000  # modules, the tokenizer, the app: not walked by full collections
    assert gc.get_freeze_count() == 0  # given back when the app stops


def test_closing_stores_what_was_handed_over_and_refuses_what_comes_after(keys):
    from api.http.errors import ApiError

    writer = JobWriter(NotingPublisher())  # type: ignore[arg-type]
    futures = [writer.hand_over(keys[0], [job(n)]) for n in range(5)]
    writer.close(30)
    assert all(future.done() and future.result()[0][1] for future in futures)
    with pytest.raises(ApiError) as refused:
        writer.hand_over(keys[0], [job(9)])
    assert refused.value.status_code == 503 and refused.value.code == "shutting_down"
    assert job_count() == 5


WRITER_PROCESS = """
import sys, time, uuid
from sqlalchemy import event
from shared import db
from shared.models import Job

@event.listens_for(db.get_engine(), "connect")
def no_busy_handler(dbapi_connection, _record):  # a writer that finds the database locked fails at once
    dbapi_connection.execute("PRAGMA busy_timeout=0")

time.sleep(max(0.0, float(sys.argv[1]) - time.time()))  # both processes start writing at once
errors = 0
for n in range(150):
    try:
        with db.new_session() as session, db.one_writer(session):
            session.add(Job(id=uuid.uuid4(), adapter="kev", requested_adapter="kev", input=f"job {n}", params={}))
            session.commit()
    except Exception:  # "database is locked"
        errors += 1
print(errors)
"""


def test_api_processes_on_one_sqlite_file_take_turns_at_writing(tmp_path):
    """With KEVLAYA_API__WORKERS > 1 several processes write one SQLite file: they take turns on a lock file
    beside it (shared/db.py: one_writer) instead of on SQLite's busy handler. With the handler off, none of
    two processes writing at once ever finds the database locked."""
    import os
    import subprocess
    import sys
    import time

    from shared.migrate import upgrade

    url = f"sqlite:///{tmp_path / 'jobs.db'}"
    upgrade(url)
    env = {**os.environ, "KEVLAYA_DATABASE__URL": url}
    start = f"{time.time() + 3:.3f}"
    writers = [subprocess.Popen([sys.executable, "-c", WRITER_PROCESS, start], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [writer.communicate(timeout=120) for writer in writers]
    assert [writer.returncode for writer in writers] == [0, 0], outputs
    assert [out.strip() for out, _ in outputs] == ["0", "0"], outputs


# -- the writer in a process of its own (KEVLAYA_API__WRITER=process, what `kevlaya api` runs) ----------------

def run(coroutine):  # noqa: ANN001, ANN201
    return asyncio.run(coroutine)


def test_the_writer_process_stores_each_submit_and_answers_it(keys):
    units: list[tuple[int, float]] = []

    async def submit_all() -> list[list[Accepted]]:
        writer = WriterProcess(on_unit=lambda submits, seconds: units.append((submits, seconds)))
        await writer.start()
        try:
            singles = [writer.store(keys[n % 2], [job(n)]) for n in range(20)]
            batch = writer.store(keys[0], [job(100), job(101, "again")])
            answers = await asyncio.gather(*singles, batch)
            again = await writer.store(keys[0], [job(102, "again")])  # the idempotency key's job, not a new one
        finally:
            await writer.aclose(30)
        return [*answers, again]

    answers = run(submit_all())
    ids = [accepted.id for answer in answers[:-1] for accepted in answer]
    assert len(set(ids)) == 22 and all(accepted.created for answer in answers[:-1] for accepted in answer)
    [again] = answers[-1]
    assert not again.created and again.id == answers[-2][1].id
    with db.new_session() as session:
        rows = {row.id: row for row in session.scalars(select(Job))}
    assert set(rows) == set(ids)
    assert [rows[answers[n][0].id].input for n in range(20)] == [f"job {n}" for n in range(20)]
    assert rows[answers[1][0].id].api_key_id == keys[1].id
    assert sum(submits for submits, _ in units) == 21 and all(0 < seconds < 30 for _, seconds in units)


def test_the_writer_process_answers_with_the_errors_the_thread_would(keys, service_env, monkeypatch):
    with db.session_scope() as session:
        session.get(ApiKey, keys[1].id).revoked_at = datetime.now(timezone.utc)

    async def revoked_then_broker_down() -> tuple[BaseException, BaseException]:
        writer = WriterProcess()
        try:
            with pytest.raises(ApiError) as revoked:
                await writer.store(keys[1], [job(1)])
        finally:
            await writer.aclose(30)
        monkeypatch.setenv("KEVLAYA_REDIS__URL", f"redis://127.0.0.1:{free_port()}/0")  # nothing listens there
        writer = WriterProcess()
        try:
            with pytest.raises(ApiError) as refused:
                await writer.store(keys[0], [job(2)])
        finally:
            await writer.aclose(30)
        return revoked.value, refused.value

    revoked, refused = run(revoked_then_broker_down())
    assert (revoked.status_code, revoked.message) == (401, "API key revoked")
    assert (refused.status_code, refused.code, refused.headers) == (503, "queue_unavailable", {"Retry-After": "5"})
    assert job_count() == 0


def test_a_writer_process_that_dies_fails_its_submits_with_503_and_starts_again(keys):
    async def kill_then_submit() -> tuple[BaseException, list[Accepted]]:
        writer = WriterProcess()
        await writer.start()
        child = writer._process
        os.kill(child.pid, signal.SIGSTOP)  # the submit below waits in the child's socket
        held = asyncio.create_task(writer.store(keys[0], [job(1)]))
        await asyncio.sleep(0.2)
        os.kill(child.pid, signal.SIGKILL)
        with pytest.raises(ApiError) as stopped:
            await held
        try:
            return stopped.value, await writer.store(keys[0], [job(2)])  # a new child
        finally:
            assert writer._process is not child
            await writer.aclose(30)

    stopped, [stored] = run(kill_then_submit())
    assert (stopped.status_code, stopped.code) == (503, "writer_unavailable")
    assert "idempotency_key" in stopped.message
    with db.new_session() as session:
        assert [row.input for row in session.scalars(select(Job))] == ["job 2"] and stored.created


def test_the_writer_process_keeps_what_it_loaded_out_of_the_collectors_sight(keys, capfd):
    """Else a full collection walks every module the child imported, in the middle of a unit's insert."""
    async def one_submit() -> None:
        writer = WriterProcess()
        try:
            await writer.store(keys[0], [job(1)])
        finally:
            await writer.aclose(30)

    run(one_submit())
    ready = [line for line in capfd.readouterr().err.splitlines() if "job writer ready" in line]
    assert len(ready) == 1
    frozen = int(ready[0].split(", ")[-1].split()[0])
    assert frozen > 10_000, ready
