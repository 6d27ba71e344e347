"""Job request/response schemas shared by the API (validation) and the worker (reading params)."""

from __future__ import annotations

import json
import math
import uuid
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    StringConstraints,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)

from shared import grammar, tools
from shared.decision import offered_options

# The name of a role loaded at run time (`POST /v1/load_lora_adapter`): lower case, as Kev's and Laya's.
ROLE_NAME_PATTERN = r"^[a-z][a-z0-9_-]{0,31}$"
# `kev`, `laya`, `auto` (Laya, then Kev when she is unsure), or a role loaded at run time under a new name: whether
# such a name is a role is checked against the database when the request is taken (api/jobs/intake.py).
RequestedAdapter = Annotated[str, StringConstraints(pattern=ROLE_NAME_PATTERN), Field(
    examples=["kev", "laya", "auto"], description="the role: `kev`, `laya`, `auto` (Laya, then Kev when she is "
    "unsure), or a role loaded at run time (GET /v1/models lists them)")]
OutputFormat = Literal["decision", "text", "tool_calls"]

# Below this, sampling divides the logits by a number so small that they overflow to inf/NaN in fp16/fp32.
MIN_TEMPERATURE = 0.01
SEED_MAX = 2**31 - 1
# Bounds for what `metadata` may hold, so that every database and JSON client can store and read it back.
METADATA_MAX_DEPTH = 32
METADATA_INT_BOUND = 2**63


def check_text(value: str) -> str:
    """Text must be storable in every database and encodable by the tokenizer."""
    if "\x00" in value:
        raise ValueError("must not contain NUL (\\u0000) characters")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("must be valid Unicode: it holds a lone surrogate such as \\ud800") from None
    return value


def check_temperature(value: float | None) -> float | None:
    if value is not None and 0 < value < MIN_TEMPERATURE:
        raise ValueError(f"must be 0 (greedy) or at least {MIN_TEMPERATURE}: smaller values make sampling overflow")
    return value


def check_json_value(value: Any) -> Any:
    """Metadata: any JSON, but only what every store and client can round-trip (finite numbers, 64-bit
    integers, valid text in keys and values, bounded nesting)."""
    stack: list[tuple[Any, str, int]] = [(value, "", 0)]
    while stack:  # iterative: deep nesting must give a 422, not a RecursionError
        item, path, depth = stack.pop()
        where = f" at {path}" if path else ""
        if depth > METADATA_MAX_DEPTH:
            raise ValueError(f"nested deeper than {METADATA_MAX_DEPTH} levels{where}")
        if isinstance(item, str):
            try:
                check_text(item)
            except ValueError as exc:
                raise ValueError(f"{exc}{where}") from None
        elif isinstance(item, bool) or item is None:
            continue
        elif isinstance(item, int):
            if not -METADATA_INT_BOUND <= item < METADATA_INT_BOUND:
                raise ValueError(f"integers must fit in 64 bits{where}")
        elif isinstance(item, float):
            if not math.isfinite(item):
                raise ValueError(f"numbers must be finite (no NaN or Infinity){where}")
        elif isinstance(item, dict):
            for key, child in item.items():
                try:
                    check_text(key)
                except ValueError as exc:
                    raise ValueError(f"key {path + '.' if path else ''}{key!r}: {exc}") from None
                stack.append((child, f"{path}.{key}" if path else key, depth + 1))
        elif isinstance(item, list):
            stack.extend((child, f"{path}[{i}]", depth + 1) for i, child in enumerate(item))
    return value


def check_not_blank(value: str) -> str:
    if not value.strip():
        raise ValueError("must not be blank (whitespace only)")
    return value


Text = Annotated[str, AfterValidator(check_text)]
NonBlankText = Annotated[Text, Field(min_length=1), AfterValidator(check_not_blank)]


class RequestModel(BaseModel):
    """A request body: unknown fields are refused, and JSON types are taken as they are (strict): `true` is not
    the number 1, `"5"` is not a number and `0` is not `false`, so a client's mistake is a 422 naming the field,
    never a value it did not mean."""

    model_config = ConfigDict(extra="forbid", strict=True)


