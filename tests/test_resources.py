"""Resources that run out (RELIABILITY.md, Resources): a full disk under the SQLite file and under the files
directory, and Redis at `maxmemory`. Each refuses with 503 and Retry-After, stores nothing half-written, and
serves again once the resource is back. The disks are real filesystems (a small tmpfs mounted for the test)."""

from __future__ import annotations

import io
import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from shared.db import session_scope
from shared.migrate import upgrade
from shared.models import FileBatch, Job, StoredFile
from shared.queue import celery_app as queue_app
from tests.conftest import AUTH, RedisServer, reset_process_state, wait_until

JOB = {"adapter": "laya", "input": "Options: A; B. Pick one.", "params": {"output": "text", "max_new_tokens": 4}}


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB filesystem of its own, so filling it disturbs nothing else."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(disk: Path) -> Path:
    """Write a file until the disk is full; removing it gives the space back."""
    filler = disk / "filler"
    with filler.open("wb", buffering=0) as out:
        try:
            while out.write(b"\0" * 4096):
                pass
        except OSError:
            pass
    return filler


def app_client(monkeypatch: pytest.MonkeyPatch, **env: str) -> TestClient:
    from api.main import create_app

    for name, value in {"KEVLAYA_API__WRITER": "thread", **env}.items():
        monkeypatch.setenv(name, value)
    reset_process_state()
    return TestClient(create_app(), raise_server_exceptions=False)


def stored_jobs() -> int:
    with session_scope() as session:
        return session.scalar(select(func.count()).select_from(Job))


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_a_full_disk_under_sqlite_refuses_submits_and_keeps_every_accepted_job(service_env, small_disk,
                                                                               monkeypatch):
    url = f"sqlite:///{small_disk / 'kevlaya.db'}"
    upgrade(url)
    with app_client(monkeypatch, KEVLAYA_DATABASE__URL=url) as client:
        first = client.post("/v1/jobs", headers=AUTH, json=JOB)
        assert first.status_code == 202, first.text
        filler = fill(small_disk)
        answers = [client.post("/v1/jobs", headers=AUTH, json={**JOB, "input": f"{'word ' * 60} {i}"})
                   for i in range(100)]
        refused = [a for a in answers if a.status_code == 503]
        assert refused, [a.status_code for a in answers]
        assert {a.status_code for a in answers} <= {202, 503}
        assert refused[0].json()["error"]["code"] == "database_unavailable"
        assert refused[0].headers["Retry-After"]
        accepted = [first] + [a for a in answers if a.status_code == 202]
        assert stored_jobs() == len(accepted)  # a refused submit stored nothing; every 202 is there
        assert client.get(f"/v1/jobs/{first.json()['id']}", headers=AUTH).status_code == 200  # reads go on

        filler.unlink()
        again = client.post("/v1/jobs", headers=AUTH, json=JOB)
        assert again.status_code == 202, again.text
        assert stored_jobs() == len(accepted) + 1


def test_a_full_disk_under_the_files_directory_refuses_uploads_and_retries_the_batch_output(
        service_env, small_disk, monkeypatch):
    files_dir = small_disk / "files"
    with app_client(monkeypatch, KEVLAYA_BATCH__FILES_DIR=str(files_dir)) as client:
        lines = "".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                                    "body": {"model": "laya", "max_tokens": 4,
                                             "messages": [{"role": "user", "content": f"line {i} " + "x" * 200}]}})
                        + "\n" for i in range(40)).encode()
        uploaded = client.post("/v1/files", headers=AUTH, files={"file": ("in.jsonl", io.BytesIO(lines))},
                               data={"purpose": "batch"})
        assert uploaded.status_code == 200, uploaded.text
        batch = client.post("/v1/batches", headers=AUTH, json={"input_file_id": uploaded.json()["id"],
                                                               "endpoint": "/v1/chat/completions",
                                                               "completion_window": "24h"}).json()
        wait_until(lambda: client.get(f"/v1/batches/{batch['id']}", headers=AUTH).json()["status"] == "in_progress",
                   30, what="the lines to be stored")

        filler = fill(small_disk)
        refused = client.post("/v1/files", headers=AUTH, files={"file": ("big.jsonl", io.BytesIO(lines * 40))},
                              data={"purpose": "batch"})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "storage_full", refused.text
        assert refused.headers["Retry-After"]
        assert list((files_dir / "tmp").iterdir()) == []  # nothing half-written
        # the batch's error file cannot be written either: the batch waits, cancelling, and nothing is lost
        assert client.post(f"/v1/batches/{batch['id']}/cancel", headers=AUTH).status_code == 200
        with pytest.raises(AssertionError):
            wait_until(lambda: client.get(f"/v1/batches/{batch['id']}", headers=AUTH).json()["status"] ==
                       "cancelled", 3, what="the error file")
        with session_scope() as session:
            assert session.scalar(select(FileBatch.status)) == "cancelling"
            assert session.scalar(select(func.count()).select_from(StoredFile)) == 1

        filler.unlink()
        done = wait_until(lambda: (b := client.get(f"/v1/batches/{batch['id']}", headers=AUTH).json())["status"]
                          == "cancelled" and b, 30, what="the error file once space is back")
        errors = client.get(f"/v1/files/{done['error_file_id']}/content", headers=AUTH).text.splitlines()
        assert sorted(json.loads(e)["custom_id"] for e in errors) == sorted(f"r{i}" for i in range(40))
        assert client.post("/v1/files", headers=AUTH, files={"file": ("in.jsonl", io.BytesIO(lines))},
                           data={"purpose": "batch"}).status_code == 200


def test_redis_at_maxmemory_refuses_submits_and_stores_nothing_until_it_has_room(service_env, tmp_path,
                                                                                 monkeypatch):
    server = RedisServer(tmp_path / "full-redis", persistent=False)
    server.start()
    try:
        broker = redis.Redis.from_url(server.url)
        with app_client(monkeypatch, KEVLAYA_REDIS__URL=server.url) as client:
            assert client.post("/v1/jobs", headers=AUTH, json=JOB).status_code == 202
            broker.config_set("maxmemory-policy", "noeviction")
            # below what it holds: every write is refused from now on (just at the limit, a write may slip in)
            broker.config_set("maxmemory", str(broker.info("memory")["used_memory"] // 2))
            with pytest.raises(redis.ResponseError, match="maxmemory"):
                broker.set("ballast", b"x" * 1024)
            assert broker.ping()  # what the submit used to check
            before = stored_jobs()
            refused = client.post("/v1/jobs", headers=AUTH, json=JOB)
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "queue_unavailable"
            assert refused.headers["Retry-After"]
            assert stored_jobs() == before  # PING still answers at maxmemory; the wake-up would have been lost

            broker.config_set("maxmemory", "0")
            accepted = client.post("/v1/jobs", headers=AUTH, json=JOB)
            assert accepted.status_code == 202, accepted.text
            queue = queue_app().conf.task_default_queue
            wait_until(lambda: broker.llen(queue) > 0, 10, what="its wake-up to be published")
    finally:
        server.stop()
