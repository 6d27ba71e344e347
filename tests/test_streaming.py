"""Live job streams: the worker's token publisher, `GET /v1/jobs/{id}/events` and `stream=True` chat completions,
through a real API, worker and Redis."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator

import httpx
import pytest
from openai import OpenAI

from modellab.bench.sse import streamed_text
from shared.settings import DEMO_MODEL_DIR
from tests.conftest import AUTH, start_worker, submit, wait_finished, wait_until

# The shipped demo model writes text (random weights write bytes that are not UTF-8, whose rows stream nothing until
# their stored text comes whole), and with end-of-sequence ignored every job writes all its max_new_tokens: long
# enough to watch.
SLOW = {"KEVLAYA_ENGINE__IGNORE_EOS": "true", "KEVLAYA_MODEL__BASE": str(DEMO_MODEL_DIR / "base"),
        "KEVLAYA_KEV__PATH": str(DEMO_MODEL_DIR / "kev"), "KEVLAYA_LAYA__PATH": str(DEMO_MODEL_DIR / "laya")}


def sse_events(response: httpx.Response) -> Iterator[dict]:
    """Parsed Server-Sent Events of a streamed response: {"id", "event", "data"}; comments as {"comment"}."""
    event: dict = {}
    for line in response.iter_lines():
        if not line:
            if event:
                yield event
            event = {}
        elif line.startswith(":"):
            yield {"comment": line[1:].strip()}
        else:
            name, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            if name == "data":
                event["data"] = json.loads(value) if value != "[DONE]" else value
            else:
                event[name] = value


def follow(api: httpx.Client, job_id: str, last_event_id: str | None = None, stop_after: int | None = None,
           into: list[dict] | None = None) -> list[dict]:
    """Every event of the job's stream until `done` (or after `stop_after` events), as a client sees them; each
    is also appended to `into` as it comes."""
    headers = {"Last-Event-ID": last_event_id} if last_event_id else {}
    seen = []
    with api.stream("GET", f"/v1/jobs/{job_id}/events", headers=headers, timeout=60) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        for event in sse_events(response):
            if "comment" in event or "event" not in event:
                continue
            seen.append(event)
            if into is not None:
                into.append(event)
            if event["event"] == "done" or (stop_after is not None and len(seen) >= stop_after):
                break
    return seen


@pytest.mark.integration
@pytest.mark.parametrize("env", [SLOW], indirect=True)
def test_a_client_watches_the_text_grow_and_ends_with_the_stored_job(env, api, start_process):
    start_worker(start_process, env, api)
    job_id = submit(api, "kev", "Options: A cost 10; B cost 20. Objective: lowest cost.", max_new_tokens=200)
    events = follow(api, job_id)
    kinds = [e["event"] for e in events]
    assert kinds[0] == "status" and kinds[-1] == "done" and kinds.count("done") == 1
    deltas = [e for e in events if e["event"] == "delta"]
    assert len(deltas) > 3  # the text came in pieces, as it was written
    counts = [d["data"]["tokens"] for d in deltas]
    assert counts == sorted(counts) and counts[-1] == 200
    stored = api.get(f"/v1/jobs/{job_id}").json()
    assert events[-1]["data"] == stored  # the stored job, exactly as GET returns it
    assert streamed_text(events) == stored["result"]["text"]
    ids = [e["id"] for e in events if "id" in e]
    assert len(ids) == len(set(ids)) == len(deltas) + kinds[1:].count("status")
    # connecting after the end: `done` at once
    assert [e["event"] for e in follow(api, job_id)] == ["done"]


@pytest.mark.integration
@pytest.mark.parametrize("env", [SLOW], indirect=True)
def test_a_client_that_reconnects_after_its_job_ended_gets_the_rest_of_the_text(env, api, start_process):
    """The job ends while its client is away: reconnecting with Last-Event-ID brings the deltas it missed, then
    `done`, never `done` alone (its text would stop where the connection dropped)."""
    start_worker(start_process, env, api)
    job_id = submit(api, "kev", "Options: A cost 10; B cost 20. Objective: lowest cost.", max_new_tokens=120)
    first = follow(api, job_id, stop_after=3)
    assert first[-1]["event"] == "delta"
    [stored] = wait_finished(api, [job_id])
    rest = follow(api, job_id, first[-1]["id"])
    assert rest[-1]["event"] == "done" and any(e["event"] == "delta" for e in rest)
    assert streamed_text(first + rest) == stored["result"]["text"]


@pytest.mark.integration
@pytest.mark.parametrize("env", [SLOW], indirect=True)
def test_last_event_id_resumes_with_no_gap_and_no_repeat(env, api, start_process):
    start_worker(start_process, env, api)
    job_id = submit(api, "kev", "Options: A cost 10; B cost 20. Objective: lowest cost.", max_new_tokens=500)
    first = []
    while True:  # reconnect every few events, from the last one seen, as a browser after a dropped connection
        part = follow(api, job_id, first[-1]["id"] if first else None, stop_after=3)
        first += part
        if part[-1]["event"] == "done":
            break
    resumed = sum(1 for e in first if e["event"] != "done") > 6
    assert resumed
    ids = [e["id"] for e in first if "id" in e]
    assert len(ids) == len(set(ids))  # no repeat
    stored = first[-1]["data"]
    assert streamed_text(first) == stored["result"]["text"]  # no gap
    bad = api.get(f"/v1/jobs/{job_id}/events", headers={"Last-Event-ID": "yesterday"})
    assert bad.status_code == 422 and "last-event-id" in bad.json()["error"]["message"]
    assert api.get("/v1/jobs/00000000-0000-0000-0000-000000000000/events").status_code == 404


@pytest.mark.integration
def test_the_official_openai_client_streams_each_model(env, api, start_process):
    start_worker(start_process, env, api)
    client = OpenAI(base_url=f"http://127.0.0.1:{env['KEVLAYA_API__PORT']}/v1", api_key=env["KEVLAYA_API__KEY"],
                    max_retries=0, timeout=60)
    messages = [{"role": "user", "content": "Options: A cost 10; B cost 20. Objective: lowest cost."}]
    for model in ("kev", "laya", "auto"):
        chunks = list(client.chat.completions.create(model=model, messages=messages, max_completion_tokens=40,
                                                     temperature=0, stream=True,
                                                     stream_options={"include_usage": True}))
        assert all(c.object == "chat.completion.chunk" and c.model == model for c in chunks)
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert len(finish) == 1 and finish[0] in ("stop", "length")
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= 1
        whole = client.chat.completions.create(model=model, messages=messages, max_completion_tokens=40,
                                               temperature=0)
        assert text == whole.choices[0].message.content  # greedy: the same answer, streamed or not
    with pytest.raises(Exception) as refused:
        client.chat.completions.create(model="kev", messages=messages, stream_options={"include_usage": True})
    assert refused.value.status_code == 422 and "stream_options" in str(refused.value)


@pytest.mark.integration
@pytest.mark.parametrize("env", [SLOW], indirect=True)
def test_many_clients_each_get_every_event_once(env, api, start_process):
    start_worker(start_process, env, api)
    job_id = submit(api, "kev", "Options: A cost 10; B cost 20. Objective: lowest cost.", max_new_tokens=200)
    results: list[list[dict]] = []

    def one() -> None:
        with httpx.Client(base_url=str(api.base_url), headers=AUTH, timeout=60) as own:
            results.append(follow(own, job_id))

    threads = [threading.Thread(target=one) for _ in range(20)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(90)
    assert len(results) == 20
    stored = api.get(f"/v1/jobs/{job_id}").json()
    for events in results:
        ids = [e["id"] for e in events if "id" in e]
        assert len(ids) == len(set(ids))
        assert streamed_text(events) == stored["result"]["text"] and events[-1]["data"] == stored
    wait_until(lambda: True, 1)


# -- faults: the stream outlives the worker, the API and Redis -------------------------------------------------
# On SQLite only: what these tests break is the stream's path (worker, API, Redis); the database's own faults are
# tests/test_faults.py's, on both databases.

class Watcher:
    """A client following a job's events on a thread, reconnecting from its last event id when cut off."""

    def __init__(self, base_url: str, job_id: str):
        self.base_url, self.job_id, self.events = base_url, job_id, []
        self.reconnects, self.errors = 0, []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.events or self.events[-1]["event"] != "done":
            last = next((e["id"] for e in reversed(self.events) if "id" in e), None)
            try:
                with httpx.Client(base_url=self.base_url, headers=AUTH, timeout=30) as own:
                    follow(own, self.job_id, last, into=self.events)
            except (httpx.TransportError, AssertionError) as exc:
                self.errors.append(repr(exc))
                self.reconnects += 1
                threading.Event().wait(0.2)

    def deltas(self) -> int:
        return sum(e["event"] == "delta" for e in self.events)

    def finish(self, timeout: float = 240) -> list[dict]:
        self.thread.join(timeout)
        assert self.events and self.events[-1]["event"] == "done", self.events[-3:]
        return self.events


