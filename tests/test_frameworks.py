"""Unmodified framework clients against a real API and worker on the tiny random-weight model (issue 53): LangChain's
`ChatOpenAI` (invoke, stream, batch, structured output by each of its methods, tools under each tool_choice, a tool
result sent back) and LiteLLM's `completion` (plain, streamed, a pydantic response_format, tools). The model writes
noise, so each answer's shape and validity are checked, never its content: structured output parses, calls name an
offered tool with arguments valid under its schema, a stream adds up to the stored answer.

Two findings of these clients are fixed and kept here: a message's `name` (LangChain sends it) was refused, and a
forced call cut by max_tokens came back as text in the server's wire format."""

from __future__ import annotations

import json
import socket
from typing import Any, Literal

import httpx
import jsonschema
import pytest
from pydantic import BaseModel, ConfigDict, Field

from tests.conftest import API_KEY, start_worker

# The tiny model's tokenizer takes a token per byte: the tools in the system prompt and up to 8 calls need more than
# the default window (as in tests/test_chat_tools.py).
ROOMY = {"KEVLAYA_ENGINE__WINDOW_TOKENS": "2048"}

pytestmark = [
    pytest.mark.integration,
    pytest.mark.parametrize("env", [ROOMY], indirect=True),
    # what a client sends does not depend on the database
    pytest.mark.parametrize("database_url", ["sqlite"], indirect=True),
]


class GetWeather(BaseModel):
    """The weather now in a city."""

    # additionalProperties: false. An open schema admits any extra key, and so does the grammar: random weights then
    # write one until max_tokens (modellab/bench/results/tool-choice-2026-12-07/README.md, open schemas).
    model_config = ConfigDict(extra="forbid")
    city: Literal["Paris", "Rome"]
    unit: Literal["C", "F"]


class GetTime(BaseModel):
    """The time now in a zone."""

    model_config = ConfigDict(extra="forbid")
    zone: Literal["UTC", "CET"]
    hours_ahead: int = Field(default=0, ge=0, le=12)


class Weather(BaseModel):
    """A weather report."""

    model_config = ConfigDict(extra="forbid")
    city: Literal["Paris", "Rome"]
    degrees: int = Field(ge=-30, le=50)
    windy: bool


QUESTION = "What is the weather in Paris, and what time is it there?"
LOCAL = ("127.0.0.1", "localhost", "::1")


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """No tracing, no cost map, no tokenizer download: neither library may reach beyond this machine, and a
    connection anywhere else fails the test."""
    for name, value in {"LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_OFFLINE_MODE": "true",
                        "LANGSMITH_TRACING": "false", "LANGCHAIN_TRACING_V2": "false"}.items():
        monkeypatch.setenv(name, value)
    connect, lookup = socket.socket.connect, socket.getaddrinfo

    def local_connect(self: socket.socket, address: Any) -> Any:
        if self.family in (socket.AF_INET, socket.AF_INET6) and address[0] not in LOCAL:
            raise AssertionError(f"a connection beyond this machine: {address}")
        return connect(self, address)

    def local_lookup(host: Any, *args: Any, **kwargs: Any) -> Any:
        if host not in LOCAL and host is not None:
            raise AssertionError(f"a name lookup beyond this machine: {host}")
        return lookup(host, *args, **kwargs)

    monkeypatch.setattr(socket.socket, "connect", local_connect)
    monkeypatch.setattr(socket, "getaddrinfo", local_lookup)


def base_url(env: dict[str, str]) -> str:
    return f"http://127.0.0.1:{env['KEVLAYA_API__PORT']}/v1"


class Sent:
    """The JSON bodies a client sends, recorded by an httpx hook on the client it is given: what the test saw go
    out, for the failure message and for the checks of what the client turned a parameter into."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.http = httpx.Client(event_hooks={"request": [self._record]}, timeout=120)

    def _record(self, request: httpx.Request) -> None:
        self.bodies.append(json.loads(request.content) if request.content else {})

    @property
    def last(self) -> dict[str, Any]:
        return self.bodies[-1]


@pytest.fixture
def sent() -> Sent:
    recorder = Sent()
    yield recorder
    recorder.http.close()


def chat_openai(env: dict[str, str], sent: Sent, **options: Any):  # noqa: ANN201
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(model=options.pop("model", "laya"), base_url=base_url(env), api_key=API_KEY, max_retries=0,
                      timeout=120, http_client=sent.http, **options)


def newest_job(api: httpx.Client) -> dict[str, Any]:
    return api.get("/v1/jobs", params={"limit": 1}).json()["jobs"][0]


def tool_schemas(tools: list[Any]) -> dict[str, dict[str, Any]]:
    """Each tool's name and the JSON schema of its arguments, as LangChain sends them."""
    from langchain_core.utils.function_calling import convert_to_openai_tool

    return {t["function"]["name"]: t["function"]["parameters"] for t in map(convert_to_openai_tool, tools)}


