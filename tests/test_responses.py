"""OpenAI's Responses API on the durable job (api/openai/responses/): the official `openai` client against the app, and
against a real API and worker on the tiny random-weight model (every call is well-formed because the grammar
allows nothing else; the text itself is noise)."""

from __future__ import annotations

import json
import uuid

import httpx
import jsonschema
import openai
import pytest
from fastapi.testclient import TestClient
from openai import OpenAI

from shared import grammar
from shared.db import session_scope
from shared.keys import create_key
from shared.models import Job
from tests.conftest import API_KEY, AUTH, job_count, start_api, start_worker, wait_until

WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "unit": {"enum": ["C", "F"]}},
           "required": ["city", "unit"], "additionalProperties": False}
CLOCK = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
         "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather now", "parameters": WEATHER},
         {"type": "function", "name": "get_time", "parameters": CLOCK}]
SCHEMAS = {"get_weather": WEATHER, "get_time": CLOCK}
QUESTION = "Weather in Paris?"
FINISHED = ("completed", "incomplete", "failed", "cancelled")
WEATHER_FORMAT = {"format": {"type": "json_schema", "name": "weather", "schema": WEATHER, "strict": True}}
# The tiny model's tokenizer takes a token per byte: the tools in the system prompt and a few turns need more than
# the default window.
ROOMY = {"KEVLAYA_ENGINE__WINDOW_TOKENS": "2048"}


def sdk(http: httpx.Client | None = None, port: str | None = None) -> OpenAI:
    """The official client: on the app in this process (`http`, a TestClient), or on a real API's port."""
    if http is not None:
        return OpenAI(base_url="http://testserver/v1", api_key=API_KEY, http_client=http, max_retries=0)
    return OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def refused(call) -> dict:  # noqa: ANN001
    """The error body of a call the server refuses with 422."""
    with pytest.raises(openai.UnprocessableEntityError) as caught:
        call()
    return caught.value.body


def valid_calls(response, names: set[str] = set(SCHEMAS)) -> list:  # noqa: ANN001, B006
    """The response's function_call items, each checked: a tool offered, arguments valid under its schema."""
    calls = [item for item in response.output if item.type == "function_call"]
    assert calls and all(item.type == "function_call" for item in response.output), response.output
    for call in calls:
        assert call.name in names and call.call_id.startswith("call_") and call.id.startswith("fc_")
        if call.status == "incomplete":  # cut by max_output_tokens: its arguments end where the tokens did
            assert call is calls[-1] and response.status == "incomplete"
            continue
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    return calls


def job_of(api: httpx.Client, response) -> dict:  # noqa: ANN001
    return api.get(f"/v1/jobs/{response.model_extra['kevlaya']['job_id']}").json()


# -- what the server refuses (the app in this process, no worker: nothing may be stored) --------------------------


