"""Keys (RELIABILITY.md, Security; issue 58): a new `KEVLAYA_API__KEY` revokes the old bootstrap key, a key set by hand
must be hard to guess, failed authentications are throttled per client address across API processes, and a key's
rate limit counts jobs in a moving window. Real API processes, a real Redis, loopback only."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from shared.db import session_scope
from shared.keys import BOOTSTRAP_NAME, create_key, generate_key, weak_key_problem
from shared.models import ApiKey
from tests.conftest import API_KEY, AUTH, free_port, reset_process_state, start_api, wait_until

NEW_KEY = "kl_rotated_bootstrap_key_9b1d7e03c5a2f46e81"
JOB = {"adapter": "laya", "input": "pick the cheapest option"}


def kevlaya(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cli", *args], env={**os.environ, **env}, capture_output=True,
                          text=True, timeout=120)


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def app_client(monkeypatch: pytest.MonkeyPatch, **env: str) -> TestClient:
    """A fresh app in this process with `env` on top of the test's settings (the caller enters it)."""
    from api.main import create_app

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("KEVLAYA_API__WRITER", "thread")
    reset_process_state()
    return TestClient(create_app(), raise_server_exceptions=False)


# -- the bootstrap key ---------------------------------------------------------------------------------------------

def test_a_new_api_key_value_revokes_the_old_one_at_the_api_start(env, start_process):
    """The issue's case: the old value still got 200 on /v1/stats after a restart with a new one."""
    first = start_api(start_process, env)
    assert first.get("/v1/stats").status_code == 200
    made = kevlaya("keys", "create", "ci-bot", env=env)
    assert made.returncode == 0, made.stderr
    made_key = made.stdout.split("key:")[1].split()[0]
    first.close()
    start_process.started[-1].stop()

    restarted = start_api(start_process, {**env, "KEVLAYA_API__KEY": NEW_KEY})
    try:
        old = restarted.get("/v1/stats", headers=bearer(API_KEY))  # before any use of the new value
        assert old.status_code == 401 and "revoked" in old.json()["error"]["message"]
        assert restarted.get("/v1/stats", headers=bearer(NEW_KEY)).status_code == 200
        assert restarted.get("/v1/jobs", headers=bearer(made_key)).status_code == 200  # `keys create`'s stays valid
    finally:
        restarted.close()
    assert "1 earlier bootstrap key(s) revoked" in start_process.started[-1].output()


def test_the_first_use_of_a_new_value_revokes_the_old_one_and_an_older_value_never_wins(client, monkeypatch):
    """Several API processes: one still on the old value neither revives it nor revokes the new one, whichever
    starts or is used last; a value rotated back to stays revoked."""
    from api.keys.bootstrap import retire_replaced_keys

    assert client.get("/v1/jobs", headers=AUTH).status_code == 200
    with session_scope() as session:
        _, made_key = create_key(session, "ci-bot")
    with app_client(monkeypatch, KEVLAYA_API__KEY=NEW_KEY) as rotated:  # no start hook: the first use does it
        assert rotated.get("/v1/jobs", headers=bearer(NEW_KEY)).status_code == 200
        assert rotated.get("/v1/jobs", headers=bearer(API_KEY)).status_code == 401
        # an API process still on the old value, restarted: its start revokes nothing newer, its value stays revoked
        monkeypatch.setenv("KEVLAYA_API__KEY", API_KEY)
        reset_process_state()
        from shared.settings import get_settings

        notes = retire_replaced_keys(get_settings())
        assert any("revoked key" in note for note in notes), notes
        assert client.get("/v1/jobs", headers=AUTH).status_code == 401
        assert rotated.get("/v1/jobs", headers=bearer(NEW_KEY)).status_code == 200
        assert rotated.get("/v1/jobs", headers=bearer(made_key)).status_code == 200
    with session_scope() as session:
        rows = session.scalars(select(ApiKey).where(ApiKey.name == BOOTSTRAP_NAME)).all()
    assert sorted(row.revoked_at is None for row in rows) == [False, True]


