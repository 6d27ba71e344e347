"""Connections that run out (RELIABILITY.md, Resources): the API's own database pool with every connection
checked out, PostgreSQL refusing new connections (a role's CONNECTION LIMIT reached), and Redis at `maxclients`.
Each answers a submit with a prompt 503 and Retry-After, stores nothing for it, and serves again once
connections return."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import pytest
import redis
from sqlalchemy import Connection, Engine, create_engine, exc, func, select
from sqlalchemy.pool import NullPool

from shared.db import get_engine
from shared.models import Job
from shared.queue import celery_app as queue_app
from tests.conftest import AUTH, RedisServer, login_role, wait_until
from tests.test_resources import JOB, app_client, stored_jobs

POOL_TIMEOUT_S = 0.5
PROMPT_S = 2.0  # a refusal takes no longer than this (the pool's timeout included)


def timed(call):  # noqa: ANN001, ANN201
    started = time.monotonic()
    answer = call()
    return answer, time.monotonic() - started


def assert_prompt_503(answer, seconds: float, code: str) -> None:  # noqa: ANN001
    assert answer.status_code == 503, answer.text
    assert answer.json()["error"]["code"] == code
    assert answer.headers["Retry-After"]
    assert seconds < PROMPT_S, f"answered after {seconds:.1f} s"


def hold_every_connection(engine: Engine) -> list[Connection]:
    """Check out connections until the pool has none left to give; another thread's connection, returned
    meanwhile, is taken too."""
    held: list[Connection] = []
    while True:
        try:
            held.append(engine.connect())
        except exc.TimeoutError:
            if engine.pool.checkedout() == len(held):
                return held


def test_a_used_up_connection_pool_answers_503_within_its_timeout_and_serves_again(service_env, monkeypatch):
    with app_client(monkeypatch, KEVLAYA_DATABASE__POOL_SIZE="1", KEVLAYA_DATABASE__POOL_TIMEOUT_S=str(POOL_TIMEOUT_S),
                    KEVLAYA_BATCH__CHECK_INTERVAL_S="3600") as client:
        first = client.post("/v1/jobs", headers=AUTH, json=JOB)
        assert first.status_code == 202, first.text
        held = hold_every_connection(get_engine())  # as slow requests would
        try:
            assert_prompt_503(*timed(lambda: client.post("/v1/jobs", headers=AUTH, json=JOB)), "database_unavailable")
            assert_prompt_503(*timed(lambda: client.get(f"/v1/jobs/{first.json()['id']}", headers=AUTH)),
                              "database_unavailable")
            ready, seconds = timed(lambda: client.get("/readyz"))
            assert ready.status_code == 503 and ready.json()["checks"]["database"] == "unavailable"
            assert seconds < PROMPT_S
        finally:
            for connection in held:
                connection.close()
        assert stored_jobs() == 1  # the refused submit stored nothing
        assert client.post("/v1/jobs", headers=AUTH, json=JOB).status_code == 202
        assert stored_jobs() == 2


@pytest.fixture
def limited_role(database_url: str) -> Iterator[str]:
    """The URL of a new role that may hold two connections at once (CONNECTION LIMIT 2) to this test's database,
    with the rights the service needs. Superusers ignore the limit, so the service runs as this role."""
    with login_role(database_url, uuid.uuid4().hex, "CONNECTION LIMIT 2") as url:
        yield url


def rows_of(database_url: str) -> int:
    """Jobs stored, counted as the database's owner (not subject to the role's limit)."""
    engine = create_engine(database_url, poolclass=NullPool)
    with engine.connect() as connection:
        count = connection.scalar(select(func.count()).select_from(Job))
    engine.dispose()
    return count


@pytest.mark.parametrize("database_url", ["postgresql"], indirect=True)  # the limit is PostgreSQL's
def test_postgresql_refusing_new_connections_answers_503_at_once_and_serves_once_they_return(
        service_env, database_url, limited_role, monkeypatch):
    others = create_engine(limited_role, poolclass=NullPool)  # another program using up the role's connections
    held = [others.connect() for _ in range(2)]
    try:
        with pytest.raises(exc.OperationalError, match="too many connections"):
            others.connect()
        with app_client(monkeypatch, KEVLAYA_DATABASE__URL=limited_role) as client:
            assert_prompt_503(*timed(lambda: client.post("/v1/jobs", headers=AUTH, json=JOB)), "database_unavailable")
            assert_prompt_503(*timed(lambda: client.get("/v1/jobs", headers=AUTH)), "database_unavailable")
            assert rows_of(database_url) == 0

            for connection in held:
                connection.close()
            # a closed connection's server process ends a moment later: until then the limit still counts it
            wait_until(lambda: client.post("/v1/jobs", headers=AUTH, json=JOB).status_code == 202, 10,
                       what="a submit once connections are free")
            assert rows_of(database_url) == 1
    finally:
        for connection in held:
            connection.close()
        others.dispose()


def fill_clients(url: str) -> list[redis.Redis]:
    """Connect until the server refuses: what a crowd of other clients would do."""
    held: list[redis.Redis] = []
    while True:
        client = redis.Redis.from_url(url)
        try:
            client.ping()
        except redis.ConnectionError as refused:
            assert "max number of clients" in str(refused)
            client.close()
            return held
        held.append(client)


def test_redis_at_maxclients_refuses_submits_at_once_and_stores_nothing_until_clients_leave(
        service_env, tmp_path, monkeypatch):
    server = RedisServer(tmp_path / "crowded-redis", persistent=False)
    server.start()
    held: list[redis.Redis] = []
    try:
        broker = redis.Redis.from_url(server.url)
        broker.config_set("maxclients", str(broker.info("clients")["connected_clients"] + 4))
        held = fill_clients(server.url)
        with app_client(monkeypatch, KEVLAYA_REDIS__URL=server.url) as client:
            assert_prompt_503(*timed(lambda: client.post("/v1/jobs", headers=AUTH, json=JOB)), "queue_unavailable")
            assert stored_jobs() == 0

            for crowd in held:
                crowd.close()
            wait_until(lambda: client.post("/v1/jobs", headers=AUTH, json=JOB).status_code == 202, 10,
                       what="a submit once clients left")
            assert stored_jobs() == 1
            queue = queue_app().conf.task_default_queue
            wait_until(lambda: broker.llen(queue) > 0, 10, what="its wake-up to be published")
    finally:
        for crowd in held:
            crowd.close()
        server.stop()