@pytest.fixture
def quick(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KEVLAYA_LIMITS__CHAT_TIMEOUT_S", "0.2")  # read when `client` builds the app


BUILT_IN = [{"type": "web_search"}, {"type": "web_search_preview"}, {"type": "file_search", "vector_store_ids": ["v"]},
            {"type": "computer_use_preview", "display_width": 800, "display_height": 600, "environment": "linux"},
            {"type": "code_interpreter", "container": {"type": "auto"}},
            {"type": "mcp", "server_label": "x", "server_url": "https://example.com"}, {"type": "image_generation"}]


@pytest.mark.parametrize(("extra", "field"), [
    *(({"tools": [tool]}, "tools.0.type") for tool in BUILT_IN),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools"),
    ({"tools": [{"type": "function", "name": f"f{i}"} for i in range(129)]}, "tools"),
    ({"tools": [{"type": "function", "name": "get time"}]}, "tools.0.name"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "string"}}]}, "tools.0.parameters"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "object", "dependentSchemas": {"a": {}}}}]},
     "tools.0.parameters"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "get_wind"}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "any"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "parallel_tool_calls": 1}, "parallel_tool_calls"),
    ({"n": 2}, "n"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"truncation": "auto"}, "truncation"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"service_tier": "flex"}, "service_tier"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"logit_bias": {"1": 2}}, "logit_bias"),
    ({"store": False, "background": True}, "background"),
    ({"max_output_tokens": 10**6}, "max_output_tokens"),
    ({"temperature": 3}, "temperature"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object",
                                                                          "dependentSchemas": {"a": {}}}}}},
     "text.format.schema"),
    ({"text": {"format": {"type": "xml"}}}, "text.format"),
    ({"instructions": [{"role": "system", "content": "x"}]}, "instructions"),
    ({"input": []}, "input"),
    ({"input": [{"role": "user", "content": "hi"}, {"type": "reasoning", "id": "rs_1", "summary": []}]}, "input.1"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]},
     "input.0.content.0"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input.0.role"),
    ({"input": [{"role": "user", "content": [{"type": "output_text", "text": "x"}]}]}, "input.0.content"),
    ({"input": [{"type": "function_call", "call_id": "c1", "name": "get_time", "arguments": "[1]"}]},
     "input.0.arguments"),
    ({"input": [{"role": "user", "content": QUESTION},
                {"type": "function_call_output", "call_id": "c9", "output": "18 C"}]}, "input.1.call_id"),
    ({"input": [{"type": "function_call", "call_id": f"c{i}", "name": "get_time", "arguments": "{}"}
                for i in range(grammar.MAX_TOOL_CALLS + 1)]}, "input"),
    ({"previous_response_id": "resp_" + "0" * 32}, "previous_response_id"),
    ({"previous_response_id": "chatcmpl-1"}, "previous_response_id"),
])
def test_what_the_server_cannot_honour_is_refused_naming_the_field_and_stores_nothing(client: TestClient, extra,
                                                                                      field):
    before = job_count()
    response = client.post("/v1/responses", headers=AUTH, json={"model": "laya", "input": QUESTION, **extra})
    assert response.status_code in (404, 422), response.text
    assert response.json()["error"]["message"].startswith(f"{field}:"), response.json()
    assert job_count() == before


def test_the_official_client_reads_each_refusal(client: TestClient):
    openai_client = sdk(client)
    body = refused(lambda: openai_client.responses.create(model="laya", input=QUESTION,
                                                          tools=[{"type": "web_search"}]))
    assert body["message"].startswith("tools.0.type:") and "only function tools" in body["message"]
    body = refused(lambda: openai_client.responses.create(model="laya", input=QUESTION, extra_body={"n": 2}))
    assert body["message"].startswith("n: not a parameter")
    with pytest.raises(openai.NotFoundError) as caught:
        openai_client.responses.create(model="laya", input=QUESTION, previous_response_id="resp_" + "1" * 32)
    assert caught.value.body["message"] == f"previous_response_id: response resp_{'1' * 32} not found"
    with pytest.raises(openai.NotFoundError):
        openai_client.responses.retrieve("resp_" + "2" * 32)


def test_tools_too_large_for_the_context_are_refused_naming_the_largest(quick, client: TestClient):
    budget = client.app.state.intake.budget
    words = "Clouds move east over the hills. " * 120
    tools = [{"type": "function", "name": f"tool_{i}", "description": words[:4000 if i == 2 else 400]}
             for i in range(6)]
    assert budget is not None
    before = job_count()
    response = client.post("/v1/responses", headers=AUTH, json={"model": "laya", "input": QUESTION, "tools": tools})
    assert response.status_code == 422, response.text
    message = response.json()["error"]["message"]
    assert message.startswith("tools: the tools' definitions") and "tools.2 ('tool_2'" in message, message
    assert job_count() == before