def check_calls(calls: list[dict[str, Any]], schemas: dict[str, dict[str, Any]], named: str | None = None) -> None:
    """LangChain's parsed calls: each names a tool offered (the named one, when named), its arguments valid."""
    assert calls
    for call in calls:
        assert call["name"] in schemas and call["id"].startswith("call_"), call
        assert named is None or call["name"] == named, call
        jsonschema.validate(call["args"], schemas[call["name"]])


# -- LangChain's ChatOpenAI ---------------------------------------------------------------------------------------


def test_langchain_invoke_stream_and_batch(env, api, start_process, offline, sent: Sent):
    start_worker(start_process, env, api)
    llm = chat_openai(env, sent, max_tokens=60)

    answer = llm.invoke("Which is better, trains or buses?")
    assert isinstance(answer.content, str) and answer.content
    assert answer.response_metadata["finish_reason"] in ("stop", "length")
    assert answer.response_metadata["id"] == f"chatcmpl-{newest_job(api)['id']}"
    assert answer.usage_metadata["output_tokens"] >= 1

    # stream_usage: LangChain asks for the usage chunk (stream_options.include_usage)
    chunks = list(chat_openai(env, sent, max_tokens=60, stream_usage=True).stream("Which is better, trains or buses?"))
    assert sent.last["stream"] is True and sent.last["stream_options"] == {"include_usage": True}
    whole = chunks[0]
    for chunk in chunks[1:]:
        whole += chunk
    assert len(chunks) > 2 and whole.response_metadata["finish_reason"] in ("stop", "length")
    job = newest_job(api)
    assert whole.content == job["result"]["text"]  # every piece, in order, none twice
    assert whole.usage_metadata["output_tokens"] == job["tokens"]["completion"]

    answers = llm.batch(["Trains or buses?", "Tea or coffee?", "Rome or Paris?"])
    assert len(answers) == 3 and all(isinstance(a.content, str) and a.content for a in answers)
    assert len({a.response_metadata["id"] for a in answers}) == 3
    # kev, and auto (Laya's answer, or Kev's after an escalation) answer LangChain too
    for model in ("kev", "auto"):
        assert isinstance(chat_openai(env, sent, model=model, max_tokens=60).invoke("Tea or coffee?").content, str)


@pytest.mark.parametrize("method", ["json_schema", "function_calling", "json_mode"])
def test_langchain_structured_output_by_each_method(env, api, start_process, offline, sent: Sent, method):
    start_worker(start_process, env, api)
    # json_mode asks for any JSON object (response_format json_object): the schema is the prompt's to convey, so
    # LangChain hands back a dict; the other two methods have the server enforce the schema. Any object admits
    # strings of any length, which random weights write until max_tokens: json_mode samples greedily.
    schema = Weather.model_json_schema() if method == "json_mode" else Weather
    for seed in (1, 2, 3):
        structured = chat_openai(env, sent, max_tokens=300, temperature=0 if method == "json_mode" else 1,
                                 seed=seed).with_structured_output(
            schema, method=method, include_raw=True)
        out = structured.invoke("Report the weather in Paris as JSON.")
        assert out["parsing_error"] is None, (out, sent.last)
        if method == "json_mode":
            assert sent.last["response_format"] == {"type": "json_object"}
            assert isinstance(out["parsed"], dict), out
        else:
            assert isinstance(out["parsed"], Weather), (out, sent.last)
        if method == "function_calling":  # a call of the schema's function, one only
            assert sent.last["tool_choice"] == {"type": "function", "function": {"name": "Weather"}}
            assert sent.last["parallel_tool_calls"] is False
            assert out["raw"].response_metadata["finish_reason"] == "tool_calls"
        if method == "json_schema":
            assert sent.last["response_format"]["type"] == "json_schema"
    # without include_raw: the parsed value itself
    plain = chat_openai(env, sent, max_tokens=300, temperature=0).with_structured_output(schema, method=method)
    assert isinstance(plain.invoke("Rome?"), dict if method == "json_mode" else Weather)