LONG = "Options: A cost 10; B cost 20. Objective: lowest cost."


@pytest.mark.faults
@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
@pytest.mark.parametrize("env", [SLOW], indirect=True)
def test_worker_killed_mid_stream_the_client_sees_the_restart_and_the_stored_text(env, api, start_process):
    worker = start_worker(start_process, env, api)
    job_id = submit(api, "kev", LONG, max_new_tokens=500)
    watcher = Watcher(str(api.base_url), job_id)
    wait_until(lambda: watcher.deltas() > 5, 120, interval=0.05, what="the text to start streaming")
    worker.kill(9)
    start_worker(start_process, env, api)
    events = watcher.finish()
    stored = events[-1]["data"]
    assert stored["status"] == "succeeded" and stored["attempts"] == 2
    runs = [e["data"]["attempt"] for e in events if e["event"] == "status" and e["data"]["status"] == "running"]
    assert runs[-1] == 2 and 1 in runs  # the client was told the text restarts
    assert streamed_text(events) == stored["result"]["text"]


@pytest.mark.faults
@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
@pytest.mark.parametrize("env", [SLOW], indirect=True)
def test_api_restarted_mid_stream_the_client_resumes_with_last_event_id(env, start_process):
    from tests.conftest import start_api

    api = start_api(start_process, env)
    start_worker(start_process, env, api)
    job_id = submit(api, "kev", LONG, max_new_tokens=500)
    watcher = Watcher(str(api.base_url), job_id)
    wait_until(lambda: watcher.deltas() > 5, 120, interval=0.05, what="the text to start streaming")
    start_process.started[0].kill(9)  # the API process, with the client's connection
    api = start_api(start_process, env)  # the same port
    events = watcher.finish()
    assert watcher.reconnects >= 1 or len(start_process.started) > 2
    ids = [e["id"] for e in events if "id" in e]
    assert len(ids) == len(set(ids))  # resumed, not replayed
    assert streamed_text(events) == events[-1]["data"]["result"]["text"] == api.get(
        f"/v1/jobs/{job_id}").json()["result"]["text"]
    api.close()