def test_a_previous_response_of_another_key_or_not_stored_is_not_found(quick, client: TestClient):
    """No worker runs here: each response is stored and waited for until the timeout (504), or in the background."""
    with session_scope() as session:
        _, other = create_key(session, "other")
    theirs = OpenAI(base_url="http://testserver/v1", api_key=other, http_client=client, max_retries=0)
    mine = sdk(client)
    queued = mine.responses.create(model="laya", input=QUESTION, background=True)
    assert queued.status == "queued" and queued.id.startswith("resp_") and queued.background
    for call in (lambda: theirs.responses.retrieve(queued.id), lambda: theirs.responses.delete(queued.id),
                 lambda: theirs.responses.cancel(queued.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    with pytest.raises(openai.NotFoundError) as caught:
        theirs.responses.create(model="laya", input=QUESTION, previous_response_id=queued.id)
    assert caught.value.body["message"].startswith(f"previous_response_id: response {queued.id} not found")
    # still queued: it cannot be continued yet
    with pytest.raises(openai.ConflictError) as caught:
        mine.responses.create(model="laya", input=QUESTION, previous_response_id=queued.id)
    assert caught.value.body["message"].startswith("previous_response_id:")
    # store: false, waited for (504 here): never shown, never continued
    with pytest.raises(openai.APIStatusError) as caught:
        mine.responses.create(model="laya", input=QUESTION, store=False)
    assert caught.value.status_code == 504 and "not stored" in caught.value.body["message"]
    with session_scope() as session:
        hidden = session.query(Job).filter(Job.response_store.is_(False)).one()
    hidden_id = f"resp_{hidden.id.hex}"
    with pytest.raises(openai.NotFoundError):
        mine.responses.retrieve(hidden_id)
    with pytest.raises(openai.BadRequestError) as caught:
        mine.responses.create(model="laya", input=QUESTION, previous_response_id=hidden_id)
    assert caught.value.body["message"].startswith(f"previous_response_id: response {hidden_id} was created with "
                                                   "store: false")


def test_a_queued_background_response_is_cancelled_and_deleted(quick, client: TestClient):
    """No worker: background responses stay queued until cancelled."""
    openai_client = sdk(client)
    queued = openai_client.responses.create(model="kev", input=QUESTION, background=True, metadata={"k": "v"},
                                            instructions="Be brief.", max_output_tokens=32, temperature=0.5)
    assert (queued.status, queued.metadata, queued.instructions, queued.max_output_tokens, queued.temperature) == (
        "queued", {"k": "v"}, "Be brief.", 32, 0.5)
    assert queued.output == [] and queued.usage is None and queued.store is not False
    assert openai_client.responses.retrieve(queued.id).status == "queued"
    cancelled = openai_client.responses.cancel(queued.id)
    assert cancelled.status == "cancelled" and cancelled.output == []
    assert openai_client.responses.cancel(queued.id).status == "cancelled"  # again: as it is
    job = client.get(f"/v1/jobs/{queued.model_extra['kevlaya']['job_id']}", headers=AUTH).json()
    assert job["status"] == "cancelled"
    # a response that was not created in the background cannot be cancelled (OpenAI's rule)
    with pytest.raises(openai.APIStatusError) as caught:
        openai_client.responses.create(model="laya", input=QUESTION)
    assert caught.value.status_code == 504  # no worker: it stays queued
    waited_id = caught.value.body["message"].split()[1]
    with pytest.raises(openai.BadRequestError) as caught:
        openai_client.responses.cancel(waited_id)
    assert "background" in caught.value.body["message"]
    # DELETE: a queued one is cancelled and deleted, a cancelled one deleted; then both are gone
    again = openai_client.responses.create(model="laya", input=QUESTION, background=True)
    assert openai_client.responses.delete(again.id) is None  # the SDK returns nothing: the body is checked here
    answer = client.delete(f"/v1/responses/{queued.id}", headers=AUTH)
    assert answer.status_code == 200 and answer.json() == {"id": queued.id, "object": "response", "deleted": True}
    for response_id in (queued.id, again.id):
        with pytest.raises(openai.NotFoundError):
            openai_client.responses.retrieve(response_id)
        assert client.get(f"/v1/jobs/{response_id.removeprefix('resp_')}", headers=AUTH).status_code == 404


def test_input_items_list_the_responses_own_items(quick, client: TestClient):
    openai_client = sdk(client)
    items = [{"role": "developer", "content": "Answer briefly."}, {"role": "user", "content": QUESTION},
             {"type": "function_call", "call_id": "c1", "name": "get_weather",
              "arguments": '{"city": "Paris", "unit": "C"}'},
             {"type": "function_call_output", "call_id": "c1", "output": "18 C"}]
    queued = openai_client.responses.create(model="laya", input=items, tools=TOOLS, background=True)
    listed = openai_client.responses.input_items.list(queued.id, order="asc")
    assert [item.type for item in listed.data] == ["message", "message", "function_call", "function_call_output"]
    assert listed.data[0].role == "developer" and listed.data[0].content[0].text == "Answer briefly."
    assert listed.data[2].call_id == "c1" and listed.data[3].output == "18 C"
    page = openai_client.responses.input_items.list(queued.id, limit=2)  # newest first
    assert [item.type for item in page.data] == ["function_call_output", "function_call"] and page.has_more
    after = openai_client.responses.input_items.list(queued.id, limit=2, after=page.data[-1].id)
    assert [item.type for item in after.data] == ["message", "message"] and not after.has_more
    # the job holds them as chat messages: developer as system, the call and its output as chat's tool turns
    job = client.get(f"/v1/jobs/{queued.model_extra['kevlaya']['job_id']}", headers=AUTH).json()
    assert [m["role"] for m in job["input"]["messages"]] == ["system", "user", "assistant", "tool"]
    assert job["params"]["output"] == "tool_calls"


# -- the official client, a real API and worker ---------------------------------------------------------------------


def finished(openai_client: OpenAI, response_id: str, timeout: float = 180):  # noqa: ANN201
    return wait_until(lambda: (r := openai_client.responses.retrieve(response_id)).status in FINISHED and r, timeout,
                      interval=0.2, what=f"response {response_id} to finish")


@pytest.mark.integration
@pytest.mark.parametrize("env", [ROOMY], indirect=True)
def test_text_json_schema_and_each_tool_choice_answer_as_openai_does(env, api, start_process):
    start_worker(start_process, env, api)
    openai_client = sdk(port=env["KEVLAYA_API__PORT"])

    plain = openai_client.responses.create(model="laya", input=QUESTION, instructions="Be brief.")
    assert plain.object == "response" and plain.id.startswith("resp_") and plain.status in ("completed", "incomplete")
    [message] = plain.output
    assert message.type == "message" and message.role == "assistant" and message.content[0].type == "output_text"
    assert plain.output_text == message.content[0].text and plain.output_text
    assert plain.usage.total_tokens == plain.usage.input_tokens + plain.usage.output_tokens > 0
    kevlaya = plain.model_extra["kevlaya"]
    assert kevlaya["answered_by"] == "laya" and plain.id == f"resp_{uuid.UUID(kevlaya['job_id']).hex}"
    job = job_of(api, plain)
    assert job["input"]["messages"] == [{"role": "system", "content": "Be brief."},
                                        {"role": "user", "content": QUESTION}]
    assert job["params"]["output"] == "decision"  # the role answers as itself, as on chat
    assert openai_client.responses.retrieve(plain.id).output_text == plain.output_text
    # a conversation kept by the client: the output items given back as they came
    again = openai_client.responses.create(model="laya", input=[{"role": "user", "content": QUESTION}, *plain.output,
                                                                {"role": "user", "content": "Why?"}])
    assert job_of(api, again)["input"]["messages"] == [{"role": "user", "content": QUESTION},
                                                       {"role": "assistant", "content": plain.output_text},
                                                       {"role": "user", "content": "Why?"}]

    cut = openai_client.responses.create(model="kev", input=QUESTION, max_output_tokens=3,
                                         text={"format": {"type": "text"}})
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.usage.output_tokens == 3 and job_of(api, cut)["params"]["output"] == "text"

    schema = openai_client.responses.create(
        model="laya", input=QUESTION, max_output_tokens=200, temperature=0,
        text={"format": {"type": "json_schema", "name": "weather", "schema": WEATHER, "strict": True}})
    assert schema.status == "completed", schema
    jsonschema.validate(json.loads(schema.output_text), WEATHER)
    assert schema.text.format.type == "json_schema" and schema.text.format.name == "weather"

    for model, seed_choice in (("laya", "required"), ("kev", "required")):
        required = openai_client.responses.create(model=model, input=QUESTION, tools=TOOLS, tool_choice=seed_choice,
                                                  max_output_tokens=400, temperature=1)
        # sampled at temperature 1 (its draws depend on the rows beside it): the calls may fill max_output_tokens,
        # and then the last one is cut and the response incomplete, as OpenAI's is
        assert 1 <= len(valid_calls(required)) <= grammar.MAX_TOOL_CALLS
        assert required.status == "completed" or required.incomplete_details.reason == "max_output_tokens", required
        assert job_of(api, required)["params"]["tool_choice"] == "required"
    named = openai_client.responses.create(model="kev", input=QUESTION, tools=TOOLS, max_output_tokens=400,
                                           temperature=0, tool_choice={"type": "function", "name": "get_time"})
    assert {call.name for call in valid_calls(named)} == {"get_time"}
    assert named.tool_choice.type == "function" and named.tool_choice.name == "get_time"
    single = openai_client.responses.create(model="laya", input=QUESTION, tools=TOOLS, tool_choice="required",
                                            parallel_tool_calls=False, max_output_tokens=400, temperature=0)
    assert len(valid_calls(single)) == 1 and single.parallel_tool_calls is False
    cut = openai_client.responses.create(model="laya", input=QUESTION, tools=TOOLS, tool_choice="required",
                                         parallel_tool_calls=False, max_output_tokens=55, temperature=0)
    assert cut.status == "incomplete" and [(item.type, item.status) for item in cut.output] == [
        ("function_call", "incomplete")], cut.output  # the call so far, never its wire format as a message
    none = openai_client.responses.create(model="laya", input=QUESTION, tools=TOOLS, tool_choice="none",
                                          max_output_tokens=8)
    assert [item.type for item in none.output] == ["message"] and job_of(api, none)["params"]["output"] == "decision"
    auto = openai_client.responses.create(model="auto", input=QUESTION, tools=TOOLS, max_output_tokens=60,
                                          temperature=0)
    assert auto.model_extra["kevlaya"]["answered_by"] == "laya" and auto.tool_choice == "auto"
    if any(item.type == "function_call" for item in auto.output):
        valid_calls(auto)
    else:
        assert [item.type for item in auto.output] == ["message"]

    # the calls' results come back as function_call_output items, after the calls (given back as output items)
    [call] = valid_calls(single)
    followed = openai_client.responses.create(
        model="kev", tools=TOOLS, tool_choice="required", max_output_tokens=400, temperature=0,
        input=[{"role": "user", "content": QUESTION}, *single.output,
               {"type": "function_call_output", "call_id": call.call_id, "output": "18 C, clear"}])
    valid_calls(followed)
    turns = job_of(api, followed)["input"]["messages"]
    assert [m["role"] for m in turns] == ["user", "assistant", "tool"]
    assert turns[1]["tool_calls"][0]["id"] == call.call_id and turns[2]["content"] == "18 C, clear"
    # and the same through previous_response_id: the previous response's calls are answered by their call ids
    chained = openai_client.responses.create(
        model="laya", previous_response_id=single.id, tools=TOOLS, tool_choice="required", max_output_tokens=400,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "18 C, clear"}])
    valid_calls(chained)
    assert chained.previous_response_id == single.id
    assert [m["role"] for m in job_of(api, chained)["input"]["messages"]] == ["user", "assistant", "tool"]


