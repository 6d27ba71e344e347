"""A request body that trickles is cut off (RELIABILITY.md, Security): after `KEVLAYA_CONNECTIONS__BODY_TIMEOUT_S` a
body must keep coming at `KEVLAYA_CONNECTIONS__BODY_MIN_BYTES_PER_S` on average, else 408 and the connection closes; a
body that comes at a healthy rate takes as long as it needs. A real API process on loopback."""

from __future__ import annotations

import json
import socket
import time

import pytest

from api.http.body_timeout import BodyClock
from tests.conftest import API_KEY, free_port, start_api

SQLITE = pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)  # the database plays no part here
TIMED = {"KEVLAYA_CONNECTIONS__BODY_TIMEOUT_S": "1", "KEVLAYA_CONNECTIONS__BODY_MIN_BYTES_PER_S": "1024"}


@pytest.fixture
def api_env(service_env: dict[str, str]) -> dict[str, str]:
    return {**service_env, "KEVLAYA_API__PORT": str(free_port()), **TIMED}


def head(length: int) -> bytes:
    return (b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer %s\r\nContent-Length: %d\r\n\r\n" % (API_KEY.encode(), length))


def answer_of(sock: socket.socket, limit_s: float) -> bytes:
    sock.settimeout(limit_s)
    received = b""
    while chunk := sock.recv(65536):
        received += chunk
        if b"\r\n\r\n" in received and b"content-length" in received.lower():
            break
    return received


@SQLITE
def test_a_trickled_body_gets_408_and_a_steady_one_is_served(api_env, start_process):
    client = start_api(start_process, api_env)
    port = int(api_env["KEVLAYA_API__PORT"])
    trickle = socket.create_connection(("127.0.0.1", port))
    trickle.sendall(head(100_000) + b'{"adapter": "laya", ')
    started = time.monotonic()
    for _ in range(20):  # a byte every 0.3 s: 3 bytes a second
        time.sleep(0.3)
        try:
            trickle.sendall(b" ")
        except OSError:
            break  # closed already
    answer = answer_of(trickle, 10)
    assert time.monotonic() - started < 4, "the trickled body was not cut off"
    assert answer.startswith(b"HTTP/1.1 408") and b"KEVLAYA_CONNECTIONS__BODY_TIMEOUT_S" in answer, answer
    trickle.close()

    # 6 kB in 2 s (3 kB/s, over the minimum), longer than the timeout: served
    body = json.dumps({"adapter": "laya", "input": "pick one", "metadata": {"pad": "a" * 6000}}).encode()
    steady = socket.create_connection(("127.0.0.1", port))
    steady.sendall(head(len(body)))
    for start in range(0, len(body), 600):
        steady.sendall(body[start:start + 600])
        time.sleep(0.2)
    answer = answer_of(steady, 10)
    assert answer.startswith(b"HTTP/1.1 202"), answer[:300]
    steady.close()
    assert client.get("/healthz").status_code == 200
    client.close()


def test_the_clock_counts_only_the_time_the_server_reads():
    clock = BodyClock(grace_s=1, min_bytes_per_s=100, now=0.0)
    clock.tick(0.8, reading=True)
    assert not clock.late()  # within the grace, whatever came
    clock.tick(5.0, reading=False)  # the app did not take the body: the client could not send
    assert not clock.late()
    clock.tick(5.7, reading=True)
    assert clock.late()  # 1.5 s counted, nothing received
    clock.received = 200
    assert not clock.late()  # 200 bytes in 1.5 s: over 100 a second
