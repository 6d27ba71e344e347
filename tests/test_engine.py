"""The engine in a real worker process (Celery, Redis, SQL, transformers + peft on the tiny model):
jobs take slots as they free up, a Laya job does not wait for the Kev jobs ahead of it, nothing runs twice."""

from __future__ import annotations

import signal
import time
import uuid
from datetime import timedelta

import pytest
from sqlalchemy import func, select

from shared import lifecycle
from shared.db import session_scope
from shared.heartbeat import live_workers
from shared.models import ClaimGroup, Job
from tests.conftest import TEXT, sqlite_writers_fail_when_locked, start_worker, submit, wait_finished, wait_until


@pytest.fixture
def slot_env(env):  # noqa: ANN001, ANN201
    return {**env, "KEVLAYA_ENGINE__MAX_BATCH": "4", "KEVLAYA_ENGINE__WINDOW_TOKENS": "1024"}


@pytest.mark.integration
def test_jobs_of_both_adapters_all_succeed_through_slots(slot_env, api, start_process):
    """30 jobs queued before the worker starts: 4 slots, at most ~2 prompts prefilled between two steps."""
    job_ids = [submit(api, ("kev", "laya")[i % 2], f"Option A costs {i}, option B costs {30 - i}. Pick.",
                      max_new_tokens=4 + i % 7) for i in range(30)]
    # the API checks the model's 1024-token window; this worker's is 768 (a setting rolled out to workers first)
    too_long = submit(api, "kev", "Within the API's window, over the worker's.", max_new_tokens=700)
    # random weights never give Laya a confident decision: both escalate, and their Kev stages take slots too
    cascades = [submit(api, "auto", f"Pick A or B, case {i}.", max_new_tokens=4) for i in range(2)]
    start_worker(start_process, {**slot_env, "KEVLAYA_ENGINE__PREFILL_TOKENS": "64",
                                 "KEVLAYA_ENGINE__WINDOW_TOKENS": "768"}, api)
    [worker] = live_workers().values()  # its heartbeat says how it serves (the status page shows it)
    # KEVLAYA_ENGINE__MAX_BATCH=4 rows for any role, plus one slot reserved for Laya (a quarter of 4)
    assert (worker["slots"], worker["window_tokens"]) == (5, 768)
    refused = wait_finished(api, [too_long])[0]
    assert refused["status"] == "failed" and refused["error"]["code"] == "invalid_input"
    assert "KEVLAYA_ENGINE__WINDOW_TOKENS" in refused["error"]["message"]
    jobs = wait_finished(api, job_ids)
    assert [j["status"] for j in jobs] == ["succeeded"] * 30, [j["error"] for j in jobs]
    settled = wait_finished(api, cascades)
    assert [j["status"] for j in settled] == ["succeeded"] * 2, [j["error"] for j in settled]
    with session_scope() as session:
        stages = session.scalars(select(Job).where(Job.parent_job_id.in_([uuid.UUID(c) for c in cascades]))).all()
    assert sorted((s.adapter, s.status) for s in stages) == [("kev", "succeeded")] * 2 + [("laya", "succeeded")] * 2
    for job in jobs:
        assert job["attempts"] == 1 and job["batch_id"] is not None
        assert job["tokens"]["prompt"] > 0 and 1 <= job["tokens"]["completion"] <= job["params"]["max_new_tokens"]
        assert all(job["timings"][k] is not None for k in ("queue_ms", "prefill_ms", "decode_ms", "total_ms"))
    with session_scope() as session:
        finished = session.scalar(select(func.sum(ClaimGroup.size)).where(ClaimGroup.finished_at.is_not(None)))
        assert finished == 35  # every claim group closed with all its jobs stored (2 Laya + 2 Kev stages)


@pytest.mark.integration
def test_a_laya_job_does_not_wait_for_the_kev_jobs_in_flight(slot_env, api, start_process):
    # Exact lengths (end-of-sequence ignored): the random tiny model must not end the Kev jobs early.
    start_worker(start_process, {**slot_env, "KEVLAYA_ENGINE__IGNORE_EOS": "true",
                                 "KEVLAYA_ENGINE__WINDOW_TOKENS": "1024"}, api)
    kev = [submit(api, "kev", f"Long analysis number {i}.", max_new_tokens=600) for i in range(3)]

    def decoding() -> bool:
        with session_scope() as session:
            return session.scalar(select(func.count()).where(Job.status == "running")) == 3

    wait_until(decoding, 60, interval=0.05, what="the Kev jobs to take their slots")
    laya = submit(api, "laya", "Pick A or B.", max_new_tokens=4)
    jobs = wait_finished(api, [laya, *kev])
    assert [j["status"] for j in jobs] == ["succeeded"] * 4, [j["error"] for j in jobs]
    with session_scope() as session:
        rows = {str(j.id): j for j in session.scalars(select(Job)).all()}
    laya_row, kev_rows = rows[laya], [rows[k] for k in kev]
    assert all(k.started_at < laya_row.started_at for k in kev_rows)  # they were decoding when it came
    # it took the free slot beside them, not a turn after them
    assert laya_row.finished_at < min(k.finished_at for k in kev_rows)


