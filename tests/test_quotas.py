"""Per-key quotas and retention (docs/architecture.md §16): queued jobs and stored bytes checked atomically on
SQLite and PostgreSQL (parallel submits and uploads to real API processes), uploads that stop as soon as they pass
the quota with nothing left on disk, output and error files counted, `DELETE /v1/jobs/{id}`, and the retention
sweep that deletes old jobs, files and batches and frees their bytes."""

from __future__ import annotations

import io
import json
import socket
import threading
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path

import httpx
import pytest
from sqlalchemy import func, select, update
from typer.testing import CliRunner

from shared import lifecycle
from shared.db import session_scope, write_scope
from shared.keys import create_key
from shared.models import ApiKey, FileBatch, Job, JobStatus, KeyUsage, StoredFile
from shared.settings import get_settings
from tests.conftest import API_KEY, AUTH, TEXT, wait_until

URL = "/v1/chat/completions"
MiB = 1024 * 1024


def jsonl_bytes(size: int, tag: str = "") -> bytes:
    """A batch input file of about `size` bytes (its lines are not read by an upload)."""
    line = json.dumps({"custom_id": f"{tag}0", "method": "POST", "url": URL, "body": {
        "model": "laya", "messages": [{"role": "user", "content": "x" * 900}]}}) + "\n"
    return (line * (size // len(line) + 1))[:size].encode()


def batch_lines(*custom_ids: str) -> bytes:
    return "".join(json.dumps({"custom_id": cid, "method": "POST", "url": URL, "body": {
        "model": "laya", "messages": [{"role": "user", "content": f"Options: A; B. {cid}"}], "max_tokens": 4}}) + "\n"
        for cid in custom_ids).encode()


def upload(client, content: bytes, headers=AUTH):  # noqa: ANN001, ANN201
    return client.post("/v1/files", headers=headers, files={"file": ("in.jsonl", io.BytesIO(content))},
                       data={"purpose": "batch"})


def key_id_of(name: str = "bootstrap") -> uuid.UUID:
    with session_scope() as session:
        return session.scalar(select(ApiKey.id).where(ApiKey.name == name, ApiKey.revoked_at.is_(None)))


def stored_bytes(key_id: uuid.UUID) -> int:
    with session_scope() as session:
        return session.scalar(select(KeyUsage.stored_bytes).where(KeyUsage.api_key_id == key_id)) or 0


def counted_from_rows(key_id: uuid.UUID) -> int:
    """What the key's usage must be: its jobs' charges and its files' bytes, summed from the rows."""
    with session_scope() as session:
        jobs = session.scalar(select(func.coalesce(func.sum(Job.stored_bytes), 0)).where(Job.api_key_id == key_id))
        files = session.scalar(select(func.coalesce(func.sum(StoredFile.bytes), 0))
                               .where(StoredFile.api_key_id == key_id))
    return jobs + files


def files_on_disk(files_dir: Path) -> list[Path]:
    return [p for p in files_dir.iterdir() if p.is_file()] if files_dir.is_dir() else []


def temporary_files(files_dir: Path) -> list[Path]:
    return list((files_dir / "tmp").iterdir()) if (files_dir / "tmp").is_dir() else []


def in_parallel(count: int, call) -> list:  # noqa: ANN001
    """`call(i)` from `count` threads released together; their results in order."""
    start, results = threading.Barrier(count), [None] * count

    def run(index: int) -> None:
        start.wait()
        results[index] = call(index)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    return results


# -- stored bytes: uploads --------------------------------------------------------------------------------------

UPLOAD_QUOTA = {"KEVLAYA_QUOTAS__STORED_BYTES_PER_KEY": str(MiB), "KEVLAYA_API__WORKERS": "2"}


@pytest.mark.integration
@pytest.mark.parametrize("env", [UPLOAD_QUOTA], indirect=True)
def test_twenty_parallel_uploads_never_pass_the_keys_quota(env, api):
    """Two API processes; 20 uploads of 100 KiB at once under a 1 MiB quota: at most 10 are kept (before: 18 on
    PostgreSQL), the others get 413 naming the limit, and the disk and the key's usage hold exactly the kept ones."""
    files_dir = Path(env["KEVLAYA_BATCH__FILES_DIR"])
    content = jsonl_bytes(100 * 1024)

    def one(_: int) -> httpx.Response:
        with httpx.Client(base_url=api.base_url, headers=AUTH, timeout=60) as client:
            return upload(client, content)

    answers = in_parallel(20, one)
    kept = [a for a in answers if a.status_code == 200]
    refused = [a for a in answers if a.status_code != 200]
    assert 1 <= len(kept) <= MiB // len(content), [a.text for a in answers]
    assert all(a.status_code == 413 and a.json()["error"]["code"] == "storage_quota_exceeded" for a in refused)
    assert all("KEVLAYA_QUOTAS__STORED_BYTES_PER_KEY" in a.json()["error"]["message"] for a in refused)
    key_id = key_id_of()
    assert stored_bytes(key_id) == counted_from_rows(key_id) == len(kept) * len(content) <= MiB
    assert sorted(p.name for p in files_on_disk(files_dir)) == sorted(a.json()["id"].removeprefix("file-")
                                                                     for a in kept)
    assert temporary_files(files_dir) == []


@pytest.mark.integration
@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)  # the database plays no part here
@pytest.mark.parametrize("env", [{"KEVLAYA_QUOTAS__STORED_BYTES_PER_KEY": str(MiB)}], indirect=True)
def test_an_upload_over_the_quota_stops_as_it_passes_and_leaves_no_file(env, start_process, tmp_path):
    """A 20 MiB upload under a 1 MiB quota is answered 413 while the client is still sending (after 2 MiB), and no
    byte of it stays anywhere: not under the files directory, not in the system's temporary directory."""
    from tests.conftest import start_api

    system_tmp = tmp_path / "system-tmp"
    system_tmp.mkdir()
    api = start_api(start_process, {**env, "TMPDIR": str(system_tmp)})
    api.close()
    files_dir = Path(env["KEVLAYA_BATCH__FILES_DIR"])
    boundary = "quota-test-boundary"
    head = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
            f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"big.jsonl\"\r\n"
            "Content-Type: application/jsonl\r\n\r\n").encode()
    declared = len(head) + 20 * MiB
    with socket.create_connection(("127.0.0.1", int(env["KEVLAYA_API__PORT"])), timeout=10) as sock:
        sock.sendall(f"POST /v1/files HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {API_KEY}\r\n"
                     f"Content-Type: multipart/form-data; boundary={boundary}\r\n"
                     f"Content-Length: {declared}\r\n\r\n".encode() + head)
        chunk = jsonl_bytes(64 * 1024)
        for _ in range(2 * MiB // len(chunk)):
            sock.sendall(chunk)
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            data = sock.recv(65536)  # before: nothing came (the server waited for all 20 MiB), and this timed out
            if not data:
                break
            answer += data
    status_line, _, rest = answer.partition(b"\r\n")
    assert b" 413 " in status_line, answer[:500]
    body = json.loads(rest.partition(b"\r\n\r\n")[2])
    assert body["error"]["code"] == "storage_quota_exceeded" and "KEVLAYA_QUOTAS__STORED_BYTES_PER_KEY" in \
        body["error"]["message"]
    assert temporary_files(files_dir) == [] and files_on_disk(files_dir) == []
    assert list(system_tmp.iterdir()) == []
    assert stored_bytes(key_id_of()) == 0


# -- queued jobs --------------------------------------------------------------------------------------------------

@pytest.mark.integration
@pytest.mark.parametrize("env", [{"KEVLAYA_QUOTAS__QUEUED_JOBS_PER_KEY": "10", "KEVLAYA_API__WORKERS": "2"}],
                         indirect=True)
def test_parallel_submits_never_pass_the_queued_jobs_cap(env, api):
    """40 submits at once to two API processes (no worker: nothing leaves the queue) under a cap of 10: exactly 10
    are queued, the others get 429 naming the limit with Retry-After; another key is not held back."""
    def one(index: int) -> httpx.Response:
        with httpx.Client(base_url=api.base_url, headers=AUTH, timeout=60) as client:
            return client.post("/v1/jobs", json={"adapter": "laya", "input": f"job {index}", "params": TEXT})

    answers = in_parallel(40, one)
    assert sorted({a.status_code for a in answers}) == [202, 429]
    assert sum(a.status_code == 202 for a in answers) == 10
    refused = next(a for a in answers if a.status_code == 429)
    assert refused.json()["error"]["code"] == "queued_jobs_limit" and refused.headers["Retry-After"]
    assert "KEVLAYA_QUOTAS__QUEUED_JOBS_PER_KEY" in refused.json()["error"]["message"]
    with session_scope() as session:
        assert session.scalar(select(func.count()).select_from(Job)) == 10
        _, other = create_key(session, "other")
    another = api.post("/v1/jobs", headers={"Authorization": f"Bearer {other}"},
                       json={"adapter": "laya", "input": "mine", "params": TEXT})
    assert another.status_code == 202, another.text


def test_the_queued_jobs_cap_refuses_a_whole_batch_and_frees_as_jobs_leave_the_queue(client, monkeypatch):
    monkeypatch.setattr(get_settings().quotas, "queued_jobs_per_key", 3)
    body = {"adapter": "kev", "input": "a job", "params": TEXT}
    ids = [client.post("/v1/jobs", json=body, headers=AUTH).json()["id"] for _ in range(2)]
    over = client.post("/v1/jobs/batch", json={"jobs": [body, body]}, headers=AUTH)
    assert over.status_code == 429 and over.json()["error"]["code"] == "queued_jobs_limit", over.text
    assert "2 jobs queued and the limit is 3" in over.json()["error"]["message"]
    assert client.post("/v1/jobs", json=body, headers=AUTH).status_code == 202
    assert client.post("/v1/jobs", json=body, headers=AUTH).status_code == 429
    assert client.delete(f"/v1/jobs/{ids[0]}", headers=AUTH).json()["status"] == "cancelled"
    assert client.post("/v1/jobs", json=body, headers=AUTH).status_code == 202  # a cancelled job is not queued

    # a key's own limit (`kevlaya quotas set`) replaces the setting's
    from cli.main import app

    key_id = key_id_of()
    done = CliRunner().invoke(app, ["quotas", "set", str(key_id), "--queued-jobs", "5"])
    assert done.exit_code == 0, done.output
    assert client.post("/v1/jobs/batch", json={"jobs": [body, body]}, headers=AUTH).status_code == 202
    assert client.post("/v1/jobs", json=body, headers=AUTH).status_code == 429
    shown = CliRunner().invoke(app, ["quotas", "show"])
    assert f"{key_id}  bootstrap" in shown.output and "queued 5/5" in shown.output, shown.output


# -- stored bytes: jobs and the batches' files -------------------------------------------------------------------

def test_stored_bytes_count_jobs_and_a_batchs_error_file_and_deleting_frees_them(client, monkeypatch,
                                                                                  service_env):
    """Submits and uploads are refused (413, nothing stored) once the key's jobs and files, the error file a
    cancelled batch wrote included, would pass its stored-bytes limit; deleting the batch gives its bytes back."""
    job = client.post("/v1/jobs", json={"adapter": "kev", "input": "x" * 300, "metadata": {"note": "y" * 6000},
                                        "params": TEXT}, headers=AUTH)
    assert job.status_code == 202
    key_id = key_id_of()
    file_id = upload(client, batch_lines("a", "b", "c")).json()["id"]
    batch = client.post("/v1/batches", headers=AUTH,
                        json={"input_file_id": file_id, "endpoint": URL, "completion_window": "24h"}).json()
    wait_until(lambda: client.get(f"/v1/batches/{batch['id']}", headers=AUTH).json()["status"] == "in_progress", 30)
    assert client.post(f"/v1/batches/{batch['id']}/cancel", headers=AUTH).status_code == 200
    cancelled = wait_until(lambda: (b := client.get(f"/v1/batches/{batch['id']}", headers=AUTH).json())["status"]
                           == "cancelled" and b, 30)
    with session_scope() as session:
        error_file = session.get(StoredFile, uuid.UUID(cancelled["error_file_id"].removeprefix("file-")))
        lines_bytes = session.scalar(select(func.sum(Job.stored_bytes)).where(Job.file_batch_id.is_not(None)))
    assert error_file.bytes > 0 and lines_bytes > 0
    usage = stored_bytes(key_id)
    assert usage == counted_from_rows(key_id) >= 6300 + len(batch_lines("a", "b", "c")) + error_file.bytes

    monkeypatch.setattr(get_settings().quotas, "stored_bytes_per_key", usage + 1500)
    big = {"adapter": "kev", "input": "small", "metadata": {"note": "z" * 2000}, "params": TEXT}
    refused = client.post("/v1/jobs", json=big, headers=AUTH)
    assert refused.status_code == 413 and refused.json()["error"]["code"] == "storage_quota_exceeded", refused.text
    assert "KEVLAYA_QUOTAS__STORED_BYTES_PER_KEY" in refused.json()["error"]["message"]
    assert upload(client, batch_lines("d") * 10).status_code == 413
    assert stored_bytes(key_id) == usage  # nothing stored, nothing charged

    assert client.delete(f"/v1/batches/{batch['id']}", headers=AUTH).json()["deleted"]
    assert stored_bytes(key_id) == counted_from_rows(key_id) == usage - error_file.bytes - lines_bytes
    assert client.post("/v1/jobs", json=big, headers=AUTH).status_code == 202


# -- DELETE /v1/jobs/{id} ------------------------------------------------------------------------------------------

def test_delete_cancels_a_queued_job_deletes_a_finished_one_and_refuses_a_running_one(client):
    submit = {"adapter": "auto", "input": "Options: A; B.", "metadata": {"m": "v" * 500}, "params": TEXT}
    queued = client.post("/v1/jobs", json=submit, headers=AUTH).json()["id"]
    key_id = key_id_of()
    charged = stored_bytes(key_id)
    assert charged > 500
    cancelled = client.delete(f"/v1/jobs/{queued}", headers=AUTH)
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
    deleted = client.delete(f"/v1/jobs/{queued}", headers=AUTH)
    assert deleted.status_code == 200 and deleted.json() == {"id": queued, "deleted": True}
    assert client.get(f"/v1/jobs/{queued}", headers=AUTH).status_code == 404
    assert client.delete(f"/v1/jobs/{queued}", headers=AUTH).status_code == 404
    assert stored_bytes(key_id) == 0

    running = client.post("/v1/jobs", json=submit, headers=AUTH).json()["id"]
    with write_scope() as session:
        group = uuid.uuid4()
        from shared.models import ClaimGroup

        session.add(ClaimGroup(id=group, adapters="laya", worker="test"))
        session.flush()
        lifecycle.claim(session, [uuid.UUID(running)], group, "test", 60)
    refused = client.delete(f"/v1/jobs/{running}", headers=AUTH)
    assert refused.status_code == 409 and "running" in refused.json()["error"]["message"]

    with session_scope() as session:
        _, other = create_key(session, "other")
    assert client.delete(f"/v1/jobs/{running}", headers={"Authorization": f"Bearer {other}"}).status_code == 404


# -- retention ------------------------------------------------------------------------------------------------------

def test_retention_deletes_old_finished_jobs_files_and_batches_and_frees_their_bytes(client, monkeypatch,
                                                                                      service_env):
    import api.batch.keeper

    files_dir = Path(service_env["KEVLAYA_BATCH__FILES_DIR"])
    body = {"adapter": "laya", "input": "old", "params": TEXT}
    old_jobs = [client.post("/v1/jobs", json=body, headers=AUTH).json()["id"] for _ in range(3)]
    for job_id in old_jobs:
        assert client.delete(f"/v1/jobs/{job_id}", headers=AUTH).json()["status"] == "cancelled"
    old_file = upload(client, batch_lines("a", "b")).json()["id"]
    batch = client.post("/v1/batches", headers=AUTH,
                        json={"input_file_id": old_file, "endpoint": URL, "completion_window": "24h"}).json()
    wait_until(lambda: client.get(f"/v1/batches/{batch['id']}", headers=AUTH).json()["status"] == "in_progress", 30)
    client.post(f"/v1/batches/{batch['id']}/cancel", headers=AUTH)
    wait_until(lambda: client.get(f"/v1/batches/{batch['id']}", headers=AUTH).json()["status"] == "cancelled", 30)
    assert len(files_on_disk(files_dir)) == 2  # the input and the error file

    two_days_ago = datetime.now(timezone.utc) - timedelta(days=2)
    with write_scope() as session:
        session.execute(update(Job).values(finished_at=two_days_ago, created_at=two_days_ago))
        session.execute(update(StoredFile).values(created_at=two_days_ago))
        session.execute(update(FileBatch).values(cancelled_at=two_days_ago))
    fresh = client.post("/v1/jobs", json=body, headers=AUTH).json()["id"]
    with write_scope() as session:
        lifecycle.cancel(session, uuid.UUID(fresh))
    key_id = key_id_of()

    monkeypatch.setattr(get_settings().quotas, "retention_s", 86400)
    monkeypatch.setattr(api.batch.keeper, "HOUSEKEEPING_S", 0.2)
    client.app.state.batch_keeper.kick()

    def swept() -> bool:
        with session_scope() as session:
            return (session.scalar(select(func.count()).select_from(FileBatch)) == 0
                    and session.scalar(select(func.count()).select_from(StoredFile)) == 0
                    and session.scalar(select(func.count()).select_from(Job)) == 1)

    wait_until(swept, 30, what="the retention sweep")
    assert client.get(f"/v1/jobs/{fresh}", headers=AUTH).json()["status"] == JobStatus.CANCELLED
    assert all(client.get(f"/v1/jobs/{job_id}", headers=AUTH).status_code == 404 for job_id in old_jobs)
    assert client.get(f"/v1/batches/{batch['id']}", headers=AUTH).status_code == 404
    assert files_on_disk(files_dir) == []
    with session_scope() as session:
        fresh_bytes = session.scalar(select(Job.stored_bytes).where(Job.id == uuid.UUID(fresh)))
    assert stored_bytes(key_id) == fresh_bytes > 0


@pytest.mark.integration
@pytest.mark.parametrize("env", [{"KEVLAYA_CASCADE__THRESHOLD": "1"}], indirect=True)  # every `auto` job escalates
def test_answers_stored_by_the_worker_are_charged_and_deleting_gives_everything_back(env, api, start_process):
    """A real worker's answers (an escalated `auto` job's stages too) are charged to the key in the transactions
    that store them: the key's usage equals its rows' sum, and deleting the jobs brings it back to 0."""
    from tests.conftest import start_worker, submit, wait_finished

    start_worker(start_process, env, api)
    ids = [submit(api, adapter, f"Options: A; B. {adapter}", max_new_tokens=8) for adapter in ("kev", "laya", "auto")]
    jobs = wait_finished(api, ids)
    assert all(job["status"] in ("succeeded", "failed") for job in jobs)
    key_id = key_id_of()
    with session_scope() as session:
        requests = sum(len(json.dumps(row.input)) for row in session.scalars(select(Job)))
        stages = session.scalar(select(func.count()).select_from(Job).where(Job.parent_job_id.is_not(None)))
    assert stages == 2  # Laya's and Kev's stages of the `auto` job
    assert stored_bytes(key_id) == counted_from_rows(key_id) > requests
    for job_id in ids:
        assert api.delete(f"/v1/jobs/{job_id}").json() == {"id": job_id, "deleted": True}
    with session_scope() as session:
        assert session.scalar(select(func.count()).select_from(Job)) == 0
    assert stored_bytes(key_id) == 0
