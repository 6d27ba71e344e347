"""Per-key caps on requests that stay open (RELIABILITY.md, Security): one key past
`KEVLAYA_CONNECTIONS__STREAMS_PER_KEY` event streams or `KEVLAYA_CONNECTIONS__LONG_POLLS_PER_KEY` long-polls gets 429
naming the cap, another key is served, and a closed stream gives its place back. A real API process on loopback; its job
stays queued (no worker), so streams and waits stay open."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from shared.db import session_scope
from shared.keys import create_key
from tests.conftest import AUTH, free_port, start_api, wait_until

CAP = 2
pytestmark = pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)  # the database plays no part here


@pytest.fixture
def capped(service_env: dict[str, str], start_process) -> httpx.Client:  # noqa: ANN001
    env = {**service_env, "KEVLAYA_API__PORT": str(free_port()), "KEVLAYA_CONNECTIONS__STREAMS_PER_KEY": str(CAP),
           "KEVLAYA_CONNECTIONS__LONG_POLLS_PER_KEY": str(CAP)}
    client = start_api(start_process, env)
    yield client
    client.close()


def other_key() -> dict[str, str]:
    with session_scope() as session:
        _, plain = create_key(session, "other")
    return {"Authorization": f"Bearer {plain}"}


def queued_job(client: httpx.Client, headers: dict[str, str]) -> str:
    answer = client.post("/v1/jobs", headers=headers, json={"adapter": "laya", "input": "wait"})
    assert answer.status_code == 202, answer.text
    return answer.json()["id"]


def opened(client: httpx.Client, path: str, headers: dict[str, str], first_line: bool = True) -> socket.socket:
    """A request left open on its own connection; with `first_line`, once its status line has come."""
    sock = socket.create_connection((client.base_url.host, client.base_url.port), timeout=10)
    head = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n{head}\r\n".encode())
    if first_line:
        assert sock.recv(4096).startswith(b"HTTP/1.1 200"), path
    return sock


def assert_capped(answer: httpx.Response, code: str, variable: str) -> None:
    assert answer.status_code == 429, answer.text
    error = answer.json()["error"]
    assert error["code"] == code and variable in error["message"] and str(CAP) in error["message"]
    assert answer.headers["Retry-After"]


def test_a_key_over_its_stream_cap_gets_429_and_a_closed_stream_gives_its_place_back(capped):
    job = queued_job(capped, AUTH)
    held = [opened(capped, f"/v1/jobs/{job}/events", AUTH) for _ in range(CAP)]
    assert_capped(capped.get(f"/v1/jobs/{job}/events"), "too_many_streams", "KEVLAYA_CONNECTIONS__STREAMS_PER_KEY")
    chat = {"model": "laya", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    before = capped.get("/v1/jobs").json()["jobs"]
    assert_capped(capped.post("/v1/chat/completions", json=chat), "too_many_streams",
                  "KEVLAYA_CONNECTIONS__STREAMS_PER_KEY")
    assert capped.get("/v1/jobs").json()["jobs"] == before  # the refused chat stored no job

    other = other_key()
    other_job = queued_job(capped, other)
    with capped.stream("GET", f"/v1/jobs/{other_job}/events", headers=other) as stream:
        assert stream.status_code == 200  # another key is not held back

    held.pop().close()

    def a_place_again() -> bool:
        with capped.stream("GET", f"/v1/jobs/{job}/events") as stream:
            return stream.status_code == 200

    wait_until(a_place_again, 10, what="the closed stream's place to come back")
    for sock in held:
        sock.close()


def test_a_key_over_its_long_poll_cap_gets_429(capped):
    job = queued_job(capped, AUTH)
    held = [opened(capped, f"/v1/jobs/{job}/wait?timeout=30", AUTH, first_line=False) for _ in range(CAP)]
    time.sleep(0.5)  # both waits reached the server
    refused = capped.get(f"/v1/jobs/{job}/wait?timeout=30")
    assert_capped(refused, "too_many_long_polls", "KEVLAYA_CONNECTIONS__LONG_POLLS_PER_KEY")
    chat = {"model": "laya", "messages": [{"role": "user", "content": "hi"}]}
    assert_capped(capped.post("/v1/chat/completions", json=chat), "too_many_long_polls",
                  "KEVLAYA_CONNECTIONS__LONG_POLLS_PER_KEY")
    other = other_key()
    started = time.monotonic()
    answer = capped.get(f"/v1/jobs/{queued_job(capped, other)}/wait?timeout=0.2", headers=other)
    assert answer.status_code == 200 and json.loads(answer.text)["status"] == "queued"
    assert time.monotonic() - started < 5
    for sock in held:
        sock.close()
