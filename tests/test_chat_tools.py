"""Function tools on chat completions: the tools' grammar on its own, how tools and earlier calls reach the model,
what the API refuses, and the official `openai` client against a real API and worker (random weights: every call
is well-formed because the grammar allows nothing else)."""

from __future__ import annotations

import json

import jsonschema
import llguidance
import llguidance.hf
import pytest
from fastapi.testclient import TestClient
from openai import OpenAI
from transformers import AutoTokenizer

from shared import grammar
from shared.schemas import answer_grammar, model_messages
from shared.settings import DEMO_MODEL_DIR
from shared.tools import call_text, leading_calls
from tests.conftest import AUTH, start_worker, wait_until

WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "unit": {"enum": ["C", "F"]}},
           "required": ["city", "unit"], "additionalProperties": False}
CLOCK = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
         "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": CLOCK}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": CLOCK}
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]


# -- the grammar on its own ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def accepts():  # noqa: ANN201
    """Whether a grammar takes a whole text, tokenized by the demo model's tokenizer."""
    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL_DIR / "base")
    library = llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer), eos_token=[tokenizer.eos_token_id])

    def accepts(built: str, text: str) -> bool:
        matcher = llguidance.LLMatcher(library, built)
        assert not matcher.is_error(), matcher.get_error()
        return (all(matcher.consume_token(t) for t in tokenizer.encode(text, add_special_tokens=False))
                and matcher.is_accepting())

    return accepts


def test_the_tools_grammar_takes_a_valid_call_and_refuses_a_wrong_name_or_invalid_arguments(accepts):
    def grammar_of(**params: object) -> str:
        return answer_grammar({"output": "tool_calls", "tools": TOOLS, **params}, MESSAGES, analysis=False)

    weather, clock = call_text("get_weather", {"city": "Paris", "unit": "C"}), call_text("get_time", {"zone": "UTC"})
    required = grammar_of(tool_choice="required")
    assert accepts(required, weather) and accepts(required, f"{weather}\n{clock}")
    assert not accepts(required, call_text("get_wind", {"city": "Paris", "unit": "C"}))  # no such tool
    assert not accepts(required, call_text("get_weather", {"city": "Oslo", "unit": "C"}))  # not in its enum
    assert not accepts(required, call_text("get_weather", {"city": "Paris"}))  # a required argument left out
    assert not accepts(required, "It is sunny.")  # required: a call, never text
    named = grammar_of(tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert accepts(named, clock) and not accepts(named, weather)
    single = grammar_of(tool_choice="required", parallel_tool_calls=False)
    assert accepts(single, weather) and not accepts(single, f"{weather}\n{clock}")
    auto = grammar_of()
    assert accepts(auto, weather) and accepts(auto, "It is sunny.")
    assert not accepts(auto, '<tool_call>\n{"name": "get_wind"}')  # text cannot open a call
    schema_or_call = grammar_of(response_format={"type": "json_object"})
    assert accepts(schema_or_call, '{"sky": "clear"}') and accepts(schema_or_call, clock)
    assert not accepts(schema_or_call, "It is sunny.")


def test_open_schemas_are_enforced_closed_and_what_they_admit_stays_valid(accepts):
    """A schema that says nothing of extra keys (as LangChain's and most hand-written ones) admits any, and random
    weights wrote one until max_tokens: the grammar closes each object that names its properties."""
    open_weather = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "at": {
        "type": "object", "properties": {"day": {"enum": ["fri", "sat"]}}, "required": ["day"]}}, "required": ["city"]}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": open_weather}}]
    built = answer_grammar({"output": "tool_calls", "tools": tools, "tool_choice": "required"}, MESSAGES,
                           analysis=False)
    good = {"city": "Paris", "at": {"day": "fri"}}
    jsonschema.validate(good, open_weather)
    assert accepts(built, call_text("get_weather", good))
    assert not accepts(built, call_text("get_weather", {"city": "Paris", "wind": 3}))  # valid under the open schema
    assert not accepts(built, call_text("get_weather", {"city": "Paris", "at": {"day": "fri", "hour": 9}}))
    # an object left free (no properties named) stays free, and one that says how extra keys go keeps its word
    free = {"type": "object", "properties": {"tags": {"type": "object"},
                                            "more": {"type": "object", "properties": {"a": {"type": "integer"}},
                                                     "additionalProperties": {"type": "integer"}}}}
    loose = answer_grammar({"output": "tool_calls", "tools": [{"type": "function", "function": {
        "name": "f", "parameters": free}}], "tool_choice": "required"}, MESSAGES, analysis=False)
    assert accepts(loose, call_text("f", {"tags": {"x": "y"}, "more": {"a": 1, "b": 2}}))
    assert not accepts(loose, call_text("f", {"other": 1}))