def test_unsetting_the_api_key_revokes_the_bootstrap_key_at_the_start(client, monkeypatch):
    from api.keys.bootstrap import retire_replaced_keys
    from shared.settings import get_settings

    assert client.get("/v1/jobs", headers=AUTH).status_code == 200
    monkeypatch.setenv("KEVLAYA_API__KEY", "")
    reset_process_state()
    assert retire_replaced_keys(get_settings()) == ["KEVLAYA_API__KEY unset: 1 earlier bootstrap key(s) revoked"]
    assert client.get("/v1/jobs", headers=AUTH).status_code == 401


def test_keys_create_keeps_the_bootstrap_name_for_the_api_key(service_env):
    refused = kevlaya("keys", "create", BOOTSTRAP_NAME, "--admin", env=service_env)
    assert refused.returncode == 2 and "KEVLAYA_API__KEY" in refused.stderr


# -- keys set by hand ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("weak", ["secret", "kl_test_bootstrap_key", "a" * 40, "abababababababababababababababab12",
                                  "0123456" * 4])
def test_a_weak_key_is_refused_naming_the_setting_and_the_rule(weak):
    problem = weak_key_problem(weak)
    assert problem and "KEVLAYA_API__KEY" in problem and "at least 32 characters" in problem


def test_made_keys_and_128_random_bits_in_hex_pass():
    assert weak_key_problem(generate_key()) is None
    assert weak_key_problem(API_KEY) is None
    assert weak_key_problem("3f9c1e07b2d84a6f5e0c9b1a7d3e2f48") is None  # `openssl rand -hex 16`


def test_the_api_and_kevlaya_run_refuse_to_start_with_a_weak_key(service_env, tmp_path):
    for command in (["api"], ["run"]):
        done = subprocess.run([sys.executable, "-m", "cli", *command], cwd=tmp_path, capture_output=True, text=True,
                              timeout=120, env={**os.environ, **service_env, "KEVLAYA_API__KEY": "letmein-letmein"})
        assert done.returncode == 2, (command, done.stdout, done.stderr)
        assert "KEVLAYA_API__KEY is too short (15 characters)" in done.stderr
        assert "at least 32 characters" in done.stderr
    assert not (tmp_path / ".kevlaya").exists()  # `kevlaya run` stopped before it made anything


def test_keys_generate_prints_a_key_strong_enough(service_env):
    done = kevlaya("keys", "generate", env=service_env)
    assert done.returncode == 0 and weak_key_problem(done.stdout.strip()) is None


# -- failed authentications ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("env", [{"KEVLAYA_KEYS__AUTH_FAILURES_PER_ADDRESS": "5",
                                  "KEVLAYA_KEYS__AUTH_FAILURE_WINDOW_S": "60"}], indirect=True)
def test_failed_authentications_are_throttled_per_address_across_api_processes(env, start_process):
    first = start_api(start_process, env)
    second = start_api(start_process, {**env, "KEVLAYA_API__PORT": str(free_port())})
    try:
        codes = [first.get("/v1/jobs", headers=bearer(f"kl_guess_{n}")).status_code for n in range(6)]
        assert codes == [401] * 5 + [429], codes
        refused = first.get("/v1/jobs")  # the client's own key, valid: the address is refused whatever it sends
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "too_many_auth_failures"
        assert 0 < int(refused.headers["retry-after"]) <= 60
        assert "KEVLAYA_KEYS__AUTH_FAILURES_PER_ADDRESS" in refused.json()["error"]["message"]
        # the other process counts the same failures: its first guess from the address is already refused
        assert second.get("/v1/jobs", headers=bearer("kl_guess_other")).status_code == 429
        assert second.post("/v1/jobs", json=JOB).status_code == 429
        # another address is not affected
        other = httpx.Client(base_url=first.base_url, headers=AUTH, timeout=30,
                             transport=httpx.HTTPTransport(local_address="127.0.0.2"))
        assert other.get("/v1/jobs").status_code == 200
        other.close()
    finally:
        first.close()
        second.close()