@pytest.mark.integration
@pytest.mark.parametrize("env", [ROOMY], indirect=True)
def test_a_conversation_continues_after_the_api_and_the_worker_restart(env, start_process):
    """previous_response_id: each response's conversation is in its row, so a chain of turns goes on across a
    restart of every process; instructions are not carried over; store: false is answered once, then gone."""
    api = start_api(start_process, env)
    worker = start_worker(start_process, env, api)
    openai_client = sdk(port=env["KEVLAYA_API__PORT"])
    first = openai_client.responses.create(model="laya", input="Pick a city: Paris or Rome?",
                                           instructions="You pick cities.", max_output_tokens=24)
    second = openai_client.responses.create(model="kev", input="And why?", previous_response_id=first.id,
                                            max_output_tokens=24)
    assert second.previous_response_id == first.id and second.instructions is None

    worker.kill()
    start_process.started[0].stop()  # the API
    api.close()
    api = start_api(start_process, env)
    start_worker(start_process, env, api)
    openai_client = sdk(port=env["KEVLAYA_API__PORT"])
    assert openai_client.responses.retrieve(second.id).output_text == second.output_text  # the store survived
    third = openai_client.responses.create(model="laya", input="Say it in one word.", previous_response_id=second.id,
                                           instructions="Be brief.", max_output_tokens=24)
    assert third.status in ("completed", "incomplete") and third.previous_response_id == second.id
    messages = job_of(api, third)["input"]["messages"]
    assert messages == [
        {"role": "system", "content": "Be brief."},  # its own instructions; the first's are not carried over
        {"role": "user", "content": "Pick a city: Paris or Rome?"}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And why?"}, {"role": "assistant", "content": second.output_text},
        {"role": "user", "content": "Say it in one word."}]
    # the chain holds even after a response in it is deleted: each holds its conversation
    openai_client.responses.delete(first.id)
    fourth = openai_client.responses.create(model="laya", input="Thanks.", previous_response_id=third.id,
                                            max_output_tokens=8)
    assert len(job_of(api, fourth)["input"]["messages"]) == 7

    unstored = openai_client.responses.create(model="laya", input=QUESTION, store=False, max_output_tokens=8)
    assert unstored.status in ("completed", "incomplete") and unstored.store is False and unstored.output_text
    with pytest.raises(openai.NotFoundError):
        openai_client.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError):
        openai_client.responses.create(model="laya", input=QUESTION, previous_response_id=unstored.id)
    assert api.get(f"/v1/jobs/{unstored.model_extra['kevlaya']['job_id']}").status_code == 404  # deleted
    api.close()


