"""Redis behind a password (RELIABILITY.md, Security; issue 58): the Redis `kevlaya run` starts asks for a generated
password, kept like the API key, that every process it starts uses; a command without it (the issue's `XADD` into a
job's live stream) is refused. The API and the worker refuse a Redis beyond this host without a password. Real
servers and commands, loopback only."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import redis

from cli import local_run
from shared import redis_server
from shared.redis_auth import redis_url_problem
from tests.conftest import free_port, wait_until
from tests.test_secrets import Run

ATTACK = [b"XADD", b"kevlaya:job:0:events", b"*", b"text", b"injected"]


def raw_command(port: int, *parts: bytes) -> bytes:
    """The server's first reply line to one command sent as a client with no password would send it."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as connection:
        connection.sendall(b"*%d\r\n" % len(parts) + b"".join(b"$%d\r\n%s\r\n" % (len(p), p) for p in parts))
        return connection.recv(4096).split(b"\r\n")[0]


def test_a_server_started_with_a_password_refuses_commands_without_it(tmp_path: Path):
    port, password = free_port(), "pw-" + os.urandom(12).hex()
    server = redis_server.start_redis_server(port, tmp_path, persistent=False, password=password)
    try:
        assert raw_command(port, *ATTACK).startswith(b"-NOAUTH")
        assert redis.Redis(port=port, password=password).ping()
        assert password.encode() not in Path(f"/proc/{server.pid}/cmdline").read_bytes()  # not shown by `ps`
        assert not list(tmp_path.rglob("*.conf"))  # the file that carried it is gone once the server answers
    finally:
        server.terminate()
        server.wait(10)


def test_kevlaya_run_starts_its_redis_once_with_a_kept_password(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.chdir(tmp_path)
    url = f"redis://127.0.0.1:{free_port()}/0"
    guarded, server = local_run.ensure_redis(url)
    try:
        password = (tmp_path / ".kevlaya" / "redis_password").read_text().strip()
        assert guarded == url.replace("//", f"//:{password}@") and server is not None
        assert (tmp_path / ".kevlaya" / "redis_password").stat().st_mode & 0o777 == 0o600
        assert not redis_server.answers(url)
        again, none = local_run.ensure_redis(url)  # a second start finds it running and uses it
        assert (again, none) == (guarded, None)
    finally:
        server.terminate()
        server.wait(10)


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_kevlaya_runs_redis_refuses_the_injected_xadd_and_its_processes_use_the_password(worker_env, tmp_path):
    redis_port, flower_port = free_port(), free_port()
    env = {**worker_env, "KEVLAYA_DATABASE__URL": f"sqlite:///{tmp_path / 'run.db'}",
           "KEVLAYA_REDIS__URL": f"redis://127.0.0.1:{redis_port}/0", "KEVLAYA_API__PORT": str(free_port()),
           "KEVLAYA_FLOWER__PORT": str(flower_port), "KEVLAYA_API__KEY": "", "KEVLAYA_FLOWER__BASIC_AUTH": ""}
    run = Run(env, tmp_path)
    try:
        run.banner()
        assert raw_command(redis_port, *ATTACK).startswith(b"-NOAUTH")  # the attack
        assert raw_command(redis_port, b"XRANGE", b"kevlaya:job:0:events", b"-", b"+").startswith(b"-NOAUTH")
        kept = tmp_path / ".kevlaya" / "redis_password"
        password = kept.read_text().strip()
        assert kept.stat().st_mode & 0o077 == 0

        key = (tmp_path / ".kevlaya" / "api_key").read_text().strip()
        api = httpx.Client(base_url=f"http://127.0.0.1:{env['KEVLAYA_API__PORT']}",
                           headers={"Authorization": f"Bearer {key}"}, timeout=30)
        # /readyz needs the worker's heartbeat in Redis: the worker and the API both authenticated
        wait_until(lambda: _status(api, "/readyz") == 200, 120, what="the API and a worker with its model loaded")
        submitted = api.post("/v1/jobs", json={"adapter": "laya", "input": "pick one", "params": {"output": "text"}})
        assert submitted.status_code == 202, submitted.text
        job = api.get(f"/v1/jobs/{submitted.json()['id']}/wait", params={"timeout": 60}).json()
        assert job["status"] == "succeeded", job
        login = tuple((tmp_path / ".kevlaya" / "flower_auth").read_text().strip().split(":", 1))
        flower = httpx.Client(base_url=f"http://127.0.0.1:{flower_port}", auth=login, timeout=10)
        # Flower asks the workers through the broker: it lists the worker only when it authenticated too
        wait_until(lambda: "kevlaya-" in _text(flower, "/api/workers?refresh=1"), 60, what="Flower to list the worker")
    finally:
        output = run.stop()
    assert password not in output
    assert "redis://:***@127.0.0.1" in output or "password in .kevlaya/redis_password" in output


def _text(client: httpx.Client, url: str) -> str:
    try:
        return client.get(url).text
    except httpx.TransportError:
        return ""


def _status(client: httpx.Client, url: str) -> int:
    try:
        return client.get(url, timeout=5).status_code
    except httpx.TransportError:
        return 0


@pytest.mark.parametrize("url, refused", [
    ("redis://127.0.0.1:6379/0", False), ("redis://localhost:6379/0", False), ("redis://[::1]:6379/0", False),
    ("redis://127.0.0.5:6379/0", False), ("unix:///run/redis.sock", False), ("redis://:s3cret@redis:6379/0", False),
    ("rediss://user:s3cret@10.0.0.7:6380/0", False), ("redis://10.0.0.7:6379/0?password=s3cret", False),
    ("redis://redis:6379/0", True), ("redis://10.0.0.7:6379/0", True), ("redis://user@redis.example:6379/0", True),
])
def test_a_redis_beyond_this_host_needs_a_password(url: str, refused: bool):
    problem = redis_url_problem(url)
    assert bool(problem) == refused
    if refused:
        assert "KEVLAYA_REDIS__URL" in problem and "KEVLAYA_REDIS__ALLOW_NO_PASSWORD" in problem
        assert redis_url_problem(url, allow_no_password=True) is None


@pytest.mark.parametrize("command", ["api", "worker"])
def test_the_api_and_the_worker_refuse_to_start_on_a_remote_redis_without_a_password(service_env, command):
    done = subprocess.run([sys.executable, "-m", "cli", command], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **service_env, "KEVLAYA_REDIS__URL": "redis://redis.example:6379/0"})
    assert done.returncode == 2, done.stdout + done.stderr
    assert "KEVLAYA_REDIS__URL (redis://redis.example:6379/0) has no password" in done.stderr
