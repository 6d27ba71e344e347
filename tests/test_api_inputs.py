"""What the API accepts must be storable, readable and runnable: text that no database or tokenizer can take,
non-finite numbers, temperatures that overflow sampling and prompts longer than the model's context are
refused with 422 naming the field, on SQLite and PostgreSQL. Also the OpenAI-compatible shapes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from shared.db import session_scope
from shared.models import Job
from shared.settings import get_settings
from tests.conftest import AUTH, job_count

ROOT = Path(__file__).resolve().parents[1]


def post_raw(client: TestClient, path: str, raw: str) -> object:
    """`raw` is sent as written: JSON escapes such as \\ud800 or NaN reach the server as a client sent them."""
    return client.post(path, content=raw.encode(), headers={**AUTH, "Content-Type": "application/json"})


def assert_refused(response, field: str) -> None:  # noqa: ANN001
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["code"] == "invalid_request"
    assert error["message"].startswith(field) or f"{field}:" in error["message"], error["message"]


BAD_JOBS = [
    # lone surrogates: stored, then unreadable (every read answered 500) and untokenizable (failed the batch)
    ('{"adapter": "kev", "input": "pick \\ud800 one"}', "input"),
    ('{"adapter": "kev", "input": {"messages": [{"role": "user", "content": "\\udfff"}]}}',
     "input.messages.0.content"),
    ('{"adapter": "kev", "input": {"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}}',
     "input.messages.0.content"),
    ('{"adapter": "kev", "input": "x", "idempotency_key": "k\\ud800"}', "idempotency_key"),
    ('{"adapter": "kev", "input": "x", "metadata": {"note": "\\ud800"}}', "metadata"),
    ('{"adapter": "kev", "input": "x", "metadata": {"\\ud800": 1}}', "metadata"),
    # NUL: PostgreSQL refuses it in text columns
    ('{"adapter": "kev", "input": "a\\u0000b"}', "input"),
    ('{"adapter": "kev", "input": "x", "idempotency_key": "a\\u0000b"}', "idempotency_key"),
    ('{"adapter": "kev", "input": "x", "metadata": {"deep": [{"v": "a\\u0000"}]}}', "metadata"),
    # non-finite numbers: not JSON, cannot be answered back
    ('{"adapter": "kev", "input": "x", "params": {"temperature": NaN}}', "params.temperature"),
    ('{"adapter": "kev", "input": "x", "params": {"top_p": NaN}}', "params.top_p"),
    ('{"adapter": "kev", "input": "x", "metadata": {"score": Infinity}}', "metadata"),
    ('{"adapter": "kev", "input": "x", "metadata": {"score": NaN}}', "metadata"),
    # temperatures in (0, 0.01) make sampling overflow to NaN and failed the whole batch
    ('{"adapter": "kev", "input": "x", "params": {"temperature": 1e-45}}', "params.temperature"),
    ('{"adapter": "kev", "input": "x", "params": {"temperature": 0.001}}', "params.temperature"),
    # numbers no store or client takes back
    ('{"adapter": "kev", "input": "x", "params": {"seed": 1' + "0" * 30 + '}}', "params.seed"),
    ('{"adapter": "kev", "input": "x", "metadata": {"n": 1' + "0" * 30 + '}}', "metadata"),
    ('{"adapter": "kev", "input": "x", "metadata": ' + '{"a": ' * 40 + "1" + "}" * 40 + "}", "metadata"),
    # content parts: text only, never empty
    ('{"adapter": "kev", "input": {"messages": [{"role": "user", "content": []}]}}', "input.messages.0.content"),
    ('{"adapter": "kev", "input": {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}}',
     "input.messages.0.content"),
    # loose types: a boolean or a numeric string was taken as the number it resembles (`true` ran as 1 token)
    ('{"adapter": "kev", "input": "x", "params": {"max_new_tokens": true}}', "params.max_new_tokens"),
    ('{"adapter": "kev", "input": "x", "params": {"max_new_tokens": "5"}}', "params.max_new_tokens"),
    ('{"adapter": "kev", "input": "x", "params": {"temperature": "0.5"}}', "params.temperature"),
    ('{"adapter": "kev", "input": "x", "params": {"top_p": false}}', "params.top_p"),
    ('{"adapter": "kev", "input": "x", "params": {"seed": true}}', "params.seed"),
    ('{"adapter": "kev", "input": "x", "params": {"output": "text", "logprobs": 1}}', "params.logprobs"),
    ('{"adapter": "kev", "input": 5}', "input"),
    ('{"adapter": "kev", "input": "x", "idempotency_key": 7}', "idempotency_key"),
    # blank text is not input: it was queued and answered
    ('{"adapter": "kev", "input": " \\n\\t "}', "input"),
    ('{"adapter": "kev", "input": {"messages": [{"role": "user", "content": "   "}]}}', "input.messages.0.content"),
    ('{"adapter": "kev", "input": {"messages": [{"role": "user", "content": [{"type": "text", "text": " "}]}]}}',
     "input.messages.0.content"),
    ('{"adapter": "kev", "input": "x", "idempotency_key": "  "}', "idempotency_key"),
]


@pytest.mark.parametrize(("raw", "field"), BAD_JOBS)
def test_what_can_never_run_is_refused_naming_the_field(client, raw, field):
    assert_refused(post_raw(client, "/v1/jobs", raw), field)
    assert job_count() == 0
    assert client.get("/v1/jobs", headers=AUTH).status_code == 200


@pytest.mark.parametrize(("raw", "field"), [
    ('{"model": "kev", "messages": [{"role": "user", "content": "\\ud800"}]}', "messages.0.content"),
    ('{"model": "kev", "messages": [{"role": "user", "content": "x"}], "temperature": 1e-45}', "temperature"),
    ('{"model": "kev", "messages": [{"role": "user", "content": "x"}], "temperature": NaN}', "temperature"),
    ('{"model": "kev", "messages": [{"role": "user", "content": "x"}], "seed": 1' + "0" * 30 + "}", "seed"),
    ('{"model": "kev", "messages": [{"role": "user", "content": "x"}], "max_tokens": true}', "max_tokens"),
    ('{"model": "kev", "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": "9"}',
     "max_completion_tokens"),
    ('{"model": "kev", "messages": [{"role": "user", "content": "x"}], "temperature": "1"}', "temperature"),
    ('{"model": "kev", "messages": [{"role": "user", "content": "x"}], "n": true}', "n"),
    ('{"model": "kev", "messages": [{"role": "user", "content": "x"}], "stream": 0}', "stream"),
    ('{"model": "kev", "messages": [{"role": "user", "content": "x"}], "logprobs": "yes"}', "logprobs"),
    ('{"model": "kev", "messages": [{"role": "user", "content": " "}]}', "messages.0.content"),
])
def test_chat_completions_refuse_the_same_inputs_naming_their_own_fields(client, raw, field):
    assert_refused(post_raw(client, "/v1/chat/completions", raw), field)
    assert job_count() == 0


def test_edge_values_that_can_run_are_accepted(client):
    accepted = post_raw(client, "/v1/jobs", json.dumps({
        "adapter": "kev", "input": "choose \U0001f600 \u00e9", "idempotency_key": "k-\u00e9",
        "params": {"temperature": 0, "seed": 2**31 - 1, "top_p": 1e-9},
        "metadata": {"n": 2**63 - 1, "x": -1.5e300, "nested": [{"ok": True}]},
    }))
    assert accepted.status_code == 202, accepted.text
    job = client.get(f"/v1/jobs/{accepted.json()['id']}", headers=AUTH).json()
    assert job["input"] == "choose \U0001f600 \u00e9" and job["metadata"]["n"] == 2**63 - 1
    again = post_raw(client, "/v1/jobs", json.dumps({"adapter": "laya", "input": "x", "params": {"temperature": 0.01}}))
    assert again.status_code == 202, again.text


def test_rows_stored_before_the_check_stay_readable(client):
    """A row holding a lone surrogate (stored before input was checked) must not make reads and lists 500."""
    from datetime import datetime, timezone

    from shared.keys import ensure_bootstrap_key
    from tests.conftest import API_KEY

    job_id = uuid.uuid4()
    with session_scope() as session:
        key = ensure_bootstrap_key(session, API_KEY)
        session.add(Job(id=job_id, adapter="kev", requested_adapter="kev", status="failed", input="a\ud800b",
                        params={}, meta={"k": "\udfff"}, api_key_id=key.id, created_at=datetime.now(timezone.utc),
                        error_code="internal", error_message="x"))
    read = client.get(f"/v1/jobs/{job_id}", headers=AUTH)
    assert read.status_code == 200, read.text
    assert read.json()["input"] == "a\ufffdb" and read.json()["metadata"] == {"k": "\ufffd"}
    listed = client.get("/v1/jobs", headers=AUTH)
    assert listed.status_code == 200 and listed.json()["jobs"][0]["id"] == str(job_id)


# -- prompt tokens against the model's context -------------------------------------------------------------

def context_tokens() -> int:
    return json.loads((ROOT / get_settings().model.base / "config.json").read_text())["max_position_embeddings"]


def test_a_prompt_longer_than_the_context_is_refused_at_submit_naming_the_limit(client):
    # Under the character limit, but each of these words is a few tokens: far over the 1,024-token context.
    prompt = " ".join(f"q{i}z" for i in range(2000))
    assert len(prompt) < get_settings().limits.prompt_chars
    response = client.post("/v1/jobs", json={"adapter": "laya", "input": prompt}, headers=AUTH)
    assert_refused(response, "input")
    assert f"context of {context_tokens()} tokens" in response.json()["error"]["message"]
    chat = client.post("/v1/chat/completions", headers=AUTH,
                       json={"model": "kev", "messages": [{"role": "user", "content": prompt}]})
    assert_refused(chat, "messages")
    assert job_count() == 0


def test_the_prompt_bound_never_lets_through_what_the_count_refuses(client):
    """Short ASCII prompts are accepted from a bound (no tokenizing); whenever the bound says a prompt fits, the
    exact count agrees, however close to the limit. Non-ASCII text is always counted."""
    import random

    budget = client.app.state.intake.budget
    system = get_settings().kev.system_prompt
    rng = random.Random(7)
    alphabet = "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,;:!?-'\"<>{}[]()|\n\t"
    trusted = 0
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 900)))
        messages = [{"role": "system", "content": system}, {"role": "user", "content": text}]
        exact = budget.prompt_tokens(messages)
        for room in (exact - 1, exact, exact + 20, exact + 400, 2 * len(text) + 400):
            if budget.surely_within(messages, room):
                assert exact <= room, (text, room)
                trusted += 1
    assert trusted > 100  # the bound does decide most roomy cases
    short = [{"role": "system", "content": system}, {"role": "user", "content": "Ship on Friday?"}]
    assert budget.surely_within(short, 1000)
    assert not budget.surely_within([*short[:1], {"role": "user", "content": "Livrer vendredi ? é"}], 1000)


def test_max_new_tokens_counts_against_the_context(client):
    budget = client.app.state.intake.budget
    settings = get_settings()
    prompt = "Options: A cost 40; B cost 25. Objective: lowest cost. " * 8
    messages = [{"role": "system", "content": settings.kev.system_prompt}, {"role": "user", "content": prompt}]
    used = budget.prompt_tokens(messages)
    room = context_tokens() - used
    assert 0 < room < settings.limits.max_new_tokens
    fits = client.post("/v1/jobs", headers=AUTH,
                       json={"adapter": "kev", "input": prompt, "params": {"max_new_tokens": room}})
    assert fits.status_code == 202, fits.text
    over = client.post("/v1/jobs", headers=AUTH,
                       json={"adapter": "kev", "input": prompt, "params": {"max_new_tokens": room + 1}})
    assert_refused(over, "input")
    assert "params.max_new_tokens" in over.json()["error"]["message"]
    assert f"at most {room} new tokens" in over.json()["error"]["message"]
    # A role's default is no choice of the job's: it shrinks to what the window leaves (as vLLM's max_tokens
    # does), so a prompt too long for Kev's default beside it is taken, by Kev and by `auto`'s Kev stage alike.
    long_prompt = "Options: A cost 40; B cost 25. Objective: lowest cost. " * 30
    kev_prompt = budget.prompt_tokens([{"role": "system", "content": settings.kev.system_prompt},
                                       {"role": "user", "content": long_prompt}])
    assert kev_prompt + settings.kev.max_new_tokens > context_tokens() > kev_prompt
    for adapter in ("kev", "auto"):
        taken = client.post("/v1/jobs", headers=AUTH, json={"adapter": adapter, "input": long_prompt})
        assert taken.status_code == 202, taken.text
    # Only a prompt that leaves no room at all is refused, saying so.
    full = client.post("/v1/jobs", headers=AUTH, json={"adapter": "kev", "input": long_prompt * 3})
    assert_refused(full, "input")
    assert "leaves no room for an answer" in full.json()["error"]["message"]


def test_the_limit_is_the_workers_window(service_env, monkeypatch):
    """A worker gives each job a window of KEVLAYA_ENGINE__WINDOW_TOKENS; a job that fits the model's
    context but not the window is refused at submit, naming the setting, instead of failing on the worker."""
    from fastapi.testclient import TestClient

    from api.main import create_app

    monkeypatch.setenv("KEVLAYA_ENGINE__WINDOW_TOKENS", "256")
    get_settings.cache_clear()
    with TestClient(create_app()) as client:
        prompt = "Pick A or B."
        fits = client.post("/v1/jobs", headers=AUTH,
                           json={"adapter": "laya", "input": prompt, "params": {"max_new_tokens": 100}})
        assert fits.status_code == 202, fits.text
        over = client.post("/v1/jobs", headers=AUTH,
                           json={"adapter": "laya", "input": prompt, "params": {"max_new_tokens": 300}})
        assert_refused(over, "input")
        assert "KEVLAYA_ENGINE__WINDOW_TOKENS) of 256 tokens" in over.json()["error"]["message"]
    get_settings.cache_clear()


def test_the_api_process_never_imports_torch(service_env):
    """The prompt budget loads the tokenizer without torch (docs/architecture.md §2): build the app, submit, check."""
    code = (
        "import sys\n"
        "from fastapi.testclient import TestClient\n"
        "from api.main import create_app\n"
        "app = create_app()\n"
        "assert app.state.intake.budget is not None\n"
        "with TestClient(app) as c:\n"
        "    r = c.post('/v1/jobs', json={'adapter': 'kev', 'input': 'pick one'},\n"
        "               headers={'Authorization': 'Bearer " + AUTH["Authorization"].split()[1] + "'})\n"
        "    assert r.status_code == 202, r.text\n"
        "print('torch' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120,
                          env={**os.environ, **service_env})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


# -- OpenAI compatibility ----------------------------------------------------------------------------------

def test_message_content_may_be_a_list_of_text_parts(client):
    parts = [{"type": "text", "text": "Options: A, B."}, {"type": "text", "text": "Pick one."}]
    job = client.post("/v1/jobs", headers=AUTH, json={
        "adapter": "kev", "input": {"messages": [{"role": "user", "content": parts}]}})
    assert job.status_code == 202, job.text
    stored = client.get(f"/v1/jobs/{job.json()['id']}", headers=AUTH).json()
    assert stored["input"]["messages"][0]["content"] == "Options: A, B.\nPick one."


def test_models_lists_the_three_names_chat_accepts(client):
    assert client.get("/v1/models").status_code == 401
    listed = client.get("/v1/models", headers=AUTH)
    assert listed.status_code == 200
    body = listed.json()
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == ["kev", "laya", "auto"]
    assert all(m["object"] == "model" for m in body["data"])


@pytest.mark.parametrize("path", ["/v1/jobs", "/v1/jobs/batch", "/v1/chat/completions"])
def test_a_body_that_is_not_json_is_refused_naming_the_body_and_where_it_breaks(client, path):
    refused = post_raw(client, path, '{"adapter": "kev", input: "x"}')
    assert_refused(refused, "body")
    assert "not valid JSON at character 19" in refused.json()["error"]["message"]
    assert job_count() == 0