@pytest.mark.faults
@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
@pytest.mark.parametrize("env", [SLOW], indirect=True)
@pytest.mark.parametrize("outage", ["2s", "until-the-job-ended"])
def test_redis_restarted_mid_stream_clients_resynchronise_and_lose_nothing(env, start_process, tmp_path,
                                                                           monkeypatch, outage):
    """Redis restarts empty while three clients follow a job: for 2 s (the job goes on after), or until the job
    has ended (its last text and its finished notice never reach Redis)."""
    from tests.conftest import RedisServer, reset_process_state, start_api

    own = RedisServer(tmp_path / "own-redis")  # without its data: the streams are gone when it is back
    own.start()
    try:
        env = {**env, "KEVLAYA_REDIS__URL": own.url}
        monkeypatch.setenv("KEVLAYA_REDIS__URL", own.url)
        reset_process_state()
        api = start_api(start_process, env)
        start_worker(start_process, env, api)
        job_id = submit(api, "kev", LONG, max_new_tokens=500)
        watchers = [Watcher(str(api.base_url), job_id) for _ in range(3)]
        wait_until(lambda: all(w.deltas() > 5 for w in watchers), 120, interval=0.05, what="the text to stream")
        own.stop()
        if outage == "2s":
            threading.Event().wait(2)
        else:
            wait_until(lambda: api.get(f"/v1/jobs/{job_id}").json()["status"] == "succeeded", 120, interval=0.1,
                       what="the job to end")
        own.start()
        for watcher in watchers:
            events = watcher.finish()
            stored = events[-1]["data"]
            assert stored["status"] == "succeeded"
            assert streamed_text(events) == stored["result"]["text"]
        api.close()
    finally:
        own.stop()


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
@pytest.mark.parametrize("env", [SLOW], indirect=True)
def test_the_status_page_shows_a_running_jobs_text_growing_as_characters(env, api, start_process):
    from tests.test_observability import chromium

    browser_path = chromium()
    if browser_path is None:
        pytest.skip("no Chromium: install Debian's (`apt-get install chromium`) or set KEVLAYA_TEST_CHROMIUM")
    from playwright.sync_api import expect, sync_playwright

    start_worker(start_process, env, api)
    # The schema makes the model write markup (and, with end-of-sequence ignored, write it again and again).
    markup = "<img src=x onerror=document.title='hacked'><script>document.title='hacked'</script>"
    schema = {"type": "object", "properties": {"x": {"const": markup}}, "required": ["x"],
              "additionalProperties": False}
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=browser_path, args=["--no-sandbox"])
        page = browser.new_page()
        page.goto(f"{api.base_url}/status")
        page.fill("#key", env["KEVLAYA_API__KEY"])
        page.click("#login button[type=submit]")
        page.wait_for_selector("body[data-loaded=true]", timeout=30000)  # logged in and polling
        # Submitted once the page watches (a browser takes longer to start than the job to run), beside four other
        # rows that slow each step: alone on an idle machine it could end before the page's 3-second look for
        # running jobs saw it.
        for _ in range(4):
            submit(api, "kev", LONG, max_new_tokens=900)
        job_id = submit(api, "kev", LONG, max_new_tokens=900,
                        response_format={"type": "json_schema", "json_schema": {"name": "m", "schema": schema}})
        box = page.locator(f"#running [data-job='{job_id}']")
        expect(box.locator("pre")).to_contain_text("<script>", timeout=30000)
        first = int(box.get_attribute("data-tokens"))
        # it grows while the job runs (polled from here: the page's policy allows no evaluated script)
        wait_until(lambda: int(box.get_attribute("data-tokens")) > first, 30, interval=0.05, what="the text to grow")
        expect(box).to_have_attribute("data-status", "succeeded", timeout=180000)
        assert markup in box.locator("pre").inner_text()
        assert page.locator("#running img, #running script").count() == 0  # characters, never elements
        assert page.title() != "hacked"
        browser.close()
    assert markup in api.get(f"/v1/jobs/{job_id}").json()["result"]["text"]