def test_closing_a_schema_reads_its_keywords_not_its_property_names():
    named_like_keywords = {"type": "object", "properties": {
        "properties": {"type": "object", "properties": {"x": {"type": "integer"}}},
        "items": {"type": "array", "items": {"type": "object", "properties": {"y": {"type": "string"}}}}},
        "$defs": {"P": {"type": "object", "properties": {"z": {"type": "null"}}}},
        "allOf": [{"properties": {"w": {"type": "integer"}}}]}
    out = grammar.closed(named_like_keywords)
    assert "additionalProperties" not in out  # its properties may come from allOf: left as it is
    assert set(out["properties"]) == {"properties", "items"}  # property names are never taken for keywords
    assert out["properties"]["properties"]["additionalProperties"] is False
    assert out["properties"]["items"]["items"]["additionalProperties"] is False
    assert out["$defs"]["P"]["additionalProperties"] is False
    assert out["allOf"] == named_like_keywords["allOf"]  # allOf's parts add up: none is closed alone
    assert "additionalProperties" not in named_like_keywords["properties"]["properties"]  # the caller's is untouched


def test_a_messages_name_reaches_the_model_before_its_text():
    stored = {"messages": [{"role": "user", "name": "ana", "content": "Tea or coffee?"},
                           {"role": "assistant", "name": "helper", "content": "Tea."},
                           {"role": "user", "content": "Why?"}]}
    turns = model_messages(stored, {"output": "text"}, "You are Laya.")[1:]
    assert [t["content"] for t in turns] == ["ana: Tea or coffee?", "helper: Tea.", "Why?"]


def test_tools_and_earlier_calls_reach_the_model_as_plain_turns():
    stored = {"messages": [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "CET"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "18 C"},
        {"role": "tool", "tool_call_id": "c2", "content": "14:05"}]}
    system, user, assistant, results = model_messages(
        stored, {"output": "tool_calls", "tools": TOOLS, "tool_choice": "required"}, "You are Laya.")
    assert system["role"] == "system" and system["content"].startswith("You are Laya.\n\n# Tools\n<tools>\n")
    assert json.dumps(WEATHER) in system["content"] and "Answer with function calls only." in system["content"]
    assert user == MESSAGES[0]
    assert assistant == {"role": "assistant", "content": call_text("get_weather", {"city": "Paris"}) + "\n"
                         + call_text("get_time", {"zone": "CET"})}
    assert leading_calls(assistant["content"]) == ([("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})],
                                                   len(assistant["content"]))
    assert results == {"role": "user", "content": '<tool_response>\n{"name": "get_weather", "content": "18 C"}\n'
                       '</tool_response>\n<tool_response>\n{"name": "get_time", "content": "14:05"}\n</tool_response>'}
    # without tools (tool_choice "none" stores none) the system prompt is the adapter's own
    assert model_messages(stored, {"output": "text"}, "You are Laya.")[0]["content"] == "You are Laya."


# -- what the API refuses -------------------------------------------------------------------------------------------


def call(name: str = "get_weather", call_id: str = "c1", arguments: str = '{"city": "Paris", "unit": "C"}') -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


@pytest.mark.parametrize(("extra", "field"), [
    ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"tools": [{"type": "function", "function": {"name": "get time"}}]}, "tools.0.function.name"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools"),
    ({"tools": []}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "tools.0.function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "dependentSchemas": {"a": {}}}}}]}, "tools.0.function.parameters"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_wind"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "any"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "parallel_tool_calls": 1}, "parallel_tool_calls"),
    ({"messages": [*MESSAGES, {"role": "tool", "tool_call_id": "c1", "content": "18 C"}]}, "messages"),
    ({"messages": [*MESSAGES, {"role": "assistant", "tool_calls": [call()]},
                   {"role": "tool", "tool_call_id": "c9", "content": "18 C"}]}, "messages"),
    ({"messages": [*MESSAGES, {"role": "assistant", "tool_calls": [call(arguments="[1]")]}]},
     "messages.1.tool_calls.0.function.arguments"),
    ({"messages": [*MESSAGES, {"role": "assistant"}]}, "messages.1"),
    ({"messages": [{"role": "user", "content": "hi", "tool_calls": [call()]}]}, "messages.0"),
    ({"messages": [{"role": "user", "content": "hi", "name": "ana smith"}]}, "messages.0.name"),
    ({"messages": [{"role": "user", "content": "hi", "name": "x" * 65}]}, "messages.0.name"),
    ({"messages": [*MESSAGES, {"role": "assistant", "tool_calls": [call()]},
                   {"role": "tool", "tool_call_id": "c1", "content": "18 C", "name": "get_weather"}]}, "messages.2"),
])
def test_tools_and_tool_messages_the_server_cannot_honour_are_refused_naming_the_field(client: TestClient, extra,
                                                                                       field):
    response = client.post("/v1/chat/completions", headers=AUTH, json={"model": "laya", "messages": MESSAGES, **extra})
    assert response.status_code == 422, response.text
    assert response.json()["error"]["message"].startswith(f"{field}:"), response.json()


