"""The `kevlaya` command line and the Alembic migrations, on both databases."""

from __future__ import annotations

import os
import subprocess
import sys

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from fastapi.testclient import TestClient
from sqlalchemy import create_engine, inspect

from shared.migrate import downgrade, upgrade
from shared.models import Base


def kevlaya(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cli", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=120)


def test_help_lists_every_command():
    result = kevlaya("--help")
    assert result.returncode == 0
    for command in ("run", "db", "keys", "api", "worker", "flower", "models", "worker-health"):
        assert command in result.stdout


def test_migrations_match_the_models_and_downgrade_cleanly(database_url):
    engine = create_engine(database_url)
    try:
        with engine.connect() as connection:
            diff = compare_metadata(MigrationContext.configure(connection), Base.metadata)
        assert diff == []  # the models and the migrations describe the same schema
        downgrade(database_url, "base")
        assert set(inspect(engine).get_table_names()) <= {"alembic_version"}
        upgrade(database_url)
        assert {"jobs", "batches", "api_keys"} <= set(inspect(engine).get_table_names())
    finally:
        engine.dispose()


def test_jobs_finished_before_answered_by_existed_get_it_from_what_they_hold(database_url):
    """Migration 0007: an `auto` job with a Kev stage was answered by kev; other finished jobs by their adapter."""
    import uuid
    from datetime import datetime

    import sqlalchemy as sa

    downgrade(database_url, "0006")
    jobs = sa.table("jobs", sa.column("id", sa.Uuid()), sa.column("adapter", sa.String()),
                    sa.column("requested_adapter", sa.String()), sa.column("status", sa.String()),
                    sa.column("input", sa.JSON()), sa.column("params", sa.JSON()), sa.column("attempts", sa.Integer()),
                    sa.column("parent_job_id", sa.Uuid()), sa.column("created_at", sa.DateTime()))
    ids = {name: uuid.uuid4() for name in ("escalated", "laya_stage", "kev_stage", "answered", "kev", "cancelled")}
    rows = [("escalated", "laya", "auto", "succeeded", None), ("laya_stage", "laya", "laya", "succeeded", "escalated"),
            ("kev_stage", "kev", "kev", "succeeded", "escalated"), ("answered", "laya", "auto", "failed", None),
            ("kev", "kev", "kev", "succeeded", None), ("cancelled", "kev", "kev", "cancelled", None)]
    engine = create_engine(database_url)
    try:
        with engine.begin() as connection:
            connection.execute(jobs.insert(), [
                {"id": ids[name], "adapter": adapter, "requested_adapter": requested, "status": status, "input": "x",
                 "params": {}, "attempts": 1, "parent_job_id": ids[parent] if parent else None,
                 "created_at": datetime(2025, 1, 1)} for name, adapter, requested, status, parent in rows])
        upgrade(database_url)
        with engine.connect() as connection:
            found = dict(connection.execute(sa.select(jobs.c.id, sa.column("answered_by")).select_from(jobs)).all())
        answered = {name: found[job_id] for name, job_id in ids.items()}
        assert answered == {"escalated": "kev", "laya_stage": "laya", "kev_stage": "kev", "answered": "laya",
                            "kev": "kev", "cancelled": None}
    finally:
        engine.dispose()


def test_keys_create_list_revoke(service_env):
    created = kevlaya("keys", "create", "ci-bot", env=service_env)
    assert created.returncode == 0, created.stderr
    key_id = created.stdout.split("id:")[1].split()[0]
    plain = created.stdout.split("key:")[1].split()[0]

    from api.main import create_app

    with TestClient(create_app()) as client:
        headers = {"Authorization": f"Bearer {plain}"}
        assert client.get("/v1/jobs", headers=headers).status_code == 200
        listed = kevlaya("keys", "list", env=service_env)
        assert "ci-bot" in listed.stdout and plain not in listed.stdout  # never printed again
        assert kevlaya("keys", "revoke", key_id, env=service_env).returncode == 0
        assert client.get("/v1/jobs", headers=headers).status_code == 401


def test_commands_on_a_database_not_ready_say_so_in_one_line(tmp_path):
    """Every command that reads or writes rows checks the database first: an empty SQLite file or a server that
    does not answer gives one line naming the fix (exit 2), not a traceback, and nothing is written."""
    empty = {"KEVLAYA_DATABASE__URL": f"sqlite:///{tmp_path / 'fresh.db'}"}
    away = {"KEVLAYA_DATABASE__URL": "postgresql+psycopg://nobody:s3cret@127.0.0.1:1/none"}
    commands = [("keys", "list"), ("keys", "create", "bot"), ("keys", "revoke", "9ec1927b-3d0a-44d4-8e6d-9c30bfabae8b"),
                ("dev", "seed-jobs", "10")]
    for command in commands:
        result = kevlaya(*command, env=empty)
        assert result.returncode == 2 and "Traceback" not in result.stderr, (command, result.stderr)
        assert "run `kevlaya db upgrade` first" in result.stderr, command
        result = kevlaya(*command, env=away)
        assert result.returncode == 2 and "does not answer" in result.stderr, (command, result.stderr)
        assert "s3cret" not in result.stderr
    engine = create_engine(empty["KEVLAYA_DATABASE__URL"])
    try:
        assert inspect(engine).get_table_names() == []
    finally:
        engine.dispose()


def test_cli_errors_are_clear(service_env):
    bad = kevlaya("keys", "revoke", "not-a-uuid", env=service_env)
    assert bad.returncode == 2 and "not a UUID" in bad.stderr
    missing = kevlaya("db", "upgrade", "--wait", "1",
                      env={"KEVLAYA_DATABASE__URL": "postgresql+psycopg://nobody@127.0.0.1:1/none"})
    assert missing.returncode == 2 and "does not answer" in missing.stderr
    shape = kevlaya("models", "random", "/tmp/x", "--shape", "huge")
    assert shape.returncode == 2 and "--shape must be one of" in shape.stderr


def test_flower_gets_its_password_and_broker_through_the_environment(redis_server, start_process):
    """`ps` shows every user each process's command line: no secret may be on it."""
    import httpx

    from tests.conftest import free_port, wait_until

    port = free_port()
    process = start_process("flower", {"KEVLAYA_REDIS__URL": redis_server.url, "KEVLAYA_FLOWER__PORT": str(port),
                                       "KEVLAYA_FLOWER__BASIC_AUTH": "admin:s3cret-pw"}, fork=False)
    base = f"http://127.0.0.1:{port}"

    def up() -> bool:
        assert process.process.poll() is None, process.output()
        try:
            return httpx.get(f"{base}/healthcheck", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    wait_until(up, 60, what="Flower to answer")
    command_line = open(f"/proc/{process.process.pid}/cmdline", "rb").read().replace(b"\0", b" ").decode()
    assert "flower" in command_line
    assert "s3cret-pw" not in command_line and redis_server.url not in command_line, command_line
    assert httpx.get(f"{base}/", timeout=5).status_code == 401
    assert httpx.get(f"{base}/", auth=("admin", "s3cret-pw"), timeout=5).status_code == 200


def test_a_database_migrated_by_a_newer_version_is_refused_by_every_command_in_one_line(tmp_path, monkeypatch):
    """Nothing runs against a schema this version does not know: API, worker, `db upgrade`, key commands and
    `kevlaya run` each refuse it with one line naming both revisions."""
    import sqlite3

    from shared.migrate import upgrade

    url = f"sqlite:///{tmp_path / 'newer.db'}"
    upgrade(url)
    with sqlite3.connect(tmp_path / "newer.db") as connection:  # as a later version's migration would leave it
        connection.execute("UPDATE alembic_version SET version_num = 'f00dfeed0042'")
    env = {**os.environ, "KEVLAYA_DATABASE__URL": url, "KEVLAYA_REDIS__URL": "redis://127.0.0.1:1/0"}
    for command in (["api"], ["worker"], ["db", "upgrade", "--wait", "1"], ["keys", "list"], ["run"]):
        done = subprocess.run([sys.executable, "-m", "cli", *command], env=env, capture_output=True, text=True,
                              timeout=120)
        output = done.stdout + done.stderr
        assert done.returncode == 2, (command, output[-2000:])
        assert "migrated by a newer version of kevlaya (migration f00dfeed0042)" in output, (command, output[-2000:])
        assert "Traceback" not in output, (command, output[-2000:])
    with sqlite3.connect(tmp_path / "newer.db") as connection:
        assert connection.execute("SELECT version_num FROM alembic_version").fetchone() == ("f00dfeed0042",)


def test_the_api_still_starts_before_its_database_answers():
    """Only a schema known to be wrong is refused: a database that does not answer yet is the API's to report
    (readiness 503) and to retry, as under docker compose."""
    from shared.migrate import foreign_schema

    assert foreign_schema("postgresql+psycopg://nobody@127.0.0.1:1/none") is None