def live_job(stop: tuple[str, ...] = ()):  # noqa: ANN201
    import uuid

    from worker.engine.token_stream import LiveJob

    return LiveJob(uuid.uuid4(), ("k",), 1, None, stop)


def test_text_that_may_begin_a_stop_string_is_held_back_and_the_stop_string_never_published():
    live = live_job(("\n\nEND",))
    pieces = ["Kev: A", " wins\n", "\nE", "N", "D more"]  # the stop string spans three pieces
    published = [live.take(p) for p in pieces]
    assert published == ["Kev: A", " wins", "", "", ""]
    assert "".join(published) == "Kev: A wins"
    live = live_job(("\n\nEND",))
    assert [live.take(p) for p in ["a\n", "\nx", "y"]] == ["a", "\n\nx", "y"]  # a false start is released


def test_a_piece_that_is_not_utf8_stops_the_live_text_until_the_stored_text():
    live = live_job()
    assert live.take("ok ") == "ok "
    assert live.take("\ufffd") == "" and live.take("more") == ""  # decoders count replacements differently
    nul = live_job()
    assert nul.take("a\x00b") == "a\ufffdb"  # NUL as the stored text has it (PostgreSQL refuses NUL)


@pytest.mark.integration
def test_steps_in_quick_succession_are_published_together_and_a_finished_job_at_once(redis_server, monkeypatch):
    """The publisher's work holds the interpreter's lock the decode loop launches steps with: new tokens go out at
    most every `streams.interval_ms`, one entry for all the steps since; the text is whole all the same, and a
    finished job's text does not wait for the interval (its result is committed only once the stream holds it)."""
    import time
    import uuid
    from types import SimpleNamespace

    import redis as sync_redis

    from shared.job_stream import read_entry, stream_key
    from shared.models import Job
    from shared.settings import Settings
    from tests.conftest import reset_process_state
    from worker.engine.token_stream import TokenPublisher

    monkeypatch.setenv("KEVLAYA_REDIS__URL", redis_server.url)
    reset_process_state()
    job = Job(id=uuid.uuid4(), adapter="kev", requested_adapter="kev", input="x", params={}, attempts=1)
    row = SimpleNamespace(request=SimpleNamespace(job_id=job.id), tokens=[], first_token_at=None)
    publisher = TokenPublisher(Settings(_env_file=None, streams={"interval_ms": 300}), lambda: [row],
                               lambda token: bytes([token]))
    publisher.started([job])
    text = "twenty steps of text"
    for character in text.encode():  # a step every 10 ms: 200 ms in all
        row.tokens.append(character)
        publisher.tick()
        time.sleep(0.01)
    started = time.monotonic()
    publisher.finish([(job.id, text, len(text), None)])
    assert time.monotonic() - started < 0.2
    entries = [read_entry(fields) for _id, fields in sync_redis.Redis.from_url(redis_server.url).xrange(
        stream_key(job.id))]
    deltas = [data["text"] for event, data in entries if event == "delta"]
    assert "".join(deltas) == text
    assert len(deltas) <= 3  # the first step's text, the rest after the interval, the finished tail


