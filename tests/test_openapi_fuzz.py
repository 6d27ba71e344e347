"""The OpenAPI schema tells the truth: schemathesis generates requests from the app's own schema (valid and
invalid ones, fixed seed, bounded examples) and sends them to the real app on a real SQLite database and a
real Redis. Every answer must be documented (status, content type, headers, body schema) and none may be a
server error. Plus direct checks of what the schema promises."""

from __future__ import annotations

from pathlib import Path

import pytest
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import positive_data_acceptance

from shared.heartbeat import beat
from shared.migrate import upgrade
from tests.conftest import AUTH

EXAMPLES_PER_OPERATION = 50


@pytest.fixture
def database_url(tmp_path: Path) -> str:
    """This module runs on SQLite only (the fuzz is about the HTTP contract, not the database)."""
    url = f"sqlite:///{tmp_path / 'kevlaya.db'}"
    upgrade(url)
    return url


@pytest.fixture
def fuzzed_app(service_env: dict[str, str], monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201
    # No worker runs here: chat completions answer 504 quickly, long-polls end quickly.
    monkeypatch.setenv("KEVLAYA_LIMITS__CHAT_TIMEOUT_S", "0.2")
    monkeypatch.setenv("KEVLAYA_LIMITS__WAIT_TIMEOUT_S", "0.5")
    # Schemathesis checks that every wrong key gets 401: its thousands come from one address, which the failed-
    # authentication throttle would answer with 429 after 20 (tests/test_key_security.py tests the throttle).
    monkeypatch.setenv("KEVLAYA_KEYS__AUTH_FAILURES_PER_ADDRESS", "1000000")
    from shared.settings import get_settings

    get_settings.cache_clear()
    # A worker with its model loaded has reported in, so /readyz answers 200 as in service.
    beat("fuzz-worker:1", {"model_loaded": True, "unavailable_adapters": {}}, 600)
    from api.main import create_app

    return create_app()


def chat_may_time_out(ctx, response, case) -> None:  # noqa: ANN001
    """No worker runs here, so a valid chat completion waits and answers its documented 504; any other
    5xx is a server error."""
    if response.status_code >= 500 and response.status_code != 504:
        raise AssertionError(f"server error {response.status_code}: {response.text[:500]}")


def test_every_answer_is_documented_and_none_is_a_server_error(fuzzed_app):
    """Valid and invalid requests for every operation; all of schemathesis' response checks (server errors,
    undocumented status codes, content types, headers, response schemas, ignored auth, ...) must pass."""
    api_schema = schemathesis.openapi.from_asgi("/openapi.json", fuzzed_app)
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert len(operations) >= 10
    failures: list[str] = []
    calls = 0
    for operation in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @seed(20240611)
            @settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, database=None,
                      suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])
            @given(case=operation.as_strategy(generation_mode=mode))
            def check(case) -> None:  # noqa: ANN001
                nonlocal calls
                calls += 1
                response = case.call(headers=AUTH)
                # Every check but positive_data_acceptance: some valid-looking requests are refused for
                # reasons a schema cannot state (a cursor this API did not issue, a prompt over the model's
                # context in tokens, metadata nested too deeply); they get documented 4xx answers.
                excluded = [positive_data_acceptance]
                if operation.path in ("/v1/chat/completions", "/v1/responses"):  # both wait for their job
                    case.validate_response(response, excluded_checks=[*excluded, not_a_server_error],
                                           additional_checks=[chat_may_time_out])
                else:
                    case.validate_response(response, excluded_checks=excluded)

            try:
                check()
            except Unsatisfiable:
                assert mode is GenerationMode.NEGATIVE  # nothing to get wrong: no parameters, no body
            except (Exception, BaseExceptionGroup) as exc:  # collect every operation's failure, then report them all
                failures.append(f"{operation.label} ({mode.value}): {exc}")
    assert not failures, "\n\n".join(failures)
    assert calls > len(operations) * 10


# -- what the schema promises, checked directly ------------------------------------------------------------

def test_routes_document_their_error_answers_with_the_error_schema(fuzzed_app):
    spec = TestClient(fuzzed_app).get("/openapi.json").json()
    expected = {
        ("post", "/v1/jobs"): {"200", "202", "400", "401", "413", "422", "429", "500", "503"},
        ("post", "/v1/jobs/batch"): {"202", "400", "401", "413", "422", "429", "500", "503"},
        ("get", "/v1/jobs"): {"200", "400", "401", "422", "429", "500", "503"},
        ("get", "/v1/jobs/{job_id}"): {"200", "401", "404", "422", "429", "500", "503"},
        ("get", "/v1/jobs/{job_id}/wait"): {"200", "401", "404", "422", "429", "500", "503"},
        ("delete", "/v1/jobs/{job_id}"): {"200", "401", "404", "409", "422", "429", "500", "503"},
        ("post", "/v1/chat/completions"): {"200", "400", "401", "413", "422", "429", "500", "503", "504"},
        ("post", "/v1/responses"): {"200", "400", "401", "404", "409", "413", "422", "429", "500", "503", "504"},
        ("get", "/v1/responses/{response_id}"): {"200", "401", "404", "422", "429", "500", "503"},
        ("get", "/v1/models"): {"200", "401", "422", "429", "500", "503"},
        ("get", "/readyz"): {"200", "503"},
    }
    for (method, path), statuses in expected.items():
        responses = spec["paths"][path][method]["responses"]
        assert set(responses) == statuses, (method, path)
        for status in statuses:
            if int(status) >= 400 and path != "/readyz":
                ref = responses[status]["content"]["application/json"]["schema"]["$ref"]
                assert ref.endswith("/ErrorResponse"), (method, path, status)
    assert "HTTPValidationError" not in spec["components"]["schemas"]


def test_schema_states_the_configured_bounds(fuzzed_app):
    from shared.settings import get_settings

    configured = get_settings()
    spec = TestClient(fuzzed_app).get("/openapi.json").json()
    components = spec["components"]["schemas"]

    def branch(node: dict, kind: str) -> dict:
        return next(b for b in node.get("anyOf", [node]) if b.get("type") == kind)

    assert branch(components["JobParams"]["properties"]["max_new_tokens"], "integer")["maximum"] == \
        configured.limits.max_new_tokens
    text_input = branch(components["JobCreate"]["properties"]["input"], "string")
    assert text_input["minLength"] == 1 and text_input["maxLength"] == configured.limits.prompt_chars
    assert components["JobBatchCreate"]["properties"]["jobs"]["maxItems"] == configured.limits.batch_submit
    wait = spec["paths"]["/v1/jobs/{job_id}/wait"]["get"]["parameters"]
    timeout = branch(next(p for p in wait if p["name"] == "timeout")["schema"], "number")
    assert timeout["maximum"] == configured.limits.wait_timeout_s and timeout["exclusiveMinimum"] == 0
    assert components["ChatRequest"]["properties"]["messages"]["minItems"] == 1