@pytest.mark.parametrize("tool_choice", ["auto", "any", "required", "GetTime", "none"])
def test_langchain_bind_tools_under_each_tool_choice(env, api, start_process, offline, sent: Sent, tool_choice):
    start_worker(start_process, env, api)
    tools = [GetWeather, GetTime]
    schemas = tool_schemas(tools)
    llm = chat_openai(env, sent, max_tokens=800).bind_tools(tools, tool_choice=tool_choice)
    for seed in (1, 2, 3):
        answer = llm.invoke(QUESTION, seed=seed)
        finish = answer.response_metadata["finish_reason"]
        assert answer.invalid_tool_calls == [], answer
        if tool_choice in ("any", "required", "GetTime"):
            # LangChain's "any" is OpenAI's "required"; a tool's name is {type: function, function: {name}}
            assert sent.last["tool_choice"] == ({"type": "function", "function": {"name": "GetTime"}}
                                                if tool_choice == "GetTime" else "required")
            assert finish == "tool_calls" and answer.content == "", answer
            check_calls(answer.tool_calls, schemas, named="GetTime" if tool_choice == "GetTime" else None)
        elif tool_choice == "none":
            assert sent.last["tool_choice"] == "none"
            assert answer.tool_calls == [] and isinstance(answer.content, str) and answer.content
        elif answer.tool_calls:  # auto: calls, or text that does not open one
            assert finish == "tool_calls"
            check_calls(answer.tool_calls, schemas)
        else:
            assert isinstance(answer.content, str) and not answer.content.startswith("<tool_call>"), answer
            assert finish in ("stop", "length")

    if tool_choice == "required":  # streamed: the call chunks add up to the same well-formed calls
        chunks = list(llm.stream(QUESTION, seed=4))
        whole = chunks[0]
        for chunk in chunks[1:]:
            whole += chunk
        assert whole.response_metadata["finish_reason"] == "tool_calls" and whole.invalid_tool_calls == []
        check_calls(whole.tool_calls, schemas)
        job = newest_job(api)
        assert len(whole.tool_calls) == job["result"]["text"].count("<tool_call>")


def test_langchain_sends_a_tool_result_back_and_is_answered(env, api, start_process, offline, sent: Sent):
    from langchain_core.messages import HumanMessage, SystemMessage, ToolMessage

    start_worker(start_process, env, api)
    schemas = tool_schemas([GetWeather, GetTime])
    llm = chat_openai(env, sent, max_tokens=800, temperature=0)
    forced = llm.bind_tools([GetWeather, GetTime], tool_choice="required", parallel_tool_calls=False)
    messages = [SystemMessage("You answer with the tools' help."), HumanMessage(QUESTION)]
    first = forced.invoke(messages)
    check_calls(first.tool_calls, schemas)
    assert len(first.tool_calls) == 1
    messages += [first, ToolMessage("18 C, clear", tool_call_id=first.tool_calls[0]["id"])]
    again = forced.invoke(messages)
    assert [m["role"] for m in sent.last["messages"]] == ["system", "user", "assistant", "tool"]
    check_calls(again.tool_calls, schemas)
    stored = newest_job(api)["input"]["messages"]
    assert stored[2]["tool_calls"][0]["id"] == first.tool_calls[0]["id"] and stored[3]["content"] == "18 C, clear"
    # the conversation's last word: no tools forced, text or a call
    final = llm.bind_tools([GetWeather, GetTime]).invoke(messages)
    assert final.invalid_tool_calls == [] and (final.tool_calls or isinstance(final.content, str))


def test_langchain_messages_with_a_name(env, api, start_process, offline, sent: Sent):
    """LangChain sends a message's `.name` (a named HumanMessage, an agent's AIMessage named by
    create_agent(name=...)) as OpenAI's optional `name`: taken, kept, and given to the model."""
    from langchain_core.messages import AIMessage, HumanMessage

    start_worker(start_process, env, api)
    llm = chat_openai(env, sent, max_tokens=40)
    answer = llm.invoke([HumanMessage("Tea or coffee?", name="ana"), AIMessage("Tea.", name="helper"),
                         HumanMessage("Why?", name="ana")])
    assert sent.last["messages"][0] == {"content": "Tea or coffee?", "name": "ana", "role": "user"}
    assert isinstance(answer.content, str)
    assert [m.get("name") for m in newest_job(api)["input"]["messages"]] == ["ana", "helper", "ana"]