@pytest.mark.integration
def test_a_job_that_ends_before_its_tokens_were_published_still_marks_its_first_text(redis_server, monkeypatch):
    """A short answer can end within one publishing interval: its row is gone before the publisher looks, and its
    first text goes out with the finished job's. That delta still carries when its first token was made (the
    bench's first-delta delay read none there on a loaded machine)."""
    import time
    import uuid

    import redis as sync_redis

    from shared.job_stream import FIRST_TOKEN_AT, stream_key
    from shared.models import Job
    from shared.settings import Settings
    from tests.conftest import reset_process_state
    from worker.engine.token_stream import TokenPublisher

    monkeypatch.setenv("KEVLAYA_REDIS__URL", redis_server.url)
    reset_process_state()
    job = Job(id=uuid.uuid4(), adapter="laya", requested_adapter="laya", input="x", params={}, attempts=1)
    publisher = TokenPublisher(Settings(_env_file=None), lambda: [], lambda token: bytes([token]))
    publisher.started([job])
    made, made_wall = time.perf_counter() - 0.05, time.time() - 0.05  # its first token, 50 ms ago
    publisher.finish([(job.id, "short", 5, made)])
    deltas = [fields for _id, fields in sync_redis.Redis.from_url(redis_server.url).xrange(stream_key(job.id))
              if FIRST_TOKEN_AT.encode() in fields]
    assert len(deltas) == 1
    assert abs(float(deltas[0][FIRST_TOKEN_AT.encode()]) - made_wall) < 0.04  # read then, not after the stream