def event_types(events: list) -> list[str]:  # noqa: ANN001
    return [event.type for event in events]


@pytest.mark.integration
@pytest.mark.parametrize("env", [ROOMY], indirect=True)
def test_streams_are_parsed_by_the_official_client_and_resume_after_a_sequence_number(env, api, start_process):
    start_worker(start_process, env, api)
    openai_client = sdk(port=env["KEVLAYA_API__PORT"])

    # text (a JSON schema's, so that the answer ends): the SDK's helper builds the final response from the events
    with openai_client.responses.stream(model="kev", input=QUESTION, max_output_tokens=200, text=WEATHER_FORMAT,
                                        temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = event_types(events)
    assert kinds[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          f"response.{final.status}"]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert text == final.output_text == openai_client.responses.retrieve(final.id).output_text
    assert final.usage.output_tokens > 0 and final.status == "completed"
    jsonschema.validate(json.loads(final.output_text), WEATHER)
    # an answer cut by max_output_tokens ends with response.incomplete
    cut = list(openai_client.responses.create(model="kev", input=QUESTION, max_output_tokens=4, stream=True,
                                              text={"format": {"type": "text"}}))
    assert cut[-1].type == "response.incomplete" and cut[-1].response.incomplete_details.reason == "max_output_tokens"
    assert "".join(e.delta for e in cut if e.type == "response.output_text.delta") == cut[-1].response.output_text

    # calls: each function_call item whole, its arguments in one delta
    raw = list(openai_client.responses.create(model="laya", input=QUESTION, tools=TOOLS, tool_choice="required",
                                              max_output_tokens=400, temperature=1, stream=True))
    assert raw[-1].type == "response.completed"
    calls = valid_calls(raw[-1].response)
    added = [event.item for event in raw if event.type == "response.output_item.added"]
    assert [(item.call_id, item.name) for item in added] == [(call.call_id, call.name) for call in calls]
    assert [event.arguments for event in raw if event.type == "response.function_call_arguments.done"] == \
        [call.arguments for call in calls]

    # background + stream: read a few events, drop the connection, resume after the last one read
    stream = openai_client.responses.create(model="kev", input=QUESTION, max_output_tokens=200, background=True,
                                            stream=True, text=WEATHER_FORMAT)
    head = []
    for event in stream:
        head.append(event)
        if len(head) == 3:
            break
    stream.close()
    response_id = head[0].response.id
    rest = list(openai_client.responses.retrieve(response_id, stream=True, starting_after=head[-1].sequence_number))
    assert [event.sequence_number for event in rest] == list(range(3, 3 + len(rest)))
    whole = list(openai_client.responses.retrieve(response_id, stream=True))  # a replay from the start
    assert event_types(whole) == event_types(head) + event_types(rest)
    assert [e.model_dump() for e in whole[3:]] == [e.model_dump() for e in rest]
    # the SDK's helper resumes the same way (it asks for the whole stream and skips what it had)
    with openai_client.responses.stream(response_id=response_id, starting_after=4) as resumed:
        after = list(resumed)
        done = resumed.get_final_response()
    assert after[0].sequence_number == 5 and done.output_text == finished(openai_client, response_id).output_text


@pytest.mark.integration
@pytest.mark.parametrize("env", [ROOMY], indirect=True)
def test_background_responses_are_polled_and_a_running_one_is_not_cancelled(env, api, start_process):
    start_worker(start_process, env, api)
    openai_client = sdk(port=env["KEVLAYA_API__PORT"])
    queued = openai_client.responses.create(model="laya", input=QUESTION, background=True, max_output_tokens=16)
    assert queued.status in ("queued", "in_progress") and queued.output == []
    done = finished(openai_client, queued.id)
    assert done.status in ("completed", "incomplete") and done.output_text and done.background
    with pytest.raises(openai.ConflictError) as caught:
        openai_client.responses.cancel(done.id)  # finished: left as it is
    assert caught.value.body["message"] == f"response {done.id} is {done.status}; only a queued response can be " \
                                           "cancelled"
    assert openai_client.responses.retrieve(done.id).status == done.status


@pytest.mark.integration
@pytest.mark.parametrize("env", [ROOMY], indirect=True)
@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)  # the batch path is the other lines'
def test_a_batch_of_responses_lines_answers_with_response_objects(env, api, start_process, tmp_path):
    start_worker(start_process, env, api)
    openai_client = sdk(port=env["KEVLAYA_API__PORT"])
    lines = [{"custom_id": "text", "method": "POST", "url": "/v1/responses",
              "body": {"model": "laya", "input": QUESTION, "max_output_tokens": 16, "metadata": {"k": "v"}}},
             {"custom_id": "tools", "method": "POST", "url": "/v1/responses",
              "body": {"model": "laya", "input": QUESTION, "tools": TOOLS, "tool_choice": "required",
                       "max_output_tokens": 400}},
             {"custom_id": "refused", "method": "POST", "url": "/v1/responses",
              "body": {"model": "laya", "input": QUESTION, "tools": [{"type": "web_search"}]}}]
    path = tmp_path / "requests.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines))
    batch = openai_client.batches.create(
        input_file_id=openai_client.files.create(file=path.open("rb"), purpose="batch").id,
        endpoint="/v1/responses", completion_window="24h")
    batch = wait_until(lambda: (b := openai_client.batches.retrieve(batch.id)).status in ("completed", "failed") and b,
                       180, interval=0.5, what="the batch to finish")
    assert (batch.status, batch.request_counts.completed, batch.request_counts.failed) == ("completed", 2, 1)
    out = {line["custom_id"]: line for line in map(json.loads, openai_client.files.content(
        batch.output_file_id).text.splitlines())}
    text = out["text"]["response"]["body"]
    assert text["object"] == "response" and text["status"] in ("completed", "incomplete")
    assert text["metadata"] == {"k": "v"} and text["output"][0]["type"] == "message"
    assert openai_client.responses.retrieve(text["id"]).output_text == text["output"][0]["content"][0]["text"]
    calls = out["tools"]["response"]["body"]["output"]
    assert calls and all(item["type"] == "function_call" for item in calls)
    for item in calls:
        jsonschema.validate(json.loads(item["arguments"]), SCHEMAS[item["name"]])
    [error] = map(json.loads, openai_client.files.content(batch.error_file_id).text.splitlines())
    assert error["custom_id"] == "refused" and error["response"]["status_code"] == 422
    assert error["response"]["body"]["error"]["message"].startswith("tools.0.type:")