# -- the official client, a real API and worker ---------------------------------------------------------------------


# The tiny model's tokenizer takes a token per byte: the tools in the system prompt and up to 8 calls need more than
# the default window.
ROOMY = {"KEVLAYA_ENGINE__WINDOW_TOKENS": "2048"}


def openai_client(env: dict[str, str]) -> OpenAI:
    return OpenAI(base_url=f"http://127.0.0.1:{env['KEVLAYA_API__PORT']}/v1", api_key=env["KEVLAYA_API__KEY"],
                  max_retries=0, timeout=120)


def valid_calls(choice, names: set[str]) -> list:  # noqa: ANN001
    """The choice's calls, each checked: a tool offered, arguments valid under its schema."""
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
    for tool_call in choice.message.tool_calls:
        assert tool_call.type == "function" and tool_call.id.startswith("call_")
        assert tool_call.function.name in names
        jsonschema.validate(json.loads(tool_call.function.arguments), SCHEMAS[tool_call.function.name])
    return choice.message.tool_calls


@pytest.mark.integration
@pytest.mark.parametrize("env", [ROOMY], indirect=True)
def test_forced_tool_calls_are_valid_on_random_weights_streamed_or_not(env, api, start_process):
    start_worker(start_process, env, api)
    client = openai_client(env)
    for model, seed in (("laya", 1), ("kev", 2), ("laya", 3)):
        answer = client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                                max_tokens=400, temperature=1, seed=seed)
        assert 1 <= len(valid_calls(answer.choices[0], set(SCHEMAS))) <= grammar.MAX_TOOL_CALLS
        job = api.get(f"/v1/jobs/{answer.model_extra['kevlaya']['job_id']}").json()
        assert job["params"]["output"] == "tool_calls" and job["params"]["tool_choice"] == "required"

    named = client.chat.completions.create(model="kev", messages=MESSAGES, tools=TOOLS, max_tokens=400, temperature=0,
                                           tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert {c.function.name for c in valid_calls(named.choices[0], set(SCHEMAS))} == {"get_time"}
    single = client.chat.completions.create(model="laya", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                            parallel_tool_calls=False, max_tokens=400, temperature=0)
    assert len(valid_calls(single.choices[0], set(SCHEMAS))) == 1

    # max_tokens cuts the call: OpenAI's "length" with the call so far (a client reports an invalid call), never the
    # call's wire format handed over as the model's words; the stream ends the same way
    for stream in (False, True):
        cut = client.chat.completions.create(model="laya", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                             max_tokens=55, temperature=0, stream=stream)
        if stream:
            chunks = [chunk for chunk in cut if chunk.choices]
            assert all(chunk.choices[0].delta.content is None for chunk in chunks)
            deltas = [d for chunk in chunks for d in chunk.choices[0].delta.tool_calls or []]
            assert {d.index for d in deltas} == {0}
            name = "".join(d.function.name or "" for d in deltas if d.function)
            arguments = "".join(d.function.arguments or "" for d in deltas if d.function)
            finish = chunks[-1].choices[0].finish_reason
        else:
            choice = cut.choices[0]
            assert choice.message.content is None and len(choice.message.tool_calls) == 1, choice
            function, finish = choice.message.tool_calls[0].function, choice.finish_reason
            name, arguments = function.name, function.arguments
        assert finish == "length" and name in SCHEMAS and arguments.startswith("{")
        with pytest.raises(json.JSONDecodeError):
            json.loads(arguments)

    # streamed: OpenAI's tool_call deltas (index, id, type and name, then the arguments) make the stored answer
    chunks = list(client.chat.completions.create(model="laya", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                                 max_tokens=400, temperature=1, seed=4, stream=True))
    built: dict[int, dict] = {}
    for chunk in chunks:
        for delta in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            entry = built.setdefault(delta.index, {"id": None, "name": None, "arguments": ""})
            entry["id"] = delta.id or entry["id"]
            entry["name"] = (delta.function.name if delta.function else None) or entry["name"]
            entry["arguments"] += (delta.function.arguments if delta.function else None) or ""
    assert all(c.choices[0].delta.content is None for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    job = api.get(f"/v1/jobs/{chunks[-1].model_extra['kevlaya']['job_id']}").json()
    calls, _end = leading_calls(job["result"]["text"])
    assert [(e["name"], json.loads(e["arguments"])) for _i, e in sorted(built.items())] == calls and calls
    assert all(e["id"] == f"call_{job['id'].replace('-', '')}_{i}" for i, e in built.items())

    # tool_choice "none": no call, and the role answers as itself, as without tools
    plain = client.chat.completions.create(model="laya", messages=MESSAGES, tools=TOOLS, tool_choice="none",
                                           max_tokens=8, temperature=0)
    assert plain.choices[0].message.tool_calls is None and isinstance(plain.choices[0].message.content, str)
    assert api.get(f"/v1/jobs/{plain.model_extra['kevlaya']['job_id']}").json()["params"]["output"] == "decision"


@pytest.mark.integration
@pytest.mark.parametrize("env", [ROOMY], indirect=True)
def test_a_conversation_gives_calls_and_their_results_back_and_is_answered(env, api, start_process):
    start_worker(start_process, env, api)
    client = openai_client(env)
    first = client.chat.completions.create(model="laya", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=400, temperature=0)
    [made] = valid_calls(first.choices[0], set(SCHEMAS))
    conversation = [*MESSAGES, first.choices[0].message.model_dump(exclude_none=True),
                    {"role": "tool", "tool_call_id": made.id, "content": "18 C, clear"}]
    again = client.chat.completions.create(model="kev", messages=conversation, tools=TOOLS, tool_choice="required",
                                           max_tokens=400, temperature=0)
    valid_calls(again.choices[0], set(SCHEMAS))
    job = api.get(f"/v1/jobs/{again.model_extra['kevlaya']['job_id']}").json()
    assert [m["role"] for m in job["input"]["messages"]] == ["user", "assistant", "tool"]
    # auto: text or a call, whichever the grammar lets the model write; an `auto` job with tools is Laya's answer
    free = client.chat.completions.create(model="auto", messages=conversation, tools=TOOLS, max_tokens=60,
                                          temperature=0)
    choice = free.choices[0]
    assert free.model_extra["kevlaya"]["answered_by"] == "laya"
    if choice.message.tool_calls:
        valid_calls(choice, set(SCHEMAS))
    else:
        assert isinstance(choice.message.content, str) and choice.finish_reason in ("stop", "length")


@pytest.mark.integration
@pytest.mark.parametrize("env", [ROOMY], indirect=True)
@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)  # the batch path is the chat path's
def test_a_batch_line_with_tools_answers_with_the_same_tool_calls(env, api, start_process, tmp_path):
    start_worker(start_process, env, api)
    client = openai_client(env)
    body = {"model": "laya", "messages": MESSAGES, "tools": TOOLS, "tool_choice": "required", "max_tokens": 400}
    path = tmp_path / "requests.jsonl"
    path.write_text(json.dumps({"custom_id": "t1", "method": "POST", "url": "/v1/chat/completions", "body": body}))
    batch = client.batches.create(input_file_id=client.files.create(file=path.open("rb"), purpose="batch").id,
                                  endpoint="/v1/chat/completions", completion_window="24h")
    batch = wait_until(lambda: (b := client.batches.retrieve(batch.id)).status in ("completed", "failed") and b, 180,
                       interval=0.5, what="the batch to finish")
    [line] = [json.loads(raw) for raw in client.files.content(batch.output_file_id).text.splitlines()]
    choice = line["response"]["body"]["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    job = api.get(f"/v1/jobs/{line['response']['request_id']}").json()
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in choice["message"]["tool_calls"]] \
        == leading_calls(job["result"]["text"])[0]
    for made in choice["message"]["tool_calls"]:
        jsonschema.validate(json.loads(made["function"]["arguments"]), SCHEMAS[made["function"]["name"]])


@pytest.mark.parametrize(("params", "field"), [
    ({"output": "text", "tools": TOOLS}, "params.tools"),
    ({"output": "tool_calls"}, "params"),
    ({"output": "tool_calls", "tools": TOOLS, "tool_choice": "none"}, "params"),
    ({"output": "tool_calls", "tools": TOOLS, "choices": ["A"]}, "params.choices"),
])
def test_job_params_for_tools_are_refused_naming_the_field(client: TestClient, params, field):
    response = client.post("/v1/jobs", headers=AUTH, json={"adapter": "laya", "input": "Weather?", "params": params})
    assert response.status_code == 422, response.text
    assert response.json()["error"]["message"].startswith(f"{field}:"), response.json()


@pytest.fixture
def quick_chat(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KEVLAYA_LIMITS__CHAT_TIMEOUT_S", "0.2")  # read when `client` builds the app


def test_an_assistant_turn_of_calls_may_bring_no_content_in_each_way_clients_send_it(quick_chat, client: TestClient):
    """No worker runs here: each request times out, its job stored as it will run."""
    from shared.db import session_scope
    from shared.models import Job

    for assistant in ({"content": None}, {"content": ""}, {}):
        messages = [*MESSAGES, {"role": "assistant", "tool_calls": [call()], **assistant},
                    {"role": "tool", "tool_call_id": "c1", "content": "18 C"}]
        response = client.post("/v1/chat/completions", headers=AUTH,
                               json={"model": "laya", "messages": messages, "tools": TOOLS, "max_tokens": 20})
        assert response.status_code == 504, response.text
        with session_scope() as session:
            stored = session.query(Job).order_by(Job.created_at.desc()).first().input["messages"]
        assert stored[1] == {"role": "assistant", "content": None, "tool_calls": [call()]}
        assert stored[2] == {"role": "tool", "content": "18 C", "tool_call_id": "c1"}


def test_the_prompt_budget_counts_the_tools_the_worker_puts_in_the_system_prompt(quick_chat, client: TestClient):
    from shared.settings import get_settings

    budget, laya = client.app.state.intake.budget, get_settings().laya
    messages = [{"role": "user", "content": "Weather in Paris? " + "Clouds move east. " * 25}]
    params = {"output": "tool_calls", "tools": TOOLS}
    prompt = budget.prompt_tokens(model_messages({"messages": messages}, params, laya.system_prompt))
    assert prompt > budget.prompt_tokens(model_messages({"messages": messages}, {}, laya.system_prompt)) + 100
    room = budget.context_tokens - prompt
    assert 0 < room < get_settings().kev.max_new_tokens  # an `auto` job's Kev stage would not fit: it has none

    def chat(model: str, max_tokens: int) -> dict:
        response = client.post("/v1/chat/completions", headers=AUTH, json={
            "model": model, "messages": messages, "tools": TOOLS, "max_tokens": max_tokens})
        assert response.status_code in (422, 504), response.text  # 504: stored, and no worker runs here
        return response.json()

    assert chat("laya", room)["error"]["code"] == "timeout"
    assert chat("auto", room)["error"]["code"] == "timeout"  # calls are Laya's: never escalated to Kev
    over = chat("laya", room + 1)["error"]
    assert over["message"].startswith("messages:") and f"at most {room} new tokens" in over["message"]
