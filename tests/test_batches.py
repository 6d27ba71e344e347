"""The Files and Batch APIs (docs/architecture.md §15): files stored under the service's ids, a batch's lines as
jobs, bad lines in the error file, malformed files, cancel, expiry, keys kept apart, and the official `openai`
client driving the whole flow against a real API process and worker."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from openai import OpenAI
from sqlalchemy import func, select

from shared.db import session_scope
from shared.keys import create_key
from shared.models import Job, Priority, StoredFile
from tests.conftest import AUTH, job_count, start_worker, wait_until

URL = "/v1/chat/completions"
FINAL = ("completed", "failed", "expired", "cancelled")


def line(custom_id: str, model: str = "laya", **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": URL,
            "body": {"model": model, "messages": [{"role": "user", "content": f"Options: A; B. {custom_id}"}],
                     "max_tokens": 4, **body}}


def jsonl(lines: list) -> bytes:
    return "".join((json.dumps(item) if not isinstance(item, str) else item) + "\n" for item in lines).encode()


def upload(client, content: bytes, name: str = "requests.jsonl", headers=AUTH, **fields):  # noqa: ANN001, ANN201
    return client.post("/v1/files", headers=headers, files={"file": (name, io.BytesIO(content))},
                       data={"purpose": "batch", **fields})


def create_batch(client, file_id: str, window: str = "24h", headers=AUTH) -> dict:  # noqa: ANN001
    response = client.post("/v1/batches", headers=headers,
                           json={"input_file_id": file_id, "endpoint": URL, "completion_window": window})
    assert response.status_code == 200, response.text
    return response.json()


def wait_batch(client, batch_id: str, statuses=FINAL, timeout: float = 60) -> dict:  # noqa: ANN001
    def reached():
        batch = client.get(f"/v1/batches/{batch_id}", headers=AUTH).json()
        return batch if batch["status"] in statuses else None

    return wait_until(reached, timeout, interval=0.2, what=f"batch {batch_id} to reach {statuses}")


def content_lines(client, file_id: str | None) -> list[dict]:  # noqa: ANN001
    if file_id is None:
        return []
    response = client.get(f"/v1/files/{file_id}/content", headers=AUTH)
    assert response.status_code == 200, response.text
    return [json.loads(raw) for raw in response.text.splitlines()]


# -- files ----------------------------------------------------------------------------------------------------

def test_an_upload_is_stored_under_the_services_id_whatever_name_it_came_with(client, service_env):
    files_dir = Path(service_env["KEVLAYA_BATCH__FILES_DIR"])
    content = jsonl([line("a"), line("b")])
    response = upload(client, content, name="../../escape\x00.jsonl")
    assert response.status_code == 200, response.text
    stored = response.json()
    assert stored["object"] == "file" and stored["purpose"] == "batch" and stored["bytes"] == len(content)
    assert "\x00" not in stored["filename"]
    assert [p.name for p in files_dir.iterdir() if p.is_file()] == [stored["id"].removeprefix("file-")]
    assert not (files_dir.parent.parent / "escape").exists()
    assert client.get(f"/v1/files/{stored['id']}/content", headers=AUTH).content == content
    assert client.get(f"/v1/files/{stored['id']}", headers=AUTH).json() == stored
    assert [f["id"] for f in client.get("/v1/files", headers=AUTH).json()["data"]] == [stored["id"]]

    deleted = client.delete(f"/v1/files/{stored['id']}", headers=AUTH)
    assert deleted.json() == {"id": stored["id"], "object": "file", "deleted": True}
    assert client.get(f"/v1/files/{stored['id']}/content", headers=AUTH).status_code == 404
    assert [p for p in files_dir.iterdir() if p.is_file()] == []


def test_uploads_are_refused_naming_the_field_or_limit_and_keep_nothing(client, service_env, monkeypatch):
    files_dir = Path(service_env["KEVLAYA_BATCH__FILES_DIR"])
    unknown = upload(client, jsonl([line("a")]), expires="soon")
    assert unknown.status_code == 422 and "expires" in unknown.json()["error"]["message"]
    purpose = client.post("/v1/files", headers=AUTH, files={"file": ("x.jsonl", b"{}\n")},
                          data={"purpose": "fine-tune"})
    assert purpose.status_code == 422 and "purpose" in purpose.json()["error"]["message"]
    no_file = client.post("/v1/files", headers=AUTH, data={"purpose": "batch"},
                          files={"other": ("x", b"")})
    assert no_file.status_code == 422

    from shared.settings import get_settings

    monkeypatch.setattr(get_settings().batch, "files_max_lines", 3)
    too_many = upload(client, jsonl([line(str(i)) for i in range(4)]))
    assert too_many.status_code == 413 and "3 lines" in too_many.json()["error"]["message"]
    monkeypatch.setattr(get_settings().quotas, "stored_bytes_per_key", 2048)
    assert upload(client, jsonl([line("a")])).status_code == 200
    over_quota = upload(client, b" " * 1800 + jsonl([line("b")]))
    assert over_quota.status_code == 413 and over_quota.json()["error"]["code"] == "storage_quota_exceeded"
    assert "KEVLAYA_QUOTAS__STORED_BYTES_PER_KEY" in over_quota.json()["error"]["message"]
    with session_scope() as session:
        assert session.scalar(select(func.count()).select_from(StoredFile)) == 1
    assert len([p for p in files_dir.iterdir() if p.is_file()]) == 1
    assert list((files_dir / "tmp").iterdir()) == []


def test_keys_see_only_their_own_files_and_batches(client):
    with session_scope() as session:
        _, other = create_key(session, "other")
    theirs = {"Authorization": f"Bearer {other}"}
    file_id = upload(client, jsonl([line("a")])).json()["id"]
    batch = create_batch(client, file_id)
    for path in (f"/v1/files/{file_id}", f"/v1/files/{file_id}/content", f"/v1/batches/{batch['id']}"):
        assert client.get(path, headers=theirs).status_code == 404, path
    assert client.get("/v1/files", headers=theirs).json()["data"] == []
    assert client.get("/v1/batches", headers=theirs).json()["data"] == []
    assert client.post(f"/v1/batches/{batch['id']}/cancel", headers=theirs).status_code == 404
    assert client.delete(f"/v1/files/{file_id}", headers=theirs).status_code == 404
    refused = client.post("/v1/batches", headers=theirs,
                          json={"input_file_id": file_id, "endpoint": URL, "completion_window": "24h"})
    assert refused.status_code == 404 and "input_file_id" in refused.json()["error"]["message"]


# -- batches --------------------------------------------------------------------------------------------------

def test_a_batch_is_refused_naming_the_field_it_cannot_honour(client):
    file_id = upload(client, jsonl([line("a")])).json()["id"]
    for body, field in (({"endpoint": "/v1/embeddings"}, "endpoint"), ({"completion_window": "8d"}, "completion_window"),
                        ({"completion_window": "soon"}, "completion_window"), ({"priority": 1}, "priority"),
                        ({"input_file_id": "file-nope"}, "input_file_id")):
        request = {"input_file_id": file_id, "endpoint": URL, "completion_window": "24h", **body}
        response = client.post("/v1/batches", headers=AUTH, json=request)
        assert response.status_code in (404, 422), response.text
        assert field in response.json()["error"]["message"], response.text
    assert job_count() == 0


def test_a_malformed_file_fails_the_whole_batch_and_stores_no_line(client):
    content = jsonl([line("a"), "not json", line("a"), {**line("c"), "url": "/v1/embeddings"}, [1, 2],
                     {**line("d"), "extra": 1}])
    batch = create_batch(client, upload(client, content).json()["id"])
    failed = wait_batch(client, batch["id"])
    assert failed["status"] == "failed" and failed["failed_at"] is not None
    errors = failed["errors"]["data"]
    assert [e["line"] for e in errors] == [2, 3, 4, 5, 6]
    assert [e["code"] for e in errors] == ["invalid_request_line", "duplicate_custom_id", "invalid_request_line",
                                           "invalid_request_line", "invalid_request_line"]
    assert "url" in errors[2]["message"] and "extra" in errors[4]["message"]
    assert job_count() == 0 and failed["output_file_id"] is None and failed["error_file_id"] is None
    empty = wait_batch(client, create_batch(client, upload(client, b"\n\n").json()["id"])["id"])
    assert empty["status"] == "failed" and empty["errors"]["data"][0]["code"] == "empty_file"


def openai_client(env: dict[str, str]) -> OpenAI:
    return OpenAI(base_url=f"http://127.0.0.1:{env['KEVLAYA_API__PORT']}/v1", api_key=env["KEVLAYA_API__KEY"],
                  max_retries=0, timeout=60)


def upload_with(client: OpenAI, tmp_path: Path, lines: list) -> str:
    path = tmp_path / "requests.jsonl"
    path.write_bytes(jsonl(lines))
    return client.files.create(file=path.open("rb"), purpose="batch").id


def wait_for(client: OpenAI, batch_id: str, statuses=FINAL, timeout: float = 60):  # noqa: ANN001, ANN201
    return wait_until(lambda: (b := client.batches.retrieve(batch_id)).status in statuses and b, timeout,
                      interval=0.2, what=f"batch {batch_id} to reach {statuses}")


def error_lines(client: OpenAI, file_id: str | None) -> dict[str, dict]:
    lines = [json.loads(raw) for raw in client.files.content(file_id).text.splitlines()] if file_id else []
    return {line["custom_id"]: line for line in lines}


@pytest.mark.integration
def test_lines_wait_behind_interactive_work_and_cancel_stops_the_queued_ones(env, api, tmp_path):
    """Through the official client against a real API process, with no worker: the lines stay queued."""
    client = openai_client(env)
    bad = [line("hot", temperature="hot"), line("stream", stream=True), line("gpt", model="gpt-4"),
           line("long", max_tokens=10**6)]
    file_id = upload_with(client, tmp_path, [line("a"), *bad, line("b", model="auto")])
    batch = client.batches.create(input_file_id=file_id, endpoint=URL, completion_window="24h")
    running = wait_for(client, batch.id, ("in_progress",))
    assert (running.request_counts.total, running.request_counts.completed, running.request_counts.failed) == (6, 0, 4)
    with session_scope() as session:
        lines = session.scalars(select(Job).order_by(Job.batch_line)).all()
        assert [(j.custom_id, j.batch_line, j.priority) for j in lines] == [("a", 1, Priority.BATCH),
                                                                             ("b", 6, Priority.BATCH)]
    assert client.batches.cancel(batch.id).status in ("cancelling", "cancelled")
    cancelled = wait_for(client, batch.id)
    assert cancelled.status == "cancelled" and cancelled.cancelled_at is not None
    assert (cancelled.request_counts.total, cancelled.request_counts.completed,
            cancelled.request_counts.failed) == (6, 0, 6)
    assert cancelled.output_file_id is None
    errors = error_lines(client, cancelled.error_file_id)
    assert sorted(errors) == ["a", "b", "gpt", "hot", "long", "stream"]
    assert errors["a"]["error"]["code"] == "batch_cancelled" and errors["a"]["response"] is None
    for custom_id, field in (("hot", "temperature"), ("stream", "stream"), ("gpt", "model"), ("long", "max_tokens")):
        response = errors[custom_id]["response"]
        assert response["status_code"] == 422 and field in response["body"]["error"]["message"], errors[custom_id]
        assert isinstance(response["request_id"], str)
    assert client.batches.cancel(batch.id).status == "cancelled"  # again: the batch as it is


@pytest.mark.integration
def test_lines_unfinished_at_the_end_of_the_completion_window_expire_into_the_error_file(env, api, tmp_path):
    client = openai_client(env)
    file_id = upload_with(client, tmp_path, [line("a"), line("b", model="kev")])
    batch = client.batches.create(input_file_id=file_id, endpoint=URL, completion_window="2s")  # type: ignore[arg-type]
    expired = wait_for(client, batch.id, timeout=30)
    assert expired.status == "expired" and expired.expired_at is not None
    assert (expired.request_counts.total, expired.request_counts.completed, expired.request_counts.failed) == (2, 0, 2)
    errors = error_lines(client, expired.error_file_id)
    assert sorted(errors) == ["a", "b"] and {e["error"]["code"] for e in errors.values()} == {"batch_expired"}
    with session_scope() as session:
        assert set(session.scalars(select(Job.status)).all()) == {"cancelled"}
    page = client.batches.list(limit=1)
    assert [b.id for b in page.data] == [batch.id] and not page.has_more

    running = client.batches.create(input_file_id=file_id, endpoint=URL, completion_window="24h")
    assert api.delete(f"/v1/batches/{running.id}").status_code == 409  # not finished: cancel it first
    deleted = api.delete(f"/v1/batches/{batch.id}")  # a finished one goes, with its lines and files
    assert deleted.json() == {"id": batch.id, "object": "batch", "deleted": True}
    assert api.get(f"/v1/batches/{batch.id}").status_code == 404
    assert api.get(f"/v1/files/{expired.error_file_id}/content").status_code == 404
    assert not (Path(env["KEVLAYA_BATCH__FILES_DIR"]) / expired.error_file_id.removeprefix("file-")).exists()
    assert client.files.retrieve(file_id).id == file_id  # the upload stays
    wait_for(client, running.id, ("in_progress",))  # its lines are jobs once it is in progress, not at creation
    with session_scope() as session:
        assert session.scalar(select(func.count()).select_from(Job).where(Job.file_batch_id.is_not(None))) == 2


# -- the official client, a real API process and worker --------------------------------------------------------

@pytest.mark.integration
def test_the_official_openai_client_drives_a_batch_from_upload_to_output(env, api, start_process, tmp_path):
    start_worker(start_process, env, api)
    client = OpenAI(base_url=f"http://127.0.0.1:{env['KEVLAYA_API__PORT']}/v1", api_key=env["KEVLAYA_API__KEY"],
                    max_retries=0, timeout=60)
    requests = [line(f"r{i}", model=("laya", "kev", "auto")[i % 3]) for i in range(9)]
    path = tmp_path / "requests.jsonl"
    path.write_bytes(jsonl([*requests, line("bad", top_p=7), line("nobody", model="zed")]))
    uploaded = client.files.create(file=path.open("rb"), purpose="batch")
    assert uploaded.purpose == "batch" and uploaded.bytes == path.stat().st_size
    batch = client.batches.create(input_file_id=uploaded.id, endpoint=URL, completion_window="24h",
                                  metadata={"run": "test"})
    batch = wait_until(lambda: (b := client.batches.retrieve(batch.id)).status in FINAL and b, 180, interval=0.5,
                       what="the batch to finish")
    assert batch.status == "completed" and batch.metadata == {"run": "test"}
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (11, 9, 2)
    output = [json.loads(raw) for raw in client.files.content(batch.output_file_id).text.splitlines()]
    assert sorted(o["custom_id"] for o in output) == sorted(r["custom_id"] for r in requests)  # each exactly once
    for result in output:
        body = result["response"]["body"]
        job = api.get(f"/v1/jobs/{result['response']['request_id']}").json()
        assert result["response"]["status_code"] == 200 and body["object"] == "chat.completion"
        assert body["choices"][0]["message"]["content"] == job["result"]["text"]
        assert body["model"] == job["requested_adapter"]
    bad, nobody = sorted((json.loads(raw) for raw in client.files.content(batch.error_file_id).text.splitlines()),
                         key=lambda e: e["custom_id"])
    assert bad["custom_id"] == "bad" and "top_p" in bad["response"]["body"]["error"]["message"]
    # a model no load made a role: refused alone, naming it, as the live endpoint refuses it
    assert nobody["custom_id"] == "nobody" and nobody["response"]["status_code"] == 422
    assert nobody["response"]["body"]["error"]["message"].startswith("model: 'zed' is not a role")
    assert batch.id in [b.id for b in client.batches.list(limit=5)]
    assert {f.id for f in client.files.list()} == {uploaded.id, batch.output_file_id, batch.error_file_id}
    assert client.files.delete(uploaded.id).deleted


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)  # the database plays no part here
def test_an_empty_page_cursor_is_refused_naming_it_not_read_as_no_cursor(client):
    for path in ("/v1/batches", "/v1/files"):
        response = client.get(f"{path}?after=", headers=AUTH)
        assert response.status_code == 422, (path, response.text)
        assert "after" in response.text


def test_an_output_line_stays_one_line_whatever_characters_the_answer_holds():
    """A model's text can hold U+2028, U+2029 or U+0085, which JSON leaves raw and `str.splitlines()` (and other
    JSONL readers) take for line ends: seen as an output file whose lines no longer parsed."""
    from api.batch.file_batches import jsonl_line

    line = {"custom_id": "a", "response": {"body": {"text": "x\u2028y\u2029z\x85w\nv\x1c"}}}
    written = b"".join(jsonl_line(line) for _ in range(3)).decode()
    assert [json.loads(raw) for raw in written.splitlines()] == [line] * 3