def not_bool(value: Any) -> Any:
    """Before a Literal of a number (pydantic compares literals by equality, so `true` would pass as 1)."""
    if isinstance(value, bool):
        raise ValueError("must be a number, not a boolean")
    return value


def only_bool(value: Any) -> Any:
    """Before a Literal of a boolean (`0` would otherwise pass as `false`)."""
    if value is not None and not isinstance(value, bool):
        raise ValueError("must be a boolean")
    return value
Temperature = Annotated[
    float | None,
    Field(default=None, ge=0, le=2, allow_inf_nan=False,
          description=f"0 = greedy; otherwise at least {MIN_TEMPERATURE}",
          json_schema_extra={"not": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": MIN_TEMPERATURE}}),
    AfterValidator(check_temperature),
]
TopP = Annotated[float | None, Field(default=None, gt=0, le=1, allow_inf_nan=False)]
Seed = Annotated[int | None, Field(default=None, ge=0, le=SEED_MAX)]
MAX_STOP_STRINGS = 4  # OpenAI's limit
MAX_CHOICES = 32
MAX_TOP_LOGPROBS = 20  # OpenAI's limit


def check_unique(values: list[str]) -> list[str]:
    repeated = sorted({v for v in values if values.count(v) > 1})
    if repeated:
        raise ValueError(f"each choice once: {', '.join(map(repr, repeated))} repeated")
    return values


Label = Annotated[NonBlankText, Field(max_length=100)]
StopString = Annotated[Text, Field(min_length=1, max_length=100)]
Stop = Annotated[
    StopString | list[StopString] | None,
    Field(default=None, description=f"up to {MAX_STOP_STRINGS} strings; the answer ends before the first of them "
          "(it is not part of the text)"),
]


def check_stop(value: str | list[str] | None) -> str | list[str] | None:
    if isinstance(value, list) and len(value) > MAX_STOP_STRINGS:
        raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
    return value


def check_top_logprobs(value: int | None, info: ValidationInfo) -> int | None:
    """top_logprobs goes with logprobs: true (declared before it), as OpenAI requires."""
    if value is not None and not info.data.get("logprobs"):
        raise ValueError("needs logprobs: true")
    return value


def stop_strings(value: str | list[str] | None) -> list[str]:
    return [value] if isinstance(value, str) else list(value or [])


class JsonSchemaSpec(RequestModel):
    """OpenAI's `response_format.json_schema`."""

    model_config = ConfigDict(validate_by_name=True, serialize_by_alias=True)

    name: Annotated[Text, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
    description: Text | None = None
    json_schema: dict[str, Any] = Field(alias="schema", description="the JSON schema the answer must validate against")
    strict: bool | None = Field(default=None, description="the schema is always enforced, strict or not")

    @field_validator("json_schema")
    @classmethod
    def _enforceable(cls, value: dict[str, Any]) -> dict[str, Any]:
        grammar.json_grammar(value)  # GrammarError (a ValueError): a 422 naming the feature, never a runtime failure
        return value


class ResponseFormat(RequestModel):
    """OpenAI's `response_format`: `text` (free), `json_object` (any JSON object) or `json_schema`."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = Field(default=None, description="with type json_schema, and only then")

    @field_validator("json_schema")
    @classmethod
    def _only_with_its_type(cls, value: JsonSchemaSpec | None, info: ValidationInfo) -> JsonSchemaSpec | None:
        if value is not None and info.data.get("type") != "json_schema":
            raise ValueError("only with type 'json_schema'")
        return value

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type 'json_schema' needs json_schema: {name, schema}")
        return self


class TextPart(RequestModel):
    """OpenAI-style content part; only text is supported."""

    type: Literal["text"]
    text: Text


# OpenAI's rules for a function's name.
ToolName = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
CallId = Annotated[Text, Field(min_length=1, max_length=100)]
MAX_TOOLS = 128  # OpenAI's limit


def check_arguments(value: str) -> str:
    """A call's arguments: a JSON object, as a string (chat's tool_calls, the Responses API's function_call items)."""
    try:
        parsed = json.loads(value)
    except ValueError:
        raise ValueError("must be a JSON object, as a string") from None
    if not isinstance(parsed, dict):
        raise ValueError("must be a JSON object, as a string")
    return value


class CalledFunction(RequestModel):
    name: ToolName
    arguments: Annotated[Text, AfterValidator(check_arguments)] = Field(
        description="the call's arguments: a JSON object, as a string")


class ToolCall(RequestModel):
    """A call an assistant message made (OpenAI's `tool_calls` item), given back in a conversation."""

    id: CallId
    type: Literal["function"]
    function: CalledFunction


class Message(RequestModel):
    role: Literal["system", "user", "assistant", "tool"]
    content: NonBlankText | Annotated[list[TextPart], Field(min_length=1)] | None = Field(
        default=None, description="a string, or a list of text parts (`[{\"type\": \"text\", \"text\": \"...\"}]`), "
        "which are joined with newlines; only an assistant message with `tool_calls` may leave it out"
    )
    tool_calls: Annotated[list[ToolCall], Field(min_length=1, max_length=grammar.MAX_TOOL_CALLS)] | None = Field(
        default=None, description="an assistant message's calls")
    tool_call_id: CallId | None = Field(default=None, description="a `tool` message: the call it answers")
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")] | None = Field(
        default=None, description="who speaks, among several of one role (OpenAI's optional `name`): the prompt "
        "gives the message as `<name>: <content>`, since no base's chat template has a place for it")

    @model_validator(mode="before")
    @classmethod
    def _empty_beside_calls(cls, data: Any) -> Any:
        """An assistant message with calls may bring `""` for no content, as some clients send it."""
        if isinstance(data, dict) and data.get("tool_calls") and data.get("content") == "":
            return {**data, "content": None}
        return data

    @field_validator("content")
    @classmethod
    def _parts_to_text(cls, value: str | list[TextPart] | None) -> str | None:
        if value is None or isinstance(value, str):
            return value
        text = "\n".join(part.text for part in value)
        if not text.strip():
            raise ValueError("the text parts are all blank")
        return text

    @model_validator(mode="after")
    def _fields_fit_role(self) -> Message:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content: required (only an assistant message with tool_calls may leave it out)")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("tool_calls: only in an assistant message")
        if (self.tool_call_id is None) is (self.role == "tool"):
            raise ValueError("tool_call_id: required in a tool message, and only there")
        if self.name is not None and self.role == "tool":
            raise ValueError("name: not in a tool message (its call id names the call it answers)")
        return self

    @model_serializer(mode="wrap")
    def _without_absent(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """Stored as sent: a message without tools keeps its two keys."""
        return {key: value for key, value in handler(self).items() if value is not None or key == "content"}


def check_tool_turns(messages: list[Message]) -> list[Message]:
    """A `tool` message answers a call of the assistant message before it (other results of its calls between)."""
    calls: set[str] = set()
    for i, message in enumerate(messages):
        if message.role == "tool":
            if message.tool_call_id not in calls:
                raise ValueError(f"messages[{i}].tool_call_id: {message.tool_call_id!r} is no call of the assistant "
                                 "message before it")
            continue
        calls = {call.id for call in message.tool_calls or []}
    return messages


Messages = Annotated[list[Message], Field(min_length=1), AfterValidator(check_tool_turns)]


class MessagesInput(RequestModel):
    messages: Messages


def check_parameters(value: dict[str, Any] | None) -> dict[str, Any] | None:
    """A function's arguments schema (chat's tools, the Responses API's function tools): an object's, and one the
    tools' grammar can enforce."""
    if value is not None:
        if value.get("type", "object") != "object":
            raise ValueError("must be the schema of an object (type: object)")
        # GrammarError (a ValueError): a 422 naming the feature, never a runtime failure
        grammar.tool_calls_grammar({"f": value}, False, None)
    return value


def check_unique_names(names: list[str]) -> None:
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ValueError(f"each function name once: {', '.join(map(repr, repeated))} repeated")


class FunctionSpec(RequestModel):
    """OpenAI's function tool definition."""

    name: ToolName
    description: Annotated[Text, Field(max_length=4096)] | None = None
    parameters: dict[str, Any] | None = Field(
        default=None, description="the arguments' JSON schema (an object); left out, no arguments")
    strict: bool | None = Field(default=None, description="the schema is always enforced, strict or not")

    _enforceable = field_validator("parameters")(check_parameters)


class Tool(RequestModel):
    type: Literal["function"]
    function: FunctionSpec


class ChosenFunction(RequestModel):
    name: ToolName


class NamedToolChoice(RequestModel):
    type: Literal["function"]
    function: ChosenFunction


ToolChoice = Literal["auto", "none", "required"] | NamedToolChoice


def check_tools(value: list[Tool] | None) -> list[Tool] | None:
    check_unique_names([tool.function.name for tool in value or []])
    return value


Tools = Annotated[list[Tool], Field(min_length=1, max_length=MAX_TOOLS), AfterValidator(check_tools)]


def check_tool_choice(value: ToolChoice | None, info: ValidationInfo) -> ToolChoice | None:
    """tool_choice goes with the tools (declared before it): a forced call needs them, a named one names one."""
    if value is None or value in ("auto", "none") or "tools" not in info.data:
        return value  # tools that failed their own validation are reported there
    tools = info.data["tools"] or []
    if not tools:
        raise ValueError("needs tools")
    if isinstance(value, NamedToolChoice) and value.function.name not in {t.function.name for t in tools}:
        raise ValueError(f"names no function of tools: {value.function.name!r}")
    return value


class JobParams(RequestModel):
    """Generation overrides; anything left out takes the adapter's configured default."""

    max_new_tokens: int | None = Field(default=None, ge=1)
    temperature: Temperature = None
    top_p: TopP = None
    seed: Seed = None
    output: OutputFormat = Field(
        default="decision",
        description="'decision': the answer is generated under the decision grammar (the job fails with `length` "
        "only if max_new_tokens runs out before its decision object closes); 'text': the raw text is the result, "
        "a decision is attached when one parses and names an option the input offers (its `Options:` line) or none; "
        "'tool_calls': the answer is generated under the tools' grammar (`tools`, `tool_choice`)",
    )
    tools: Tools | None = Field(default=None, description="for output 'tool_calls': the function tools an answer "
                                "may call, in the system prompt and in the grammar")
    tool_choice: ToolChoice | None = Field(
        default=None, description="for output 'tool_calls': `auto` (text or calls, the default), `required` (calls "
        "only) or `{type: function, function: {name}}` (a call of that one)")
    _choice_fits_tools = field_validator("tool_choice")(check_tool_choice)
    parallel_tool_calls: bool | None = Field(default=None, description=f"for output 'tool_calls': up to "
                                             f"{grammar.MAX_TOOL_CALLS} calls (the default), or false: one")
    choices: Annotated[list[Label], Field(min_length=1, max_length=MAX_CHOICES), AfterValidator(check_unique)] | None = (
        Field(default=None, description="the option labels a decision may name (\"none\" is always allowed); "
              "left out, the options listed on the input's `Options:` line, else any label"))
    response_format: ResponseFormat | None = Field(
        default=None, description="for output 'text': `text` (free), `json_object` or `json_schema` (the answer is "
        "generated under that schema)")
    stop: Annotated[Stop, AfterValidator(check_stop)] = None
    logprobs: bool | None = Field(default=None, description="return each answer token's log-probability under the "
                                  "model's own distribution (before temperature and top-p)")
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS, description="with logprobs: also "
                                     "the most likely tokens at each position, with theirs")

    # `output` is declared first, so these see it; each error names the field that does not fit the output.
    @field_validator("response_format")
    @classmethod
    def _format_fits_output(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None and value.type != "text" and info.data.get("output") == "decision":
            raise ValueError("applies to output 'text': a decision's format is the decision object")
        return value

    @field_validator("stop")
    @classmethod
    def _stop_fits_output(cls, value: Any, info: ValidationInfo) -> Any:
        if value and info.data.get("output") == "decision":
            raise ValueError("applies to output 'text': a decision ends with its decision object")
        return value

    _top_needs_logprobs = field_validator("top_logprobs")(check_top_logprobs)

    @field_validator("choices")
    @classmethod
    def _choices_fit_output(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None and info.data.get("output", "decision") != "decision":
            raise ValueError("applies to output 'decision'")
        return value

    @field_validator("tools", "parallel_tool_calls")
    @classmethod
    def _tools_fit_output(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None and info.data.get("output", "tool_calls") != "tool_calls":
            raise ValueError("applies to output 'tool_calls'")
        return value

    @model_validator(mode="after")
    def _tool_calls_have_tools(self) -> JobParams:
        if self.output == "tool_calls" and not self.tools:
            raise ValueError("output 'tool_calls' needs tools")
        if self.tool_choice == "none":
            raise ValueError("tool_choice 'none': leave the tools out (output 'text' or 'decision')")
        if self.tool_choice is not None and self.output != "tool_calls":
            raise ValueError("tool_choice applies to output 'tool_calls'")
        return self


class JobCreate(RequestModel):
    adapter: RequestedAdapter
    input: NonBlankText | MessagesInput
    params: JobParams = Field(default_factory=JobParams)
    idempotency_key: Annotated[NonBlankText, Field(max_length=200)] | None = None
    metadata: Annotated[dict[str, Any], AfterValidator(check_json_value)] | None = None

    def messages(self) -> list[dict[str, str]]:
        return to_messages(self.input if isinstance(self.input, str) else self.input.model_dump())

    def row_columns(self) -> dict[str, Any]:
        """Columns of the job's row beyond those every job has: a response's (api/openai/responses/schemas.py)."""
        return {}

    def prompt_chars(self) -> int:
        return sum(len(m["content"]) for m in self.messages())


class JobBatchCreate(RequestModel):
    jobs: list[JobCreate] = Field(min_length=1)


def to_messages(stored_input: str | dict[str, Any]) -> list[dict[str, str]]:
    """A job's input as chat messages, whether it was submitted as a string or as messages (tool calls and their
    results as plain turns: shared/tools.py)."""
    if isinstance(stored_input, str):
        return [{"role": "user", "content": stored_input}]
    return tools.chat_turns(stored_input["messages"])


def model_messages(stored_input: str | dict[str, Any], params: dict[str, Any],
                   system_prompt: str) -> list[dict[str, str]]:
    """The messages the model sees for a job: its own, after the adapter's system prompt (unless it brings one),
    with its tools in the system message. The worker builds the prompt from these, the API counts them."""
    return tools.with_tools(with_system_prompt(to_messages(stored_input), system_prompt), params)


def job_choices(params: dict[str, Any], messages: list[dict[str, str]]) -> list[str] | None:
    """The options a job's decision may name besides "none": `params.choices`, else those its question lists on
    an `Options:` line, else None (any)."""
    return params.get("choices") or offered_options("\n".join(m["content"] for m in messages if m["role"] == "user"))


def answer_grammar(params: dict[str, Any], messages: list[dict[str, str]],
                   analysis: bool) -> str | grammar.OwnOptionsDecision | None:
    """The grammar a stored job's answer is generated under (shared/grammar.py), or None: free text. A decision
    names one of the options the question offers, or, where it offers none the service can read, one of those
    the answer itself lists."""
    output = params.get("output", "decision")
    if output == "decision":
        choices = job_choices(params, messages)
        if choices:
            return grammar.decision_grammar(choices, analysis)
        return grammar.OwnOptionsDecision(analysis, "\n".join(m["content"] for m in messages if m["role"] == "user"))
    response_format = params.get("response_format") or {"type": "text"}
    schema = ({"type": "object"} if response_format["type"] == "json_object"
              else response_format["json_schema"]["schema"] if response_format["type"] == "json_schema" else None)
    if output == "tool_calls":
        # required or a named function: calls alone; auto: calls, or the answer response_format asks (text)
        forced = (params.get("tool_choice") or "auto") != "auto"
        return grammar.tool_calls_grammar(tools.offered_functions(params),
                                          params.get("parallel_tool_calls") is not False,
                                          None if forced else schema or "text")
    return None if schema is None else grammar.json_grammar(schema)


def with_system_prompt(messages: list[dict[str, str]], system_prompt: str) -> list[dict[str, str]]:
    """The messages the model sees: the adapter's system prompt first, unless the job brings its own."""
    if messages[0]["role"] != "system" and system_prompt:
        return [{"role": "system", "content": system_prompt}, *messages]
    return messages


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class JobResult(BaseModel):
    text: str | None
    decision: dict[str, Any] | None
    finish_reason: Literal["stop", "length"] | None = Field(
        default=None, description="stop: the answer ended (end of sequence, its grammar complete, or a stop "
        "string, which is cut from the text); length: max_new_tokens ran out")
    logprobs: list[TokenLogprob] | None = Field(
        default=None, description="with params.logprobs: each token of the text, in OpenAI's format")


class JobError(BaseModel):
    code: str
    message: str | None


class JobTimings(BaseModel):
    queue_ms: float | None = Field(description="waiting for a batch: created to claimed")
    prefill_ms: float | None = Field(description="the prefill of the forward pass it shared")
    ttft_ms: float | None = Field(description="time to first token: created to its first generated token")
    decode_ms: float | None = Field(description="its own decode: its first generated token to its last")
    total_ms: float | None = Field(description="created to finished")


class JobTokens(BaseModel):
    prompt: int | None
    completion: int | None


class JobAccepted(BaseModel):
    id: uuid.UUID
    status: str
    adapter: RequestedAdapter
    created_at: datetime


class JobStage(BaseModel):
    """One step of an `auto` job that was escalated: Laya's answer, then Kev's."""

    id: uuid.UUID
    adapter: str
    adapter_version: str | None = Field(default=None, description="the sha256 of the adapter version that wrote "
                                        "this stage's answer")
    status: str
    result: JobResult | None
    error: JobError | None
    timings: JobTimings
    tokens: JobTokens


class JobOut(BaseModel):
    id: uuid.UUID
    status: str
    adapter: str = Field(description="the adapter that runs it first: the requested one, laya for `auto`")
    requested_adapter: RequestedAdapter
    answered_by: str | None = Field(
        default=None, description="the adapter whose answer (or failure) the job ended with: the requested one, or "
        "for `auto` laya, kev once Laya escalated; null while queued or running, and when cancelled")
    adapter_version: str | None = Field(
        default=None, description="the version of `answered_by` that wrote the answer: the sha256 of its config and "
        "weights (GET /v1/models); null until answered, when the model wrote nothing, and for jobs finished before "
        "versions were recorded")
    input: str | dict[str, Any]
    params: dict[str, Any]
    metadata: dict[str, Any] | None
    result: JobResult | None
    error: JobError | None
    timings: JobTimings
    tokens: JobTokens
    attempts: int
    batch_id: uuid.UUID | None
    parent_job_id: uuid.UUID | None
    cascade: list[JobStage] | None = Field(
        default=None, description="for an escalated `auto` job: Laya's stage, then Kev's (whose answer is the result)"
    )
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None


class JobPage(BaseModel):
    jobs: list[JobOut]
    next_cursor: str | None


class JobDeleted(BaseModel):
    """A finished job deleted by `DELETE /v1/jobs/{id}`, with its `auto` stages."""

    id: uuid.UUID
    deleted: bool = True


class JobBatchAccepted(BaseModel):
    jobs: list[JobAccepted]