@pytest.mark.integration
def test_a_laya_job_takes_its_reserved_slot_while_a_starving_kev_backlog_waits(slot_env, api, start_process):
    """Every slot but Laya's reserved one holds a Kev job and more Kev jobs wait past the fairness bound: the
    reserved slot stays free, and a Laya job arriving takes it at once instead of after a Kev row finishes."""
    start_worker(start_process, {**slot_env, "KEVLAYA_ENGINE__IGNORE_EOS": "true",
                                 "KEVLAYA_ENGINE__MAX_WAIT_MS": "0"}, api)
    kev = [submit(api, "kev", f"Long analysis number {i}.", max_new_tokens=600) for i in range(8)]

    def statuses() -> dict[str, str]:
        with session_scope() as session:
            return {str(i): s for i, s in session.execute(select(Job.id, Job.status)).all()}

    wait_until(lambda: list(statuses().values()).count("running") == 4, 60, interval=0.02,
               what="four Kev jobs to take the unreserved slots")
    time.sleep(0.3)  # several looks at the queue later, the starving backlog still has not taken the fifth slot
    assert sorted(statuses().values()) == ["queued"] * 4 + ["running"] * 4
    decoding = [k for k, status in statuses().items() if status == "running"]
    laya = submit(api, "laya", "Pick A or B.", max_new_tokens=4)
    jobs = wait_finished(api, [laya, *kev])
    assert [j["status"] for j in jobs] == ["succeeded"] * 9, [j["error"] for j in jobs]
    with session_scope() as session:
        rows = {str(j.id): j for j in session.scalars(select(Job)).all()}
    waiting = [rows[k] for k in kev if k not in decoding]
    assert rows[laya].finished_at < min(rows[k].finished_at for k in decoding)
    assert rows[laya].started_at < min(k.started_at for k in waiting)


@pytest.mark.integration
def test_a_worker_killed_mid_decode_loses_nothing_and_runs_nothing_twice(slot_env, api, start_process):
    long_jobs = {**slot_env, "KEVLAYA_ENGINE__IGNORE_EOS": "true", "KEVLAYA_ENGINE__WINDOW_TOKENS": "1024"}
    worker = start_worker(start_process, long_jobs, api)
    job_ids = [submit(api, "kev", f"Long analysis number {i}.", max_new_tokens=600) for i in range(6)]

    def running():
        with session_scope() as session:
            return session.execute(select(Job.id, Job.batch_id).where(Job.status == "running")).all()

    wait_until(running, 60, interval=0.02, what="jobs to take slots")
    worker.kill(signal.SIGKILL)
    killed = {str(job_id) for job_id, _ in running()}
    assert killed
    start_worker(start_process, {**long_jobs, "KEVLAYA_RELIABILITY__LEASE_SECONDS": "3"}, api)
    jobs = wait_finished(api, job_ids)
    assert [j["status"] for j in jobs] == ["succeeded"] * 6, [j["error"] for j in jobs]
    assert all(j["attempts"] == (2 if j["id"] in killed else 1) for j in jobs)


def test_a_released_job_is_queued_again_without_counting_an_attempt(service_env):
    from datetime import datetime, timezone

    with session_scope() as session:
        batch = ClaimGroup(id=uuid.uuid4(), adapters="kev", worker="w", started_at=datetime.now(timezone.utc))
        job = Job(adapter="kev", requested_adapter="kev", input="x", params=TEXT)
        session.add_all([batch, job])
        session.flush()
        lifecycle.claim(session, [job.id], batch.id, "w", 60)
    with session_scope() as session:
        assert lifecycle.release(session, [job.id], uuid.uuid4()) == []  # another batch cannot release it
        assert lifecycle.release(session, [job.id], batch.id) == [job.id]
    with session_scope() as session:
        stored = session.get(Job, job.id)
        assert (stored.status, stored.attempts, stored.lease_owner) == ("queued", 0, None)


def test_out_of_memory_in_a_step_puts_the_newest_jobs_back_and_every_job_still_runs_once(service_env, tiny_model):
    """The engine in this process on the tiny model: the first full step raises CUDA's out-of-memory error. The
    newest half of the rows go back to the queue (not failed, no attempt counted), the decoder holds fewer rows
    from then on, and every job ends succeeded, once."""
    import torch

    from shared.settings import Settings
    from worker.engine.loop import Engine
    from worker.model.loading import load_model

    settings = Settings(_env_file=None, model={"base": str(tiny_model["base"]), "device": "cpu"},
                        engine={"max_batch": 4, "ignore_eos": True}, kev={"path": str(tiny_model["kev"])},
                        laya={"path": str(tiny_model["laya"])})
    with session_scope() as session:
        jobs = [Job(adapter=a, requested_adapter=a, input=f"Question {i}?", params={**TEXT, "max_new_tokens": 12})
                for i, a in enumerate(["kev", "laya", "kev", "laya"])]
        session.add_all(jobs)
    engine = Engine(load_model(settings), settings)
    fired = []

    def out_of_memory_once(module, args):  # noqa: ANN001, ANN202
        # a decode step over all four rows; twice, since a step launched ahead that fails runs once more
        if args[0].shape == (4, 1) and len(fired) < 2:
            fired.append(True)
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (injected by the test)")

    embed = engine.loaded.model.get_input_embeddings()
    handle = embed.register_forward_pre_hook(out_of_memory_once)
    try:
        assert engine.drain(60) == 6  # four claims, then the two given back are claimed again
    finally:
        handle.remove()
        engine.decoder.close()
    assert fired and engine.decoder.limit == 3
    with session_scope() as session:
        stored = session.scalars(select(Job)).all()
        batches = session.scalars(select(ClaimGroup)).all()
    assert [(j.status, j.attempts, j.completion_tokens) for j in stored] == [("succeeded", 1, 12)] * 4
    assert sum(b.size for b in batches) == 6 and all(b.finished_at is not None for b in batches)