def test_with_redis_away_failures_are_not_counted_and_nobody_is_locked_out(client, monkeypatch, caplog):
    monkeypatch.setenv("KEVLAYA_REDIS__URL", f"redis://127.0.0.1:{free_port()}/0")
    monkeypatch.setenv("KEVLAYA_KEYS__AUTH_FAILURES_PER_ADDRESS", "2")
    reset_process_state()
    caplog.set_level("WARNING", logger="kevlaya.api")
    assert [client.get("/v1/jobs", headers=bearer("kl_wrong")).status_code for _ in range(4)] == [401] * 4
    assert client.get("/v1/jobs", headers=AUTH).status_code == 200
    assert "failed authentication from testclient not counted: Redis unavailable" in caplog.text


# -- rate limits count jobs ----------------------------------------------------------------------------------------

def test_a_rate_limit_counts_jobs_not_requests(client):
    with session_scope() as session:
        _, limited = create_key(session, "bursty", rate_limit_per_minute=10)
    headers = bearer(limited)
    assert client.post("/v1/jobs/batch", headers=headers, json={"jobs": [JOB] * 8}).status_code == 202
    over = client.post("/v1/jobs/batch", headers=headers, json={"jobs": [JOB] * 3})  # one request, 3 jobs: 11 > 10
    assert over.status_code == 429 and over.json()["error"]["code"] == "rate_limited"
    assert 0 < int(over.headers["retry-after"]) <= 60
    assert "10 jobs a minute" in over.json()["error"]["message"]
    assert client.post("/v1/jobs/batch", headers=headers, json={"jobs": [JOB] * 2}).status_code == 202  # 10: fits
    assert client.post("/v1/jobs", headers=headers, json=JOB).status_code == 429
    too_big = client.post("/v1/jobs/batch", headers=bearer(limited), json={"jobs": [JOB] * 11})
    assert too_big.status_code == 429 and "send at most 10 at once" in too_big.json()["error"]["message"]
    assert "retry-after" not in too_big.headers  # waiting never makes it fit
    assert all(client.get("/v1/jobs", headers=headers).status_code == 200 for _ in range(20))  # reads are not counted
    assert client.post("/v1/jobs", headers=AUTH, json=JOB).status_code == 202  # other keys are not affected


def test_the_window_moves(client, monkeypatch):
    """A fixed window let a key spend its rate just before an edge and again just after it; here the jobs of the
    last window are counted, wherever the clock stands."""
    import api.keys.rate

    monkeypatch.setattr(api.keys.rate, "WINDOW_S", 2)
    with session_scope() as session:
        _, limited = create_key(session, "edgy", rate_limit_per_minute=4)
    headers = bearer(limited)
    started = time.monotonic()
    assert client.post("/v1/jobs/batch", headers=headers, json={"jobs": [JOB] * 4}).status_code == 202
    while time.monotonic() - started < 1.5:  # every moment of the window: no room, whatever second it is
        assert client.post("/v1/jobs", headers=headers, json=JOB).status_code == 429
        time.sleep(0.1)
    wait_until(lambda: client.post("/v1/jobs", headers=headers, json=JOB).status_code == 202, 3, interval=0.1,
               what="room once the first jobs left the window")


def test_keys_create_gives_new_keys_the_default_rate_limit(service_env):
    made = kevlaya("keys", "create", "default-bot", env=service_env)
    unlimited = kevlaya("keys", "create", "bulk-bot", "--rate-limit", "0", env=service_env)
    assert "rate limit: 600 jobs a minute" in made.stdout and "rate limit: unlimited" in unlimited.stdout
    with session_scope() as session:
        limits = dict(session.execute(select(ApiKey.name, ApiKey.rate_limit_per_minute)).all())
    assert limits["default-bot"] == 600 and limits["bulk-bot"] is None