@pytest.mark.integration
def test_hundreds_of_followers_catching_up_at_once_all_read_the_stream(redis_server, monkeypatch):
    """Every follower starts behind and reads what came before itself: 300 at once wait for a connection of the
    pool rather than fail (redis-py's own pool refused the 101st: "Too many connections")."""
    import asyncio
    import uuid

    import redis as sync_redis

    import api.streams.follow as job_events
    from shared.job_stream import entry, stream_key
    from tests.conftest import reset_process_state

    monkeypatch.setenv("KEVLAYA_REDIS__URL", redis_server.url)
    reset_process_state()
    job_id = uuid.uuid4()
    writer = sync_redis.Redis.from_url(redis_server.url)
    for i in range(5):
        writer.xadd(stream_key(job_id), entry("delta", text=f"{i},", tokens=i + 1))

    async def catch_up(follower: job_events.Follower, client) -> list:  # noqa: ANN001
        # As follow_job does, a read that timed out is tried again (a loaded machine can starve the Redis server
        # past a connect timeout); a refused connection is not, and fails the test.
        for _ in range(5):
            try:
                return await follower.events(client, 0.1)
            except sync_redis.exceptions.TimeoutError:
                await asyncio.sleep(0.5)
        return await follower.events(client, 0.1)

    async def main() -> list:
        reader = job_events.StreamReader()
        client = reader.client()
        followers = [job_events.Follower(job_id, "0") for _ in range(300)]
        try:
            return await asyncio.gather(*(catch_up(f, client) for f in followers), return_exceptions=True)
        finally:
            await reader.close()

    results = asyncio.run(main())
    assert [r for r in results if not isinstance(r, list)] == []
    assert all("".join(e.data["text"] for e in r) == "0,1,2,3,4," for r in results)


@pytest.mark.integration
def test_a_job_followed_while_the_reader_waits_gets_its_first_entry_at_once(redis_server, monkeypatch):
    """The reader's blocking XREAD names the streams followed when it began: a job followed meanwhile is read
    from the next one on. The reader is woken for it, instead of its first text waiting out the block (the
    benchmark's first-delta p95 was the reader's 100 ms block)."""
    import asyncio
    import time
    import uuid

    import redis as sync_redis

    import api.streams.follow as job_events
    from shared.job_stream import entry, stream_key
    from tests.conftest import reset_process_state

    monkeypatch.setenv("KEVLAYA_REDIS__URL", redis_server.url)
    monkeypatch.setattr(job_events, "BLOCK_MS", 8_000)
    reset_process_state()
    writer = sync_redis.Redis.from_url(redis_server.url)
    first, second = uuid.uuid4(), uuid.uuid4()

    async def main() -> tuple[list, float]:
        reader = job_events.StreamReader()
        client = reader.client()
        try:
            with reader.follow(first) as one:
                assert await one.events(client, 0.1) == []  # caught up: from now on the reader feeds it
                await asyncio.sleep(0.3)  # the reader waits on the first job's stream alone
                with reader.follow(second) as two:
                    assert await two.events(client, 0.1) == []
                    writer.xadd(stream_key(second), entry("delta", text="hi", tokens=1))
                    started = time.monotonic()
                    events = await two.events(client, 15.0)
                    return events, time.monotonic() - started
        finally:
            await reader.close()

    events, waited = asyncio.run(main())
    assert [e.data["text"] for e in events] == ["hi"]
    assert waited < 4.0  # not the rest of the reader's 8 s block


