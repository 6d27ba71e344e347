"""Connections a client holds without a key (RELIABILITY.md, Security): a head that never comes, or comes a line at a
time, is cut off after `KEVLAYA_CONNECTIONS__HEAD_TIMEOUT_S`; more idle sockets than the API has file descriptors leave
`/healthz` and a keyed request answering within a second; the caps' own bookkeeping. Real API processes on
loopback; the crowds come from other processes and other loopback addresses (127.0.0.2, …)."""

from __future__ import annotations

import re
import resource
import socket
import subprocess
import sys
import time

import httpx
import pytest

from api.http.connection_limits import OpenConnections, connection_caps
from shared.settings import Settings
from tests.conftest import AUTH, free_port, start_api

PROMPT_S = 1.0
SQLITE = pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)  # the database plays no part here


@pytest.fixture
def api_env(service_env: dict[str, str], request: pytest.FixtureRequest) -> dict[str, str]:
    return {**service_env, "KEVLAYA_API__PORT": str(free_port()), **getattr(request, "param", {})}


def closed_after(sock: socket.socket, limit_s: float) -> tuple[float, bytes]:
    """Seconds until the server closed `sock`, and what it sent before."""
    started, received = time.monotonic(), b""
    sock.settimeout(limit_s)
    while True:
        chunk = sock.recv(4096)
        if not chunk:
            return time.monotonic() - started, received
        received += chunk


@SQLITE
@pytest.mark.parametrize("api_env", [{"KEVLAYA_CONNECTIONS__HEAD_TIMEOUT_S": "1"}], indirect=True)
def test_an_idle_socket_and_a_trickled_head_are_closed_after_the_head_timeout(api_env, start_process):
    client = start_api(start_process, api_env)
    port = int(api_env["KEVLAYA_API__PORT"])
    idle = socket.create_connection(("127.0.0.1", port))
    trickle = socket.create_connection(("127.0.0.1", port))
    trickle.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
    started = time.monotonic()
    for line in range(4):  # a header line every 0.3 s, never the blank line that ends the head
        time.sleep(0.3)
        try:
            trickle.sendall(b"X-Slow-%d: y\r\n" % line)
        except OSError:
            break  # closed already
    seconds, answer = closed_after(trickle, 10)
    assert time.monotonic() - started < 3, "the trickled head was not cut off"
    assert answer.startswith(b"HTTP/1.1 408") and b"request_timeout" in answer
    seconds, answer = closed_after(idle, 10)
    assert answer == b""  # nothing was asked: closed without a word
    # A kept-alive connection is timed again from the end of its response.
    kept = socket.create_connection(("127.0.0.1", port))
    kept.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    time.sleep(0.2)
    assert kept.recv(4096).startswith(b"HTTP/1.1 200")
    kept.sendall(b"GET /healthz HTTP/1.1\r\n")
    seconds, answer = closed_after(kept, 10)
    assert seconds < 2 and answer.startswith(b"HTTP/1.1 408")
    assert client.get("/healthz").status_code == 200
    for sock in (idle, trickle, kept):
        sock.close()
    client.close()


# One crowd: opens its sockets from one source address, says how many, and holds them until its stdin closes.
CROWD = """
import resource, socket, sys
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
source, port, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
held = []
for _ in range(count):
    sock = socket.socket()
    sock.bind((source, 0))
    sock.connect(("127.0.0.1", port))
    held.append(sock)
print(len(held), flush=True)
sys.stdin.read()
"""


def descriptor_limit(log: str) -> int:
    found = re.search(r"connections: at most (\d+) per API process, (\d+) per client address \(descriptor limit "
                      r"(\d+)\)", log)
    assert found, log
    return int(found.group(3))


@SQLITE
@pytest.mark.parametrize("api_env", [{"KEVLAYA_CONNECTIONS__HEAD_TIMEOUT_S": "120"}],  # the caps, not the timer
                         indirect=True)
def test_more_idle_sockets_than_descriptors_leave_healthz_and_a_keyed_request_answering(api_env, start_process):
    client = start_api(start_process, api_env)
    limit = descriptor_limit(start_process.started[0].output())
    sockets = min(limit + 500, 20_500)  # the 20,500 against 20,000 descriptors; more than any limit below
    crowds = 3  # each in its own process, whose descriptors it needs, from an address of its own
    if sockets // crowds + 64 > resource.getrlimit(resource.RLIMIT_NOFILE)[1]:
        pytest.skip("the hard descriptor limit is too low for the crowds")
    processes = [subprocess.Popen([sys.executable, "-c", CROWD, f"127.0.0.{2 + n}", api_env["KEVLAYA_API__PORT"],
                                   str(sockets // crowds + (n < sockets % crowds))],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for n in range(crowds)]
    try:
        opened = sum(int(process.stdout.readline() or 0) for process in processes)
        assert opened == sockets, f"the crowds opened {opened} of {sockets} sockets"
        time.sleep(2)  # the accept queue drained: every crowd socket reached the server
        for _ in range(5):
            for path, headers in (("/healthz", {}), ("/v1/jobs?limit=1", AUTH)):
                started = time.monotonic()
                answer = httpx.get(f"{client.base_url}{path}", headers=headers, timeout=10)
                seconds = time.monotonic() - started
                assert answer.status_code == 200, answer.text
                assert seconds < PROMPT_S, f"{path} answered after {seconds:.2f} s"
    finally:
        for process in processes:
            process.stdin.close()
            process.wait(30)
    assert client.get("/healthz").status_code == 200
    client.close()


class Conn:
    def __init__(self) -> None:
        self.closed = False

    def close_idle(self) -> None:
        self.closed = True


def test_at_a_cap_the_connection_waiting_longest_is_closed_and_busy_ones_never():
    connections = OpenConnections(total=3, per_address=2)
    a1, a2, b1, a3, c1, c2 = (Conn() for _ in range(6))
    for conn, address in ((a1, "a"), (a2, "a"), (b1, "b")):
        assert connections.admit(conn, address)
        connections.waiting(conn)
    connections.busy(a1)  # a request of a1 in flight
    assert connections.admit(a3, "a")  # a at its cap: a's own longest-waiting one goes, never a busy one
    assert a2.closed and not a1.closed and not b1.closed
    connections.waiting(a3)
    assert connections.admit(c1, "c")  # the process at its cap: the longest waiting of all (b1) goes
    assert b1.closed and len(connections) == 3
    connections.busy(a3)
    connections.busy(c1)
    assert not connections.admit(c2, "c")  # every one busy: the newcomer is refused, nobody closed
    assert not any(conn.closed for conn in (a1, a3, c1))
    connections.leave(a1)
    assert connections.admit(c2, "c")


def test_the_caps_stay_under_the_descriptor_limit():
    caps = connection_caps(Settings(), fd_limit=1024)
    assert caps.total + caps.backlog + 256 <= 1024 and caps.per_address == caps.total // 2
    asked = connection_caps(Settings(connections={"max": 10_000}), fd_limit=1024)
    assert asked.clamped and asked.total == caps.total
    chosen = connection_caps(Settings(connections={"max": 100, "max_per_address": 10}), fd_limit=1024)
    assert (chosen.total, chosen.per_address) == (100, 10)
