"""The REST contract through the real app, a real database (SQLite and PostgreSQL) and a real Redis:
validation, auth, idempotency, pagination, visibility, cancel. No worker runs here."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from shared.db import session_scope
from shared.keys import create_key
from tests.conftest import AUTH, job_count


def submit(client: TestClient, adapter: str = "laya", prompt: str = "pick the cheapest option", **extra):
    return client.post("/v1/jobs", json={"adapter": adapter, "input": prompt, **extra}, headers=AUTH)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"adapter": "bob", "input": "x"}, "adapter"),
        ({"adapter": "kev", "input": ""}, "input"),
        ({"adapter": "kev", "input": "   "}, "input"),
        ({"adapter": "kev", "input": {"messages": []}}, "input.messages"),
        ({"adapter": "kev", "input": {"messages": [{"role": "robot", "content": "hi"}]}}, "input.messages.0.role"),
        ({"adapter": "kev", "input": 42}, "input"),
        ({"adapter": "kev", "input": "x", "params": {"max_new_tokens": "many"}}, "params.max_new_tokens"),
        ({"adapter": "kev", "input": "x", "params": {"max_new_tokens": 0}}, "params.max_new_tokens"),
        ({"adapter": "kev", "input": "x", "params": {"max_new_tokens": 100_000}}, "params.max_new_tokens"),
        ({"adapter": "kev", "input": "x", "params": {"temperature": -1}}, "params.temperature"),
        ({"adapter": "kev", "input": "x", "params": {"beam": 4}}, "params.beam"),
        ({"adapter": "kev", "input": "x" * 20_000}, "input"),
        ({"input": "x"}, "adapter"),
    ],
)
def test_bad_input_is_refused_naming_the_field_and_nothing_is_stored(client, body, field):
    response = client.post("/v1/jobs", json=body, headers=AUTH)
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["code"] == "invalid_request"
    assert error["message"].startswith(field) or f"{field}:" in error["message"], error["message"]
    assert job_count() == 0


def test_malformed_json_is_refused(client):
    response = client.post("/v1/jobs", content=b"{not json", headers={**AUTH, "Content-Type": "application/json"})
    assert response.status_code == 422
    assert job_count() == 0


def test_oversized_body_gets_413_and_nothing_is_stored(client, service_env):
    response = submit(client, prompt="y" * 2_000_000)
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "payload_too_large"
    assert job_count() == 0


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer nope"}, {"Authorization": "Basic abc"}])
def test_missing_or_wrong_key_is_401(client, headers):
    response = client.post("/v1/jobs", json={"adapter": "kev", "input": "x"}, headers=headers)
    assert response.status_code == 401
    assert response.headers["www-authenticate"] == "Bearer"
    assert job_count() == 0


def test_revoked_key_is_401_and_created_keys_only_see_their_own_jobs(client):
    with session_scope() as session:
        _, alice = create_key(session, "alice")
        revoked_row, revoked = create_key(session, "old")
        from datetime import datetime, timezone

        revoked_row.revoked_at = datetime.now(timezone.utc)
    assert client.get("/v1/jobs", headers={"Authorization": f"Bearer {revoked}"}).status_code == 401

    mine = client.post("/v1/jobs", json={"adapter": "kev", "input": "x"}, headers={"Authorization": f"Bearer {alice}"})
    admin_job = submit(client)
    assert mine.status_code == admin_job.status_code == 202
    alice_headers = {"Authorization": f"Bearer {alice}"}
    listed = client.get("/v1/jobs", headers=alice_headers).json()["jobs"]
    assert [j["id"] for j in listed] == [mine.json()["id"]]
    assert client.get(f"/v1/jobs/{admin_job.json()['id']}", headers=alice_headers).status_code == 404
    # the bootstrap key is an admin: it sees both
    assert len(client.get("/v1/jobs", headers=AUTH).json()["jobs"]) == 2


def test_submit_returns_202_with_location_and_the_row_is_queued(client):
    response = submit(client, adapter="auto", metadata={"ticket": 7})
    assert response.status_code == 202
    body = response.json()
    assert body["status"] == "queued" and body["adapter"] == "auto"
    assert response.headers["location"] == f"/v1/jobs/{body['id']}"
    job = client.get(response.headers["location"], headers=AUTH).json()
    assert job["requested_adapter"] == "auto" and job["adapter"] == "laya"  # the cascade starts with Laya
    assert job["metadata"] == {"ticket": 7} and job["result"] is None and job["attempts"] == 0


def test_idempotency_key_returns_the_existing_job(client):
    first = submit(client, idempotency_key="order-1")
    again = submit(client, idempotency_key="order-1", prompt="something else")
    assert first.status_code == 202 and again.status_code == 200
    assert again.json()["id"] == first.json()["id"]
    assert job_count() == 1


def test_batch_submit_validates_all_before_storing_any(client):
    bad = client.post("/v1/jobs/batch", headers=AUTH, json={"jobs": [
        {"adapter": "kev", "input": "fine"}, {"adapter": "laya", "input": ""}]})
    assert bad.status_code == 422 and "jobs.1.input" in bad.json()["error"]["message"]
    assert job_count() == 0

    good = client.post("/v1/jobs/batch", headers=AUTH, json={"jobs": [
        {"adapter": "kev", "input": "a"}, {"adapter": "laya", "input": "b", "idempotency_key": "k"},
        {"adapter": "laya", "input": "b again", "idempotency_key": "k"}]})
    assert good.status_code == 202
    ids = [j["id"] for j in good.json()["jobs"]]
    assert len(ids) == 3 and ids[1] == ids[2]
    assert job_count() == 2


def test_list_paginates_with_a_cursor_and_filters(client):
    created = [submit(client, adapter="kev" if i % 2 else "laya", prompt=f"p{i}").json()["id"] for i in range(7)]
    seen, cursor = [], None
    while True:
        params = {"limit": 3, **({"cursor": cursor} if cursor else {})}
        page = client.get("/v1/jobs", params=params, headers=AUTH).json()
        seen += [j["id"] for j in page["jobs"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert seen == list(reversed(created))  # newest first, each exactly once
    kev = client.get("/v1/jobs", params={"adapter": "kev"}, headers=AUTH).json()["jobs"]
    assert {j["adapter"] for j in kev} == {"kev"} and len(kev) == 3
    assert client.get("/v1/jobs", params={"status": "running"}, headers=AUTH).json()["jobs"] == []


@pytest.mark.parametrize("params", [{"cursor": "garbage"}, {"limit": 0}, {"status": "done"}, {"adapter": "bob"}])
def test_bad_list_queries_are_4xx_naming_the_parameter(client, params):
    response = client.get("/v1/jobs", params=params, headers=AUTH)
    assert response.status_code in (400, 422)
    assert next(iter(params)) in response.json()["error"]["message"]


def test_delete_cancels_a_queued_job_then_deletes_it_once_finished(client):
    job_id = submit(client).json()["id"]
    cancelled = client.delete(f"/v1/jobs/{job_id}", headers=AUTH)
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
    again = client.delete(f"/v1/jobs/{job_id}", headers=AUTH)
    assert again.status_code == 200 and again.json() == {"id": job_id, "deleted": True}
    assert client.delete(f"/v1/jobs/{job_id}", headers=AUTH).status_code == 404


def test_cancel_stops_a_queued_job_and_never_deletes_a_finished_one(client):
    """DELETE of a finished job deletes it; a client that only wants a job stopped, and asks after it finished,
    must not lose its answer."""
    job_id = submit(client).json()["id"]
    cancelled = client.post(f"/v1/jobs/{job_id}/cancel", headers=AUTH)
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
    again = client.post(f"/v1/jobs/{job_id}/cancel", headers=AUTH)
    assert again.status_code == 409 and "cancelled" in again.json()["error"]["message"]
    assert client.get(f"/v1/jobs/{job_id}", headers=AUTH).json()["status"] == "cancelled"  # still there
    assert client.post("/v1/jobs/00000000-0000-0000-0000-000000000000/cancel", headers=AUTH).status_code == 404


def test_unknown_job_is_404_and_bad_id_is_422(client):
    assert client.get("/v1/jobs/00000000-0000-0000-0000-000000000000", headers=AUTH).status_code == 404
    assert client.get("/v1/jobs/not-a-uuid", headers=AUTH).status_code == 422


def test_wait_returns_the_current_state_at_the_timeout(client):
    job_id = submit(client).json()["id"]
    waited = client.get(f"/v1/jobs/{job_id}/wait", params={"timeout": 0.3}, headers=AUTH)
    assert waited.status_code == 200 and waited.json()["status"] == "queued"
    assert client.get(f"/v1/jobs/{job_id}/wait", params={"timeout": 3600}, headers=AUTH).status_code == 422


def test_health_needs_no_key_and_readiness_reports_the_missing_worker(client):
    assert client.get("/healthz").json() == {"status": "ok"}
    ready = client.get("/readyz")
    assert ready.status_code == 503
    checks = ready.json()["checks"]
    assert checks["database"] == "ok" and checks["redis"] == "ok" and checks["worker"] != "ok"


def test_fastapi_telemetry_stays_off_unless_its_auto_configuration_is_asked_for(monkeypatch):
    """Told once that no OpenTelemetry provider will show up (not asked on every request), unless FastAPI is to
    configure one itself; then its defaults apply."""
    from api.main import create_app, telemetry_config

    monkeypatch.delenv("FASTAPI_OTEL_AUTO_CONFIGURE", raising=False)
    off = telemetry_config()
    assert off is not None and not any(off.get(part) for part in ("tracing", "metrics", "logs", "operation_spans"))
    monkeypatch.setenv("FASTAPI_OTEL_AUTO_CONFIGURE", "true")
    assert telemetry_config() is None
    assert create_app()._telemetry["tracing"] is True  # FastAPI's own default, untouched