@pytest.mark.integration
def test_a_follower_woken_while_its_job_runs_and_the_stream_is_unreadable_does_not_end(redis_server, monkeypatch):
    """The notices wake every follower when they (re)subscribe, whether its job ended or not. A follower so woken
    whose stream read then fails goes on following while the row says the job runs, and ends only with the
    finished job."""
    import asyncio
    import contextlib
    import uuid
    from types import SimpleNamespace

    import api.streams.follow as job_events
    from shared.models import JobStatus
    from tests.conftest import reset_process_state

    monkeypatch.setenv("KEVLAYA_REDIS__URL", redis_server.url)
    reset_process_state()
    reads = []

    async def read_job():  # the row: running for its first three reads
        reads.append(1)
        return SimpleNamespace(id=job_id, status=JobStatus.RUNNING if len(reads) <= 3 else JobStatus.SUCCEEDED)

    async def unreadable(client, job, position):  # noqa: ANN001, ANN202
        raise ConnectionError("Too many connections")

    class WakeAtOnce:  # a (re)subscribe wakes the follower as soon as it follows
        @staticmethod
        @contextlib.contextmanager
        def watch(job_id, waiter):  # noqa: ANN001, ANN205
            waiter.set()
            yield waiter

        @staticmethod
        async def subscribed(timeout_s):  # noqa: ANN001, ANN205
            return None

    monkeypatch.setattr(job_events, "notices", WakeAtOnce)
    monkeypatch.setattr(job_events, "read_after", unreadable)
    job_id = uuid.uuid4()

    monkeypatch.setattr(job_events.reader, "_ensure_reading", lambda: None)

    async def main() -> list:
        out = [item async for item in job_events.follow_job(SimpleNamespace(id=job_id, status=JobStatus.RUNNING),
                                                            read_job, "0", 0.01)]
        await job_events.reader.close()
        return out

    items = asyncio.run(main())
    ends = [item for item in items if isinstance(item, SimpleNamespace)]
    assert [end.status for end in ends] == [JobStatus.SUCCEEDED]  # one end, the finished job
    assert isinstance(items[-2], job_events.Gap)  # its text is the stored one


@pytest.mark.integration
def test_a_follower_whose_queue_fills_while_it_reads_loses_nothing(redis_server, monkeypatch):
    """Regression: the reader drops what a full queue cannot take and marks the follower behind; a catch-up read
    that was in flight meanwhile must leave it behind, so it reads the dropped entries from the stream."""
    import asyncio
    import contextlib
    import uuid

    import redis as sync_redis

    import api.streams.follow as job_events
    from shared.job_stream import entry, stream_key
    from tests.conftest import reset_process_state

    monkeypatch.setenv("KEVLAYA_REDIS__URL", redis_server.url)
    reset_process_state()
    job_id = uuid.uuid4()
    writer = sync_redis.Redis.from_url(redis_server.url)
    for i in range(5):
        writer.xadd(stream_key(job_id), entry("delta", text=f"{i},", tokens=i + 1))
    reader = job_events.StreamReader()
    reader._ensure_reading = lambda: None  # this test hands the entries out itself, at the worst moment

    class NoNotices:  # nor does any "finished" notice (whose wake-up also reads the stream) come
        @staticmethod
        def watch(job_id, waiter):  # noqa: ANN001, ANN205
            return contextlib.nullcontext(waiter)

    monkeypatch.setattr(job_events, "notices", NoNotices)
    flood = job_events.QUEUE_EVENTS + 50
    real_read = job_events.read_after

    async def read_while_the_stream_grows(client, job, position):  # noqa: ANN001, ANN202
        rows = await real_read(client, job, position)
        # while this read was in flight, many more entries came and the reader handed them out
        ids = [writer.xadd(stream_key(job_id), entry("delta", text=f"{i},", tokens=i + 1)) for i in range(5, 5 + flood)]
        fresh = await client.xrange(stream_key(job_id), min=ids[0], max=ids[-1])
        await reader._hand_out(stream_key(job_id), [job_events._event(i, f) for i, f in fresh])
        return rows

    monkeypatch.setattr(job_events, "read_after", read_while_the_stream_grows)

    async def main() -> str:
        with reader.follow(job_id, "0") as follower:
            text = ""
            client = reader.client()
            for _ in range(5):
                for event in await follower.events(client, 0.1):
                    text += event.data["text"]
                monkeypatch.setattr(job_events, "read_after", real_read)
        await reader.close()
        return text

    text = asyncio.run(main())
    assert text == "".join(f"{i}," for i in range(5 + flood))