def row_of(job_id: uuid.UUID) -> Job:
    with session_scope() as session:
        return session.get(Job, job_id)


def _engine_with_jobs(tiny_model, count: int):  # noqa: ANN001, ANN202
    from shared.settings import Settings
    from worker.engine.loop import Engine
    from worker.model.loading import load_model

    settings = Settings(_env_file=None, model={"base": str(tiny_model["base"]), "device": "cpu"},
                        engine={"max_batch": 4, "ignore_eos": True}, kev={"path": str(tiny_model["kev"])},
                        laya={"path": str(tiny_model["laya"])})
    with session_scope() as session:
        session.add_all([Job(adapter=a, requested_adapter=a, input=f"Question {i}?",
                             params={**TEXT, "max_new_tokens": 6 + 3 * i})
                         for i, a in enumerate(["kev", "laya"] * (count // 2))])
    return Engine(load_model(settings), settings)


def _claims_seen(engine, fail_at: int | None = None) -> list[tuple[bool, bool]]:  # noqa: ANN001
    """Each claim as (rows were in flight, it ran inside a decode step); the claim number `fail_at` raises."""
    seen, in_step = [], [False]
    step, claim = engine.decoder.step, engine._claim

    def stepping(meanwhile=None):  # noqa: ANN001, ANN202
        in_step[0] = True
        try:
            return step(meanwhile)
        finally:
            in_step[0] = False

    def claiming() -> int:
        seen.append((bool(engine.decoder.rows), in_step[0]))
        if len(seen) == fail_at:
            raise RuntimeError("the database went away (injected by the test)")
        return claim()

    engine.decoder.step, engine._claim = stepping, claiming
    return seen


def test_a_claim_while_rows_decode_runs_inside_the_step_and_every_job_succeeds(service_env, tiny_model):
    """With rows in flight the engine claims while a step computes (on CUDA the GPU works meanwhile), so no row
    waits for the claim's database work; with none, it claims before anything else."""
    engine = _engine_with_jobs(tiny_model, 8)
    seen = _claims_seen(engine)
    try:
        assert engine.drain(60) == 8
    finally:
        engine.decoder.close()
    assert seen[0] == (False, False)  # the first claim: nothing in flight yet
    assert (True, True) in seen  # freed slots refilled by claims inside steps
    assert all(in_step for rows, in_step in seen if rows), seen
    with session_scope() as session:
        assert {j.status for j in session.scalars(select(Job))} == {"succeeded"}


def test_a_claim_that_raises_inside_a_step_is_not_the_step_failing(service_env, tiny_model):
    """The claim's error ends the drain as it always did (the task's retry takes over); the rows of the step it
    ran in are not failed as if the model had broken."""
    engine = _engine_with_jobs(tiny_model, 8)
    seen = _claims_seen(engine, fail_at=2)
    try:
        with pytest.raises(RuntimeError, match="database went away"):
            engine.drain(60)
    finally:
        engine.decoder.close()
    assert seen[1] == (True, True)  # it raised inside a step
    engine.writer.wait()
    with session_scope() as session:
        assert not session.scalars(select(Job).where(Job.status == "failed")).all()


@pytest.mark.parametrize("where", ["prefill", "step"])
def test_a_job_that_runs_out_of_memory_alone_fails_instead_of_going_back_to_the_queue(service_env, tiny_model,
                                                                                      where):
    """Giving rows back to the queue after an out-of-memory only helps while others share the memory: a job that
    runs out of memory with nothing beside it fails `out_of_memory` (before, it went back, was claimed again and
    ran out of memory again, forever). The job queued after it still runs."""
    import torch

    from shared.settings import Settings
    from worker.engine.loop import Engine
    from worker.ledger.settle import generation_request
    from worker.model.loading import load_model

    settings = Settings(_env_file=None, model={"base": str(tiny_model["base"]), "device": "cpu"},
                        engine={"max_batch": 1, "ignore_eos": True}, kev={"path": str(tiny_model["kev"])},
                        laya={"path": str(tiny_model["laya"])})
    with session_scope() as session:
        huge = Job(adapter="kev", requested_adapter="kev", input="A very long question " * 20,
                   params={**TEXT, "max_new_tokens": 6})
        session.add(huge)
        session.flush()
        small = Job(adapter="kev", requested_adapter="kev", input="Short?", params={**TEXT, "max_new_tokens": 6},
                    created_at=huge.created_at + timedelta(seconds=1))
        session.add(small)
        session.flush()
        requests = [generation_request(job, settings) for job in (huge, small)]
    engine = Engine(load_model(settings), settings)
    huge_tokens, small_tokens = (engine.loaded.check(r)[0] for r in requests)
    assert huge_tokens > small_tokens + 20

    def out_of_memory_for_the_huge_job(module, args):  # noqa: ANN001, ANN202
        width = args[0].shape[1]
        if where == "prefill" and width > (huge_tokens + small_tokens) / 2 or where == "step" and width == 1 and any(
                row.request.job_id == huge.id for row in engine.decoder.rows):
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (injected by the test)")

    handle = engine.loaded.model.get_input_embeddings().register_forward_pre_hook(out_of_memory_for_the_huge_job)
    try:
        assert engine.drain(30) == 2
    finally:
        handle.remove()
        engine.decoder.close()
    with session_scope() as session:
        failed, ran = session.get(Job, huge.id), session.get(Job, small.id)
    assert (failed.status, failed.error_code, failed.attempts) == ("failed", "out_of_memory", 1)
    assert "even when run alone" in failed.error_message
    assert (ran.status, ran.completion_tokens) == ("succeeded", 6)


def test_a_job_alone_out_of_memory_on_a_card_another_process_filled_waits_and_runs(service_env, tiny_model,
                                                                                   monkeypatch):
    """Another process filled the card after the worker sized its slots, and a job alone fails cuDNN's attention
    (a failed call, not an out-of-memory error: seen on the H200). It fits the worker's budget, so it goes back
    to the queue rather than failing, and runs once the memory is back."""
    import worker.engine.loop
    import worker.memory
    from shared.settings import Settings
    from worker.engine.loop import Engine
    from worker.model.loading import load_model

    settings = Settings(_env_file=None, model={"base": str(tiny_model["base"]), "device": "cpu"},
                        engine={"max_batch": 1, "ignore_eos": True}, kev={"path": str(tiny_model["kev"])},
                        laya={"path": str(tiny_model["laya"])})
    with session_scope() as session:
        job = Job(adapter="kev", requested_adapter="kev", input="Question?", params={**TEXT, "max_new_tokens": 6})
        session.add(job)
    engine = Engine(load_model(settings), settings)
    refusals = []
    monkeypatch.setattr(worker.memory, "device_free_bytes", lambda: 0)  # the card reads full throughout
    monkeypatch.setattr(worker.memory, "reserved_bytes", lambda: 2**30)  # well under the budget
    monkeypatch.setattr(worker.engine.loop, "CARD_FULL_PAUSE_S", 0.01)

    def refused_while_the_card_is_full(module, args):  # noqa: ANN001, ANN202
        if len(refusals) < 2 and args[0].shape[1] > 1:  # a prefill, until the memory is back
            refusals.append(True)
            raise RuntimeError("Expected mha_graph.execute(handle, variant_pack, workspace_ptr.get()).is_good() "
                               "to be true, but got false.")

    handle = engine.loaded.model.get_input_embeddings().register_forward_pre_hook(refused_while_the_card_is_full)
    try:
        assert engine.drain(30) == 3  # claimed, given back twice, then run
    finally:
        handle.remove()
        engine.decoder.close()
    with session_scope() as session:
        stored = session.get(Job, job.id)
    assert len(refusals) == 2
    assert (stored.status, stored.error_code, stored.completion_tokens) == ("succeeded", None, 6)


def test_a_reservation_shrinks_with_the_slots_an_out_of_memory_left(service_env, tiny_model):
    """After out-of-memory errors shrank the decoder to one slot, Laya's reservation must not keep that slot
    from a Kev backlog: the Kev jobs still run."""
    from shared.settings import Settings
    from worker.engine.loop import Engine
    from worker.model.loading import load_model

    settings = Settings(_env_file=None, model={"base": str(tiny_model["base"]), "device": "cpu"},
                        engine={"max_batch": 4}, kev={"path": str(tiny_model["kev"])},
                        laya={"path": str(tiny_model["laya"])})
    with session_scope() as session:
        session.add_all([Job(adapter="kev", requested_adapter="kev", input=f"Question {i}?",
                             params={**TEXT, "max_new_tokens": 4}) for i in range(3)])
    engine = Engine(load_model(settings), settings)
    engine.decoder.limit = 1  # what repeated out-of-memory give-backs leave
    try:
        assert engine.drain(5) == 3
    finally:
        engine.decoder.close()
    with session_scope() as session:
        assert [j.status for j in session.scalars(select(Job)).all()] == ["succeeded"] * 3


def test_a_job_the_engine_cannot_run_fails_alone_and_its_batch_mates_finish(service_env, tiny_model):
    """Stored params no version of the API would write (a temperature that is text) break the request on its
    way to the decoder: that job fails `invalid_input`, alone; the others claimed with it finish (the drain
    raised and stopped before)."""
    from shared.settings import Settings
    from worker.engine.loop import Engine
    from worker.model.loading import load_model

    settings = Settings(_env_file=None, model={"base": str(tiny_model["base"]), "device": "cpu"},
                        engine={"max_batch": 4}, kev={"path": str(tiny_model["kev"])},
                        laya={"path": str(tiny_model["laya"])})
    with session_scope() as session:
        jobs = [Job(id=uuid.uuid4(), adapter="kev", requested_adapter="kev", input=f"Question {i}?",
                    params={**TEXT, "max_new_tokens": 6, **({"temperature": "warm"} if i == 1 else {})})
                for i in range(3)]
        poisoned = jobs[1].id
        session.add_all(jobs)
    engine = Engine(load_model(settings), settings)
    try:
        assert engine.drain(60) == 3
    finally:
        engine.decoder.close()
    with session_scope() as session:
        stored = {j.id: j for j in session.scalars(select(Job)).all()}
    bad = stored.pop(poisoned)
    assert (bad.status, bad.error_code) == ("failed", "invalid_input") and "TypeError" in bad.error_message
    assert [j.status for j in stored.values()] == ["succeeded", "succeeded"]


def test_a_roles_default_shrinks_to_what_the_window_leaves_and_a_chosen_length_does_not(service_env, tiny_model):
    """A job that sets no max_new_tokens takes its role's default, at most what the window leaves after its prompt:
    it runs and stops at the window's end (finish_reason length). One that chose too many fails, naming why."""
    from shared.settings import Settings
    from worker.engine.loop import Engine
    from worker.model.loading import load_model

    settings = Settings(_env_file=None, model={"base": str(tiny_model["base"]), "device": "cpu"},
                        engine={"max_batch": 2, "ignore_eos": True, "window_tokens": 320},
                        kev={"path": str(tiny_model["kev"]), "max_new_tokens": 512},
                        laya={"path": str(tiny_model["laya"])})
    question = "Which of the two options is cheaper over a year of use? " * 2
    with session_scope() as session:
        defaulted = Job(adapter="kev", requested_adapter="kev", input=question, params=dict(TEXT))
        chosen = Job(adapter="kev", requested_adapter="kev", input=question, params={**TEXT, "max_new_tokens": 512})
        session.add_all([defaulted, chosen])
    engine = Engine(load_model(settings), settings)
    try:
        assert engine.drain(120) == 2
    finally:
        engine.decoder.close()
    ran, refused = row_of(defaulted.id), row_of(chosen.id)
    assert ran.status == "succeeded" and ran.finish_reason == "length", (ran.status, ran.error_message)
    assert 0 < ran.completion_tokens and ran.prompt_tokens + ran.completion_tokens == 320
    assert (refused.status, refused.error_code) == ("failed", "invalid_input")
    assert "max_new_tokens 512" in refused.error_message and "window of 320" in refused.error_message


def test_rows_finished_by_one_step_are_stored_together_and_one_that_cannot_be_stored_alone(
        service_env, tiny_model, monkeypatch):
    """Four rows that finish at the same step are stored in one transaction; when storing one of them raises,
    the others are stored one by one and succeed, and the error still reaches the drain."""
    from shared.settings import Settings
    from worker.engine import writer
    from worker.engine.loop import Engine
    from worker.model.loading import load_model

    # no latency role: Laya's jobs are prefilled with Kev's (not apart), so all four rows finish at one step; no
    # spare slot for another key, so the four jobs of one key take all four slots
    settings = Settings(_env_file=None, model={"base": str(tiny_model["base"]), "device": "cpu"},
                        engine={"max_batch": 4, "ignore_eos": True, "key_spare_slots": 0},
                        kev={"path": str(tiny_model["kev"])},
                        laya={"path": str(tiny_model["laya"]), "reserved_slots": 0})
    with session_scope() as session:
        jobs = [Job(id=uuid.uuid4(), adapter=a, requested_adapter=a, input=f"Question {i}?",
                    params={**TEXT, "max_new_tokens": 5}) for i, a in enumerate(["kev", "laya", "kev", "laya"])]
        session.add_all(jobs)
    broken = jobs[2].id
    settle = writer.settle_job

    def settle_or_break(session, job, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        if job.id == broken:
            raise RuntimeError("the database refused this row (injected by the test)")
        return settle(session, job, *args, **kwargs)

    monkeypatch.setattr(writer, "settle_job", settle_or_break)
    engine = Engine(load_model(settings), settings)
    groups = []
    write = engine.writer._write
    monkeypatch.setattr(engine.writer, "_write", lambda items: groups.append(len(items)) or write(items))
    try:
        with pytest.raises(RuntimeError, match="injected by the test"):
            engine.drain(30)
    finally:
        engine.decoder.close()
    assert groups[0] == 4  # the whole step's rows in one transaction, then each alone
    with session_scope() as session:
        stored = {j.id: j.status for j in session.scalars(select(Job)).all()}
    assert [stored[j.id] for j in jobs] == ["succeeded", "succeeded", "running", "succeeded"]
    # Its group is not held any more: nothing renews the unstored job's lease, so it lapses and the job runs again
    # (it was held, and renewed by every later drain, until the worker died: minutes on a database outage).
    assert engine.writer.live_groups() == []


def test_a_result_waits_for_a_database_that_went_away_and_is_stored_once_it_is_back(
        service_env, tiny_model, monkeypatch):
    """Storing a finished job's result while the database is unreachable (connections refused or dropped)
    is tried again until it is back: the job is stored once, on its first attempt, not run again."""
    from sqlalchemy.exc import OperationalError

    from worker.engine import writer

    monkeypatch.setattr(writer, "STORE_RETRY_PAUSE_S", 0.05)
    engine = _engine_with_jobs(tiny_model, 2)
    settle, refusals = writer.settle_job, []

    def settle_while_away(session, job, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        if len(refusals) < 5:
            refusals.append(job.id)
            raise OperationalError("SELECT 1", {}, Exception("connection refused (injected by the test)"))
        return settle(session, job, *args, **kwargs)

    monkeypatch.setattr(writer, "settle_job", settle_while_away)
    try:
        assert engine.drain(60) == 2
    finally:
        engine.decoder.close()
    assert len(refusals) == 5 and engine.writer.live_groups() == []
    with session_scope() as session:
        rows = session.scalars(select(Job)).all()
    assert [(j.status, j.attempts) for j in rows] == [("succeeded", 1)] * 2


def test_a_claim_group_is_closed_in_the_commit_that_finishes_its_last_job(service_env, tiny_model):
    """The result writer closes a claim group's row in the transaction that stores its last job: after every
    commit, a group whose jobs are all stored as finished is closed (a test once read a group still open right
    after the last of its jobs had finished)."""
    from sqlalchemy import event
    from sqlalchemy.orm import Session

    from shared.settings import Settings
    from worker.engine.loop import Engine
    from worker.model.loading import load_model

    settings = Settings(_env_file=None, model={"base": str(tiny_model["base"]), "device": "cpu"},
                        engine={"max_batch": 4, "ignore_eos": True}, kev={"path": str(tiny_model["kev"])},
                        laya={"path": str(tiny_model["laya"])})
    with session_scope() as session:
        session.add_all([Job(id=uuid.uuid4(), adapter=a, requested_adapter=a, input=f"Question {i}?",
                             params={**TEXT, "max_new_tokens": 2 + i}) for i, a in enumerate(["kev", "laya"] * 3)])
    open_but_done: list[uuid.UUID] = []  # groups seen with every job finished and no finished_at
    closed: set[uuid.UUID] = set()
    reading = False

    def read_after_commit(_session: Session) -> None:
        nonlocal reading
        if reading:  # this read's own commit
            return
        reading = True
        try:
            with session_scope() as session:
                rows = session.execute(select(ClaimGroup.id, ClaimGroup.finished_at, Job.finished_at).join(
                    Job, Job.batch_id == ClaimGroup.id)).all()
            unfinished = {group for group, _, job_finished in rows if job_finished is None}
            open_but_done.extend({group for group, group_finished, _ in rows
                                  if group_finished is None and group not in unfinished})
            closed.update(group for group, group_finished, _ in rows if group_finished is not None)
        finally:
            reading = False

    engine = Engine(load_model(settings), settings)
    event.listen(Session, "after_commit", read_after_commit)
    try:
        engine.drain(30)
    finally:
        event.remove(Session, "after_commit", read_after_commit)
        engine.decoder.close()
    assert closed and open_but_done == []


def test_the_decode_loop_leaves_the_results_text_to_the_writer_thread(service_env, tiny_model, monkeypatch):
    """Making a row's text and token spans costs milliseconds a row (a decode per prefix), which every row in flight
    would wait for: the writer thread makes it, with its own tokenizer, and the stored text is that text. The
    loop's phases are timed on /metrics, and the writer cannot hold the decode loop for Python's default 5 ms."""
    import sys
    import threading

    from shared.settings import Settings
    from worker.engine.loop import Engine
    from worker.ledger.outcomes import stored_text
    from worker.metrics import ENGINE_PHASES, METRICS
    from worker.model import tokens
    from worker.model.loading import load_model

    settings = Settings(_env_file=None, model={"base": str(tiny_model["base"]), "device": "cpu"},
                        engine={"max_batch": 4, "ignore_eos": True, "switch_interval_ms": 0.25},
                        kev={"path": str(tiny_model["kev"])}, laya={"path": str(tiny_model["laya"])})
    with session_scope() as session:
        jobs = [Job(id=uuid.uuid4(), adapter=a, requested_adapter=a, input=f"Question {i}?",
                    params={**TEXT, "max_new_tokens": 6}) for i, a in enumerate(["kev", "laya", "kev"])]
        session.add_all(jobs)
    made: list[tuple[str, object, str]] = []
    decode = tokens.decode_with_spans

    def recorded(tokenizer, tokens):  # noqa: ANN001, ANN202
        text, spans = decode(tokenizer, tokens)
        made.append((threading.current_thread().name, tokenizer, text))
        return text, spans

    monkeypatch.setattr(tokens, "decode_with_spans", recorded)
    before = {p: METRICS.engine_phase.labels(p)._sum.get() for p in ENGINE_PHASES}
    switch_interval = sys.getswitchinterval()
    engine = Engine(load_model(settings), settings)
    try:
        assert sys.getswitchinterval() == pytest.approx(0.00025)
        assert engine.drain(30) == 3
    finally:
        engine.decoder.close()
        sys.setswitchinterval(switch_interval)
    assert len(made) == 3 and all(name.startswith("result-writer") for name, _, _ in made)
    assert all(tokenizer is engine.writer.tokenizer is not engine.loaded.tokenizer for _, tokenizer, _ in made)
    with session_scope() as session:
        stored = sorted(j.result_text for j in session.scalars(select(Job)).all())
    # sampled from random weights: a text may hold NUL, which every store writes as U+FFFD (PostgreSQL refuses it)
    assert stored == sorted(stored_text(text) for _, _, text in made) and all(stored)
    assert all(METRICS.engine_phase.labels(p)._sum.get() > before[p] for p in ENGINE_PHASES)


def _timed(prefills: list, engine, run, adapters_of):  # noqa: ANN001, ANN202
    """`run` (a whole prefill or a pass), recording (started, ended, adapters, a Laya row decoding) in `prefills`."""
    def timed(*args):  # noqa: ANN002, ANN202
        laya_decoding = any(engine.decoder.adapters[r.adapter] == "laya" for r in engine.decoder.rows)
        adapters, started = adapters_of(*args), time.monotonic()
        try:
            return run(*args)
        finally:
            prefills.append((started, time.monotonic(), adapters, laya_decoding))
    return timed


def test_kev_prefills_are_paced_while_a_laya_row_decodes_and_every_job_succeeds(service_env, tiny_model, monkeypatch):
    """One prompt per prefill (KEVLAYA_ENGINE__PREFILL_TOKENS=1): the Laya job first, then Kev prompts one by one,
    each in passes between steps. While the Laya row decodes, a Kev pass of d seconds is followed by at least
    d × (1 − share) / share seconds of decoding before the next one (share 0.25: 3 d), so the Laya row spends at
    most a quarter of its time waiting for them."""
    from shared.settings import Settings
    from worker.engine.loop import Engine
    from worker.model.loading import load_model

    # On a loaded machine no job may reach the fairness bound, which is never paced.
    settings = Settings(_env_file=None, model={"base": str(tiny_model["base"]), "device": "cpu"},
                        kev={"path": str(tiny_model["kev"])}, laya={"path": str(tiny_model["laya"])},
                        engine={"max_batch": 4, "ignore_eos": True, "prefill_tokens": 1, "prefill_share": 0.25,
                                "max_wait_ms": 600_000})
    with session_scope() as session:
        session.add(Job(adapter="laya", requested_adapter="laya", input="Quick: A or B?",
                        params={**TEXT, "max_new_tokens": 120}))
        session.add_all([Job(adapter="kev", requested_adapter="kev", input=f"Weigh option {i}.",
                             params={**TEXT, "max_new_tokens": 240}) for i in range(4)])
    engine = Engine(load_model(settings), settings)
    prefills: list[tuple[float, float, list[str], bool]] = []
    decoder = engine.decoder
    monkeypatch.setattr(decoder, "prefill", _timed(prefills, engine, decoder.prefill,
                                                   lambda requests, *_: [r.adapter for r in requests]))
    monkeypatch.setattr(decoder, "prefill_pass", _timed(prefills, engine, decoder.prefill_pass,
                                                        lambda: [r.request.adapter for r in decoder.prefilling.rows]))
    try:
        assert engine.drain(60) == 5
    finally:
        engine.decoder.close()
    assert [adapters for _, _, adapters, _ in prefills] == [["laya"]] + [["kev"]] * 4
    paced = [(a, b) for a, b in zip(prefills[1:], prefills[2:]) if b[3]]  # Kev after Kev, Laya still decoding
    assert paced, "the Laya row finished before a second Kev prefill: give it more tokens"
    for (started, ended, _, _), (next_started, _, _, _) in paced:
        assert next_started >= ended + 3 * (ended - started)
    with session_scope() as session:
        assert {j.status for j in session.scalars(select(Job)).all()} == {"succeeded"}


def _engine_with_a_kev_job(tiny_model, new_tokens: int):  # noqa: ANN001, ANN202
    """An engine whose prefill passes take 16 padded tokens, and one Kev job queued for it."""
    from shared.settings import Settings
    from worker.engine.loop import Engine
    from worker.model.loading import load_model

    settings = Settings(_env_file=None, model={"base": str(tiny_model["base"]), "device": "cpu"},
                        engine={"max_batch": 4, "ignore_eos": True, "prefill_chunk_tokens": 16},
                        kev={"path": str(tiny_model["kev"])}, laya={"path": str(tiny_model["laya"])})
    with session_scope() as session:
        session.add(Job(adapter="kev", requested_adapter="kev", input="Weigh option A.",
                        params={**TEXT, "max_new_tokens": new_tokens}))
    return Engine(load_model(settings), settings)


def test_a_laya_job_claimed_during_a_kev_prefill_goes_before_its_next_pass(service_env, tiny_model, monkeypatch):
    """KEVLAYA_ENGINE__PREFILL_BETWEEN_STEPS: Kev prompts that come while rows decode are prefilled one pass (here 16
    padded tokens) between two steps; a Laya job claimed meanwhile is prefilled whole before the next pass, so it
    waits for one pass, not for the whole Kev prefill."""
    engine = _engine_with_a_kev_job(tiny_model, new_tokens=80)
    decoder, events = engine.decoder, []
    step, prefill, prefill_pass = decoder.step, decoder.prefill, decoder.prefill_pass

    def stepping(meanwhile=None):  # noqa: ANN001, ANN202
        events.append(("step", decoder.prefilling is not None))
        if len(events) == 3:  # Kev prompts come while the first Kev row decodes
            with session_scope() as session:
                session.add_all([Job(adapter="kev", requested_adapter="kev", params={**TEXT, "max_new_tokens": 20},
                                     input="Weigh the options " + "and their costs " * 6) for _ in range(2)])
        if decoder.prefilling is not None and not any(e[0] == "laya" for e in events):
            events.append(("laya", None))  # a Laya job comes while their prefill is under way
            with session_scope() as session:
                session.add(Job(adapter="laya", requested_adapter="laya", input="Quick: A or B?",
                                params={**TEXT, "max_new_tokens": 4}))
        return step(meanwhile)

    def whole(requests, *args):  # noqa: ANN001, ANN002, ANN202
        events.append(("whole", [r.adapter for r in requests], decoder.prefilling is not None))
        return prefill(requests, *args)

    def one_pass():  # noqa: ANN202
        events.append(("pass", [r.request.adapter for r in decoder.prefilling.rows]))
        return prefill_pass()

    monkeypatch.setattr(decoder, "step", stepping)
    monkeypatch.setattr(decoder, "prefill", whole)
    monkeypatch.setattr(decoder, "prefill_pass", one_pass)
    try:
        assert engine.drain(60) == 4
    finally:
        engine.decoder.close()
    passes = [i for i, e in enumerate(events) if e[0] == "pass"]
    assert len(passes) > 2 and all(events[i][1] == ["kev", "kev"] for i in passes)
    assert all(any(e[0] == "step" for e in events[a:b]) for a, b in zip(passes, passes[1:]))  # a step between two
    laya = next(e for e in events if e[0] == "whole" and e[1] == ["laya"])
    assert laya[2], events  # prefilled while the Kev prompts' prefill was under way
    assert events.index(laya) < passes[-1]
    with session_scope() as session:
        assert {j.status for j in session.scalars(select(Job)).all()} == {"succeeded"}


@pytest.mark.parametrize("where", ["pass", "step"])
def test_out_of_memory_beside_a_prefill_between_steps_puts_its_jobs_back_and_each_still_runs_once(
        service_env, tiny_model, monkeypatch, where):  # noqa: ANN001
    """CUDA's out-of-memory error in a pass of a prefill under way gives its jobs back to the queue (no attempt
    counted) and the decoder admits no more rows than were decoding; in a step, the prefill under way goes back
    with the newest rows (it would join a step that no longer fits). Every job ends succeeded, once."""
    import torch

    engine = _engine_with_a_kev_job(tiny_model, new_tokens=40)
    step, fired, came = engine.decoder.step, [], []

    def stepping(meanwhile=None):  # noqa: ANN001, ANN202
        if not came:  # two Kev jobs come while the first decodes
            came.append(True)
            with session_scope() as session:
                session.add_all([Job(adapter="kev", requested_adapter="kev", input=f"Weigh option {c} at length.",
                                     params={**TEXT, "max_new_tokens": 8}) for c in "BC"])
        return step(meanwhile)

    def out_of_memory(module, args):  # noqa: ANN001, ANN202
        # in a step, twice: a step launched ahead that fails runs once more before the error counts
        columns, times = args[0].shape[1], 1 if where == "pass" else 2
        if engine.decoder.prefilling and len(fired) < times and (columns > 1) == (where == "pass"):
            fired.append(True)
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (injected by the test)")

    monkeypatch.setattr(engine.decoder, "step", stepping)
    handle = engine.loaded.model.get_input_embeddings().register_forward_pre_hook(out_of_memory)
    try:
        claims = engine.drain(60)
    finally:
        handle.remove()
        engine.decoder.close()
    assert fired and engine.decoder.limit == 1 and engine.decoder.prefilling is None
    assert claims == (5 if where == "pass" else 6)  # the prefill's two jobs (and the row in a step) claimed again
    with session_scope() as session:
        stored = session.scalars(select(Job)).all()
    assert sorted((j.status, j.attempts, j.completion_tokens) for j in stored) == [("succeeded", 1, 8)] * 2 + [
        ("succeeded", 1, 40)]


def test_the_engines_writes_take_turns_with_other_writers_on_sqlite(service_env, tiny_model):
    """SQLite takes one writer at a time, and its busy handler makes the others retry after sleeps of up to 100 ms:
    a claim inside a decode step that found the database locked held every row in flight that long. With the busy
    handler off (a writer that finds the database locked fails at once) and another writer of this process holding
    the write lock most of the time, the engine's claims, result stores and group closes all succeed: they queue on
    the writer lock that hands over at once (shared/db.py: write_scope)."""
    import threading

    from sqlalchemy import text

    from shared import db

    if not sqlite_writers_fail_when_locked():
        return
    engine = _engine_with_jobs(tiny_model, 12)
    stop, holds = threading.Event(), []

    def hold() -> None:  # the write lock held 20 ms of every 25
        while not stop.is_set():
            with db.write_scope() as session:
                session.execute(text("CREATE TABLE IF NOT EXISTS held (at REAL)"))
                session.execute(text("INSERT INTO held VALUES (:at)"), {"at": time.monotonic()})
                time.sleep(0.02)
            holds.append(1)
            time.sleep(0.005)

    holder = threading.Thread(target=hold, name="lock-holder")
    holder.start()
    try:
        assert engine.drain(120) == 12
        engine.writer.wait()
    finally:
        stop.set()
        holder.join(10)
        engine.decoder.close()
    assert len(holds) > 10
    with session_scope() as session:
        assert {j.status for j in session.scalars(select(Job))} == {"succeeded"}
        assert session.scalar(select(func.count()).select_from(ClaimGroup).where(ClaimGroup.finished_at.is_(None))) == 0


def test_a_laya_job_is_looked_for_at_every_step_while_its_reserved_slot_stands_unused(service_env, tiny_model,
                                                                                      monkeypatch):
    """A look at the queue that finds nothing waits IDLE_POLL_S before the next one, except while a reserved slot
    stands unused: a Laya job that comes while Kev rows decode is claimed at the next step, not a poll interval
    later (here one hour, so only the rule can claim it before the Kev rows end)."""
    from shared.settings import Settings
    from worker.engine import loop, scheduler
    from worker.model.loading import load_model

    monkeypatch.setattr(scheduler, "IDLE_POLL_S", 3600.0)
    settings = Settings(_env_file=None, model={"base": str(tiny_model["base"]), "device": "cpu"},
                        engine={"max_batch": 4, "ignore_eos": True}, kev={"path": str(tiny_model["kev"])},
                        laya={"path": str(tiny_model["laya"])})
    with session_scope() as session:
        session.add_all([Job(adapter="kev", requested_adapter="kev", input=f"Weigh option {i}.",
                             params={**TEXT, "max_new_tokens": 60}) for i in range(2)])
    engine = loop.Engine(load_model(settings), settings)
    assert engine.scheduler.reserved(engine.decoder.limit) == {"laya": 1}
    steps, step = [], engine.decoder.step

    def stepping(meanwhile=None):  # noqa: ANN001, ANN202
        steps.append(sorted(engine.decoder.adapters[row.adapter] for row in engine.decoder.rows))
        if len(steps) == 5:  # the Kev rows decode and every look so far found nothing new
            with session_scope() as session:
                session.add(Job(adapter="laya", requested_adapter="laya", input="Quick: A or B?",
                                params={**TEXT, "max_new_tokens": 4}))
        return step(meanwhile)

    monkeypatch.setattr(engine.decoder, "step", stepping)
    try:
        assert engine.drain(60) == 3
    finally:
        engine.decoder.close()
    joined = next(i for i, adapters in enumerate(steps) if "laya" in adapters)
    assert joined == 5, steps[:10]  # the look inside the step it came in claimed it; it decodes from the next
    with session_scope() as session:
        assert {j.status for j in session.scalars(select(Job)).all()} == {"succeeded"}