def test_langchain_a_forced_call_cut_short_is_an_invalid_call_not_text(env, api, start_process, offline,
                                                                       sent: Sent):
    """max_tokens cuts a forced call: LangChain gets OpenAI's `length` with the call so far, and reports it as an
    invalid call, never as the model's words."""
    start_worker(start_process, env, api)
    llm = chat_openai(env, sent, max_tokens=55).bind_tools([GetWeather, GetTime], tool_choice="required")
    answer = llm.invoke(QUESTION)
    assert answer.response_metadata["finish_reason"] == "length"
    assert answer.content == "" and answer.tool_calls == [], answer
    (invalid,) = answer.invalid_tool_calls
    assert invalid["name"] in ("GetWeather", "GetTime") and invalid["id"].startswith("call_")


# -- LiteLLM ------------------------------------------------------------------------------------------------------


def litellm_completion(env: dict[str, str], **params: Any):  # noqa: ANN201
    """`litellm.completion` on this service as an OpenAI-compatible provider (`openai/<model>`, `api_base`)."""
    import litellm  # imported here: it takes seconds, and the offline fixture's settings must come first

    return litellm.completion(model=f"openai/{params.pop('model', 'laya')}", api_base=base_url(env), api_key=API_KEY,
                              num_retries=0, timeout=120, **params)


def test_litellm_completion_plain_streamed_structured_and_with_tools(env, api, start_process, offline):
    import litellm

    start_worker(start_process, env, api)
    messages = [{"role": "user", "content": QUESTION}]

    plain = litellm_completion(env, messages=messages, max_tokens=60)
    assert plain.id == f"chatcmpl-{newest_job(api)['id']}"
    assert isinstance(plain.choices[0].message.content, str) and plain.choices[0].finish_reason in ("stop", "length")

    chunks = list(litellm_completion(env, messages=messages, max_tokens=60, stream=True))
    rebuilt = litellm.stream_chunk_builder(chunks, messages=messages)
    job = api.get(f"/v1/jobs/{chunks[0].id.removeprefix('chatcmpl-')}").json()
    assert rebuilt.choices[0].message.content == job["result"]["text"]
    assert rebuilt.choices[0].finish_reason in ("stop", "length")

    for seed in (1, 2):  # a pydantic class as response_format: LiteLLM sends its strict json_schema
        structured = litellm_completion(env, messages=messages, max_tokens=200, response_format=Weather, seed=seed)
        assert isinstance(Weather.model_validate_json(structured.choices[0].message.content), Weather)

    tools = [{"type": "function", "function": {"name": name, "description": model.__doc__,
                                               "parameters": model.model_json_schema()}}
             for name, model in (("get_weather", GetWeather), ("get_time", GetTime))]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}

    def check(message: Any, named: str | None = None) -> None:
        assert message.tool_calls
        for call in message.tool_calls:
            assert call.function.name in schemas and (named is None or call.function.name == named)
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])

    for choice, named in (("required", None), ({"type": "function", "function": {"name": "get_time"}}, "get_time")):
        answer = litellm_completion(env, messages=messages, max_tokens=800, tools=tools, tool_choice=choice)
        assert answer.choices[0].finish_reason == "tool_calls"
        check(answer.choices[0].message, named)
    chunks = list(litellm_completion(env, messages=messages, max_tokens=800, tools=tools, tool_choice="required",
                                     stream=True, seed=5))
    rebuilt = litellm.stream_chunk_builder(chunks, messages=messages)
    assert rebuilt.choices[0].finish_reason == "tool_calls"
    check(rebuilt.choices[0].message)
    auto = litellm_completion(env, messages=messages, max_tokens=200, tools=tools)  # auto: text or a call
    if auto.choices[0].message.tool_calls:
        check(auto.choices[0].message)
    else:
        assert not auto.choices[0].message.content.startswith("<tool_call>")
    unforced = litellm_completion(env, messages=messages, max_tokens=60, tools=tools, tool_choice="none")
    assert not unforced.choices[0].message.tool_calls and isinstance(unforced.choices[0].message.content, str)