@pytest.fixture
def quick_chat(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KEVLAYA_LIMITS__CHAT_TIMEOUT_S", "0.3")  # read when `client` builds the app


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_a_streamed_chat_that_outlasts_its_timeout_ends_with_an_error_event_in_time(quick_chat, client):
    import time

    started = time.monotonic()
    response = client.post("/v1/chat/completions", headers=AUTH, json={
        "model": "kev", "stream": True, "messages": [{"role": "user", "content": "A or B?"}]})  # no worker runs
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    events = [json.loads(line[6:]) if line != "data: [DONE]" else "[DONE]"
              for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert events[-2]["error"]["code"] == "timeout" and events[-1] == "[DONE]"
    assert time.monotonic() - started < 5


@pytest.mark.parametrize("case", ["short", "whole", "resumed"])
def test_a_stream_that_ends_short_of_the_stored_text_tells_the_client_before_done(monkeypatch, case):
    """The worker waits a second at most for its last text to reach Redis before it stores the job; a client whose
    stream ended short of the stored text gets `resync` before `done`, and its text is the stored one. Seen under
    load: the last delta arrived after `done`. A resumed client's text is not known to the API: no resync."""
    import asyncio
    import json
    import uuid
    from types import SimpleNamespace

    from api.jobs import events as job_events
    from api.streams.follow import StreamEvent
    from modellab.bench.sse import SseParser
    from shared.models import JobStatus

    job_id, stored = uuid.uuid4(), "Option A: cheaper, feasible"
    streamed = stored if case == "whole" else stored[:-len(" feasible")]

    class Job(SimpleNamespace):
        def model_dump(self, mode: str) -> dict:  # noqa: ARG002
            return {"id": str(self.id), "status": self.status, "result": {"text": self.result.text}}

    def event(n: int, name: str, **data) -> StreamEvent:  # noqa: ANN003
        return StreamEvent(f"1-{n}", name, data, json.dumps(data))

    async def follow(job, read_job, position, heartbeat_s):  # noqa: ANN001, ANN202, ARG001
        if case == "resumed":  # after the client's last event: the text it built before is not known here
            yield [event(3, "delta", text=" feasible", tokens=6)]
        else:
            yield [event(1, "status", status="running", attempt=1), event(2, "delta", text=streamed, tokens=5)]
        yield Job(id=job_id, status=JobStatus.SUCCEEDED, result=SimpleNamespace(text=stored))

    monkeypatch.setattr(job_events, "follow_job", follow)
    running = Job(id=job_id, status=JobStatus.RUNNING, result=None, attempts=1)
    response = job_events.job_event_stream(None, running, "1-0" if case == "resumed" else None,
                                             SimpleNamespace(streams=SimpleNamespace(heartbeat_s=1.0)))

    async def body() -> str:
        return "".join([chunk async for chunk in response.body_iterator])

    parser = SseParser()
    events = [e for line in asyncio.run(body()).splitlines() if (e := parser.feed(line))]
    names = [e["event"] for e in events]
    assert names[-1] == "done" and ("resync" in names) == (case == "short"), names
    if case != "resumed":
        assert streamed_text(events) == stored
