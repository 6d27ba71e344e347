"""Failures and edges through the real app on SQLite and PostgreSQL and a real Redis: dependencies down (503
JSON with Retry-After, no internal addresses), racing idempotency keys, unexpected errors, bodies and headers
over their limits (against the real `kevlaya api` server), readiness per adapter, key revocation, 405."""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from datetime import datetime, timezone

import httpx
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import event, select
from sqlalchemy.engine import make_url

from shared.db import get_engine, new_session, session_scope
from shared.heartbeat import beat
from shared.models import ApiKey, Job
from shared.settings import get_settings
from tests.conftest import AUTH, free_port, job_count, reset_process_state, wait_until


def submit(client: TestClient, **extra):
    return client.post("/v1/jobs", json={"adapter": "laya", "input": "pick the cheapest option", **extra},
                       headers=AUTH)


def switch_to(monkeypatch: pytest.MonkeyPatch, **env: str) -> None:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    reset_process_state()


def unreachable_database(database_url: str) -> tuple[str, list[str]]:
    """A URL of the same kind whose database cannot be reached, and what its errors would reveal."""
    if database_url.startswith("sqlite"):
        return "sqlite:////nonexistent-kevlaya-dir/sub/kevlaya.db", ["nonexistent-kevlaya-dir", "kevlaya.db"]
    port = free_port()
    url = make_url(database_url).set(port=port).render_as_string(hide_password=False)
    return url, [str(port), "127.0.0.1"]


def test_database_down_is_503_json_with_retry_after_and_no_address(client, service_env, monkeypatch):
    assert submit(client).status_code == 202
    url, secrets = unreachable_database(service_env["KEVLAYA_DATABASE__URL"])
    switch_to(monkeypatch, KEVLAYA_DATABASE__URL=url)
    for response in (submit(client), client.get("/v1/jobs", headers=AUTH),
                     client.get(f"/v1/jobs/{uuid.uuid4()}", headers=AUTH)):
        assert response.status_code == 503, response.text
        assert response.headers["content-type"] == "application/json"
        assert response.json()["error"]["code"] == "database_unavailable"
        assert int(response.headers["retry-after"]) > 0
        assert not any(secret in response.text for secret in secrets), response.text
    ready = client.get("/readyz")
    assert ready.status_code == 503 and ready.json()["checks"]["database"] == "unavailable"
    assert not any(secret in ready.text for secret in secrets), ready.text


def test_redis_down_answers_name_no_host_or_port(client, monkeypatch):
    port = str(free_port())
    switch_to(monkeypatch, KEVLAYA_REDIS__URL=f"redis://127.0.0.1:{port}/0")
    refused = submit(client)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "queue_unavailable"
    assert port not in refused.text and "127.0.0.1" not in refused.text
    ready = client.get("/readyz")
    assert ready.status_code == 503 and ready.json()["checks"]["redis"] == "unavailable"
    assert port not in ready.text and "127.0.0.1" not in ready.text
    assert job_count() == 0


def test_the_loser_of_an_idempotency_race_gets_the_winners_job(client):
    """The winner commits between the loser's lookup and its first write (its key's usage, then its insert): the
    loser hits the unique constraint. On SQLite the loser holds the one write lock from its first write on."""
    assert client.get("/v1/jobs", headers=AUTH).status_code == 200  # the bootstrap key's row exists now
    winner: dict[str, uuid.UUID] = {}

    with new_session() as session:
        key_id = session.scalar(select(ApiKey.id))

    def winner_commits_first(_connection, _cursor, statement, parameters, _context, _many):  # noqa: ANN001
        if winner or not statement.lstrip().upper().startswith(("INSERT", "UPDATE")):
            return
        winner["id"] = uuid.uuid4()  # just before the loser's insert, however the rows are inserted
        with new_session() as other:
            other.add(Job(id=winner["id"], adapter="laya", requested_adapter="laya", status="queued",
                          input="the winner", params={}, idempotency_key="race",
                          api_key_id=key_id, created_at=datetime.now(timezone.utc)))
            other.commit()

    engine = get_engine()
    event.listen(engine, "before_cursor_execute", winner_commits_first)
    try:
        loser = submit(client, idempotency_key="race")
    finally:
        event.remove(engine, "before_cursor_execute", winner_commits_first)
    assert loser.status_code == 200, loser.text
    assert loser.json()["id"] == str(winner["id"])
    assert loser.headers["location"] == f"/v1/jobs/{winner['id']}"
    assert job_count() == 1
    batch = client.post("/v1/jobs/batch", headers=AUTH, json={"jobs": [
        {"adapter": "kev", "input": "a", "idempotency_key": "race"}, {"adapter": "kev", "input": "b"}]})
    assert batch.status_code == 202 and batch.json()["jobs"][0]["id"] == str(winner["id"])


