"""Live job streams: the worker's token publisher, `GET /v1/jobs/{id}/events` and `stream=True` chat completions,
through a real API, worker and Redis."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator

import httpx
import pytest
from openai import OpenAI

from tests.conftest import AUTH, start_worker, submit, wait_until

SLOW = {"KEVLAYA_IGNORE_EOS": "true"}  # every job writes all its max_new_tokens: long enough to watch


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


def follow(api: httpx.Client, job_id: str, last_event_id: str | None = None, stop_after: int | None = None
           ) -> list[dict]:
    """Every event of the job's stream until `done` (or after `stop_after` events), as a client sees them."""
    headers = {"Last-Event-ID": last_event_id} if last_event_id else {}
    seen = []
    with api.stream("GET", f"/v1/jobs/{job_id}/events", headers=headers, timeout=60) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        for event in sse_events(response):
            if "comment" in event or "event" not in event:
                continue
            seen.append(event)
            if event["event"] == "done" or (stop_after is not None and len(seen) >= stop_after):
                break
    return seen


def streamed_text(events: list[dict]) -> str:
    """The text a client builds: deltas appended, a `running` status restarting it."""
    text = ""
    for event in events:
        if event["event"] == "status" and event["data"]["status"] == "running":
            text = ""
        elif event["event"] == "delta":
            text += event["data"]["text"]
    return text


@pytest.mark.integration
@pytest.mark.parametrize("env", [SLOW], indirect=True)
def test_a_client_watches_the_text_grow_and_ends_with_the_stored_job(env, api, start_process):
    start_worker(start_process, env, api)
    job_id = submit(api, "kev", "Options: A cost 10; B cost 20. Objective: lowest cost.", max_new_tokens=300)
    events = follow(api, job_id)
    kinds = [e["event"] for e in events]
    assert kinds[0] == "status" and kinds[-1] == "done" and kinds.count("done") == 1
    deltas = [e for e in events if e["event"] == "delta"]
    assert len(deltas) > 3  # the text came in pieces, as it was written
    counts = [d["data"]["tokens"] for d in deltas]
    assert counts == sorted(counts) and counts[-1] == 300
    stored = api.get(f"/v1/jobs/{job_id}").json()
    assert events[-1]["data"] == stored  # the stored job, exactly as GET returns it
    assert streamed_text(events) == stored["result"]["text"]
    ids = [e["id"] for e in events if "id" in e]
    assert len(ids) == len(set(ids)) == len(deltas) + kinds[1:].count("status")
    # connecting after the end: `done` at once
    assert [e["event"] for e in follow(api, job_id)] == ["done"]


@pytest.mark.integration
@pytest.mark.parametrize("env", [SLOW], indirect=True)
def test_last_event_id_resumes_with_no_gap_and_no_repeat(env, api, start_process):
    start_worker(start_process, env, api)
    job_id = submit(api, "kev", "Options: A cost 10; B cost 20. Objective: lowest cost.", max_new_tokens=800)
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
    client = OpenAI(base_url=f"http://127.0.0.1:{env['KEVLAYA_API_PORT']}/v1", api_key=env["KEVLAYA_API_KEY"],
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
    job_id = submit(api, "kev", "Options: A cost 10; B cost 20. Objective: lowest cost.", max_new_tokens=400)
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