def test_concurrent_submits_with_one_key_all_get_one_job(client):
    assert client.get("/v1/jobs", headers=AUTH).status_code == 200
    start = threading.Barrier(8)
    answers: list[httpx.Response] = []

    def one() -> None:
        start.wait()
        answers.append(submit(client, idempotency_key="burst"))

    threads = [threading.Thread(target=one) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(a.status_code for a in answers) == [200] * 7 + [202], [a.text for a in answers]
    assert len({a.json()["id"] for a in answers}) == 1
    assert job_count() == 1


def test_an_unexpected_error_keeps_the_json_error_shape(client):
    def broken() -> None:
        raise RuntimeError("secret internal detail")

    client.app.add_api_route("/broken", broken)
    response = client.get("/broken")
    assert response.status_code == 500
    assert response.headers["content-type"] == "application/json"
    assert response.json() == {"error": {"code": "internal", "message": "internal server error"}}


def test_405_names_every_allowed_method(client):
    response = client.put("/v1/jobs", headers=AUTH)
    assert response.status_code == 405 and response.json()["error"]["code"] == "method_not_allowed"
    assert {"GET", "POST"} <= set(response.headers["allow"].split(", "))
    one = client.patch(f"/v1/jobs/{uuid.uuid4()}", headers=AUTH)
    assert one.status_code == 405 and {"GET", "DELETE"} <= set(one.headers["allow"].split(", "))


def test_a_chunked_body_over_the_limit_is_413(client):
    def chunks():
        for _ in range(40):
            yield b"x" * 65_536  # 2.5 MiB, no Content-Length

    response = client.post("/v1/jobs", content=chunks(), headers={**AUTH, "Content-Type": "application/json"})
    assert response.status_code == 413, response.text
    assert response.json()["error"]["code"] == "payload_too_large"
    assert job_count() == 0
    small = client.post("/v1/jobs", content=iter([b'{"adapter": "kev", ', b'"input": "x"}']),
                        headers={**AUTH, "Content-Type": "application/json"})
    assert small.status_code == 202, small.text


def test_readiness_needs_every_adapter_served_and_shows_no_paths(client):
    settings = get_settings()
    reason = "adapter kev (/srv/secret-models/kev) failed verification: adapter_model.safetensors: mismatch"
    ttl = settings.reliability.heartbeat_ttl_s
    beat("host-a:1", {"model_loaded": True, "unavailable_adapters": {"kev": reason}}, ttl)
    ready = client.get("/readyz")
    assert ready.status_code == 503
    assert "kev" in ready.json()["checks"]["adapters"] and "secret-models" not in ready.text
    # another worker serves kev: ready
    beat("host-b:1", {"model_loaded": True, "unavailable_adapters": {}}, settings.reliability.heartbeat_ttl_s)
    ready = client.get("/readyz")
    assert ready.status_code == 200, ready.text
    assert ready.json()["checks"]["adapters"] == "ok"


def test_the_bootstrap_key_can_be_revoked_with_the_cli(client, service_env):
    assert client.get("/v1/jobs", headers=AUTH).status_code == 200
    with session_scope() as session:
        bootstrap = session.scalar(select(ApiKey).where(ApiKey.name == "bootstrap"))
    env = {**os.environ, **service_env}
    listed = subprocess.run([sys.executable, "-m", "cli", "keys", "list"], capture_output=True, text=True,
                            env=env, timeout=60)
    assert str(bootstrap.id) in listed.stdout
    revoked = subprocess.run([sys.executable, "-m", "cli", "keys", "revoke", str(bootstrap.id)],
                             capture_output=True, text=True, env=env, timeout=60)
    assert revoked.returncode == 0, revoked.stderr
    refused = client.get("/v1/jobs", headers=AUTH)
    assert refused.status_code == 401 and "revoked" in refused.json()["error"]["message"]
    assert submit(client).status_code == 401


# -- the real server: what a client sees on the wire ------------------------------------------------------

@pytest.fixture
def server(service_env: dict[str, str], start_process) -> str:  # noqa: ANN001
    port = free_port()
    process = start_process("api", {**service_env, "KEVLAYA_API__PORT": str(port)})
    base = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        assert process.process.poll() is None, process.output()
        try:
            return httpx.get(f"{base}/healthz", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    wait_until(healthy, 60, what="the API to answer")
    return base


def test_a_client_that_sends_the_whole_body_first_receives_the_413(server):
    """urllib writes the whole body before it reads: an early 413 reached it as a connection reset."""
    body = b'{"adapter": "kev", "input": "' + b"y" * 3_000_000 + b'"}'
    request = urllib.request.Request(f"{server}/v1/jobs", data=body, method="POST",
                                     headers={**AUTH, "Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=30)
    assert refused.value.code == 413
    assert b"payload_too_large" in refused.value.read()


def test_headers_are_capped(server):
    assert httpx.get(f"{server}/healthz", headers={"X-Pad": "a" * 8_000}).status_code == 200
    host, port = server.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        connection.putrequest("GET", "/healthz")
        connection.putheader("X-Pad", "a" * 1_000_000)
        connection.endheaders()
        status = connection.getresponse().status
    except (ConnectionError, http.client.HTTPException):
        status = None  # closed while the client was still sending: refused as well
    finally:
        connection.close()
    assert status in (None, 431)
    assert httpx.get(f"{server}/healthz").status_code == 200  # the server is fine afterwards


def _raw_exchange(server: str, pieces: list[bytes]) -> http.client.HTTPResponse:
    """Send `pieces` as separate writes on one connection, then read the answer."""
    host, port = server.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    for piece in pieces:
        sock.sendall(piece)
        time.sleep(0.002)  # separate reads on the server's side
    response = http.client.HTTPResponse(sock)
    response.begin()
    return response


@pytest.mark.parametrize("arrival", ["whole", "in pieces, never ending"])
def test_a_head_over_the_limit_is_refused_with_431_however_it_arrives(server, arrival):
    limit = get_settings().limits.header_bytes
    head = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * (limit + 1_000)
    if arrival == "whole":
        pieces = [head + b"\r\n\r\n"]
    else:  # the head never ends: the server must stop reading it once it passes the limit
        pieces = [head[i:i + 4_096] for i in range(0, len(head), 4_096)]
    response = _raw_exchange(server, pieces)
    assert response.status == 431
    assert response.getheader("content-type") == "application/json"
    error = json.loads(response.read())["error"]
    assert error["code"] == "headers_too_large" and str(limit) in error["message"]
    assert httpx.get(f"{server}/healthz").status_code == 200


def test_the_head_limit_counts_each_request_alone_and_never_the_body(server):
    limit = get_settings().limits.header_bytes
    host, port = server.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    try:  # two heads of 60 % of the limit on one kept-alive connection: each is under it
        for _ in range(2):
            connection.request("GET", "/healthz", headers={"X-Pad": "a" * (limit * 6 // 10)})
            answer = connection.getresponse()
            answer.read()
            assert answer.status == 200
    finally:
        connection.close()
    # A small head and a body of several times the head limit, in one write: the body is not head.
    body = json.dumps({"adapter": "kev", "input": "y" * (limit * 4)}).encode()
    head = (f"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nAuthorization: {AUTH['Authorization']}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    response = _raw_exchange(server, [head + body])
    assert response.status == 422  # over the prompt's character limit, not the head's
    assert "characters" in json.loads(response.read())["error"]["message"]


def test_unknown_query_parameters_are_refused_naming_them(client):
    typo = client.get("/v1/jobs", params={"stauts": "failed"}, headers=AUTH)
    assert typo.status_code == 422 and typo.json()["error"]["message"].startswith("stauts:")
    assert "status" in typo.json()["error"]["message"]
    assert client.get("/v1/models", params={"x": "1"}, headers=AUTH).status_code == 422
    assert client.get("/v1/jobs", params={"status": "queued", "limit": 5}, headers=AUTH).status_code == 200
