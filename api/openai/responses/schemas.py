"""The Responses API's request and its `response` object, in OpenAI's shapes (docs/architecture.md §17).

A request becomes a job (`ResponsesRequest.to_job`): its input items and instructions become the chat messages a
job holds (a previous response's conversation first), its function tools, `tool_choice` and `text.format` become
the job's params as chat's do, and what the job's row does not hold (the request as it came, the response it
continues, `store`) goes in the columns of migration 0011. A job is shown as a response (`response_object`) from
the row alone, so a response survives restarts like any job. Chat's building blocks carry it all: messages and
tools (shared/schemas.py, shared/tools.py) and the answer's calls (api/openai/chat/schemas.py)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    ValidationInfo,
    field_validator,
)

from api.http.errors import ApiError
from api.jobs.prompt_budget import FieldNames
from api.openai.chat.schemas import KevlayaExtra, answer_calls, answer_text, chat_answered
from api.openai.ids import parse_id
from shared.models import Job
from shared.schemas import (
    MAX_TOOLS,
    CallId,
    FunctionSpec,
    JobCreate,
    JobOut,
    JobParams,
    JsonSchemaSpec,
    MessagesInput,
    NonBlankText,
    RequestedAdapter,
    RequestModel,
    ResponseFormat,
    Temperature,
    Text,
    Tool,
    ToolName,
    TopP,
    check_arguments,
    check_parameters,
    check_unique_names,
    only_bool,
)
from shared.tools import leading_calls

# Limits are reported under the names this request uses.
RESPONSES_FIELDS = FieldNames(input="input", max_new_tokens="max_output_tokens", adapter="model")
RESPONSE_PREFIX = "resp_"
ENDPOINT = "/v1/responses"


def response_id(job_id: uuid.UUID) -> str:
    """A response's id: its job's, with OpenAI's prefix."""
    return f"{RESPONSE_PREFIX}{job_id.hex}"


def job_id_of(value: str) -> uuid.UUID | None:
    """The job behind a response id; None for anything this service did not issue."""
    return parse_id(RESPONSE_PREFIX, value)


# -- input items -------------------------------------------------------------------------------------------------


class InputText(RequestModel):
    type: Literal["input_text"]
    text: Text


class OutputText(RequestModel):
    """An earlier answer's text as a response's `output` holds it, given back in `input`."""

    type: Literal["output_text"]
    text: Text
    annotations: Annotated[list[Any], Field(max_length=0)] | None = Field(
        default=None, description="none: this server's answers have none")
    logprobs: list[Any] | None = Field(default=None, description="as the answer gave them; not part of the prompt")


ContentPart = Annotated[InputText | OutputText, Field(discriminator="type")]


def _text_or_list(value: Any) -> str:
    return "Text" if isinstance(value, str) else "List"


def text_or(items: Any) -> Any:
    """A string or a list of `items`: only the branch the value's JSON type picks reports errors (so a list's error
    is not joined by "should be a valid string"). Capitalized tags stay out of the field path (api/http/errors.py)."""
    return Annotated[Annotated[NonBlankText, Tag("Text")] | Annotated[items, Tag("List")], Discriminator(_text_or_list)]
ItemId = Annotated[Text, Field(min_length=1, max_length=200)]
ItemStatus = Literal["in_progress", "completed", "incomplete"]


def _joined(parts: list[InputText | OutputText]) -> str:
    return "\n".join(part.text for part in parts)  # as chat joins its text parts


class MessageItem(RequestModel):
    """A message: `{"role", "content"}` (OpenAI's easy input message) or `{"type": "message", ...}`, the content a
    string or text parts (`input_text`; an assistant's `output_text`, as a response's output gives it)."""

    type: Literal["message"] | None = None
    id: ItemId | None = None
    role: Literal["user", "system", "developer", "assistant"]
    content: text_or(Annotated[list[ContentPart], Field(min_length=1)])
    status: ItemStatus | None = None

    @field_validator("content")
    @classmethod
    def _parts_fit_role(cls, value: str | list[InputText | OutputText], info: ValidationInfo) -> Any:
        if isinstance(value, str):
            return value
        role = info.data.get("role")
        for index, part in enumerate(value):
            if part.type == "output_text" and role != "assistant":
                raise ValueError(f"{index}.type: output_text is an assistant's (an earlier answer's); a {role} "
                                 "message's text is input_text")
        if not _joined(value).strip():
            raise ValueError("the text parts are all blank")
        return value

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else _joined(self.content)

    def stored(self) -> dict[str, Any]:
        """The item as `input_items` lists it: text parts, of the kind its role takes."""
        kind = "output_text" if self.role == "assistant" else "input_text"
        parts = ([{"type": kind, "text": self.content}] if isinstance(self.content, str)
                 else [part.model_dump(exclude_none=True) for part in self.content])
        if self.role == "assistant":
            parts = [{**part, "annotations": part.get("annotations", [])} if part["type"] == "output_text" else part
                     for part in parts]
        return {"type": "message", **({"id": self.id} if self.id else {}), "role": self.role, "content": parts}


class FunctionCallItem(RequestModel):
    """A call an earlier answer made (a response's `function_call` output item), given back."""

    type: Literal["function_call"]
    id: ItemId | None = None
    call_id: CallId
    name: ToolName
    arguments: Annotated[Text, AfterValidator(check_arguments)] = Field(
        description="the call's arguments: a JSON object, as a string")
    status: ItemStatus | None = None

    def stored(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True)


class FunctionCallOutputItem(RequestModel):
    """A call's result: a tool output, as chat's `tool` message."""

    type: Literal["function_call_output"]
    id: ItemId | None = None
    call_id: CallId
    output: text_or(Annotated[list[InputText], Field(min_length=1)])
    status: ItemStatus | None = None

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else _joined(self.output)

    def stored(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True)


_ITEM_TAGS = {"message": "Message", "function_call": "FunctionCall", "function_call_output": "FunctionCallOutput"}


def _item_tag(value: Any) -> str | None:
    kind = value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", None) or "message"
    return _ITEM_TAGS.get(kind) if isinstance(kind, str) else None


# The tags are capitalized so that an error's field path leaves them out (api/http/errors.py).
InputItem = Annotated[
    Annotated[MessageItem, Tag("Message")] | Annotated[FunctionCallItem, Tag("FunctionCall")]
    | Annotated[FunctionCallOutputItem, Tag("FunctionCallOutput")],
    Discriminator(_item_tag, custom_error_type="invalid_item", custom_error_message=(
        "type: not an input item this server takes: message (the default), function_call or function_call_output "
        "(reasoning items, item references and built-in tools' items are not supported)")),
]


# -- tools, tool_choice, text.format -----------------------------------------------------------------------------

BUILT_IN_TOOLS = "web_search, file_search, computer_use_preview, code_interpreter, mcp, image_generation, local_shell"


def only_function_tools(value: Any) -> Any:
    if value != "function":
        raise ValueError(f"{value!r}: only function tools are supported here, no built-in tool ({BUILT_IN_TOOLS}, "
                         "...)")
    return value


class FunctionTool(RequestModel):
    """OpenAI Responses' function tool, flat: `{"type": "function", "name", "description", "parameters", "strict"}`."""

    type: Annotated[Literal["function"], BeforeValidator(only_function_tools)]
    name: ToolName
    description: Annotated[Text, Field(max_length=4096)] | None = None
    parameters: Annotated[dict[str, Any] | None, AfterValidator(check_parameters)] = Field(
        default=None, description="the arguments' JSON schema (an object); left out, no arguments")
    strict: bool | None = Field(default=None, description="the schema is always enforced, strict or not")

    def as_chat(self) -> Tool:
        """Chat's tool of the same function (already checked: not validated again)."""
        spec = FunctionSpec.model_construct(**{name: getattr(self, name) for name in self.model_fields_set
                                               if name != "type"})
        return Tool.model_construct(type="function", function=spec)


def check_function_tools(value: list[FunctionTool] | None) -> list[FunctionTool] | None:
    check_unique_names([tool.name for tool in value or []])
    return value


class FunctionChoice(RequestModel):
    type: Literal["function"]
    name: ToolName


CHOICES = "'auto', 'none', 'required' or {\"type\": \"function\", \"name\": ...}"


def known_tool_choice(value: Any) -> Any:
    if isinstance(value, dict) and value.get("type") != "function":
        raise ValueError(f"type {value.get('type')!r}: only {CHOICES} (hosted tools, allowed_tools, mcp and custom "
                         "tools are not supported)")
    if isinstance(value, str) and value not in ("auto", "none", "required"):
        raise ValueError(f"{value!r}: only {CHOICES}")
    return value


ToolChoice = Annotated[Literal["auto", "none", "required"] | FunctionChoice, BeforeValidator(known_tool_choice)]


class TextFormatText(RequestModel):
    type: Literal["text"]


class TextFormatJsonObject(RequestModel):
    type: Literal["json_object"]


class TextFormatJsonSchema(JsonSchemaSpec):
    """Responses' json_schema format, flat: `{"type": "json_schema", "name", "schema", "description", "strict"}`."""

    type: Literal["json_schema"]


_FORMAT_TAGS = {"text": "Text", "json_object": "JsonObject", "json_schema": "JsonSchema"}


def _format_tag(value: Any) -> str | None:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return _FORMAT_TAGS.get(kind) if isinstance(kind, str) else None


TextFormat = Annotated[
    Annotated[TextFormatText, Tag("Text")] | Annotated[TextFormatJsonObject, Tag("JsonObject")]
    | Annotated[TextFormatJsonSchema, Tag("JsonSchema")],
    Discriminator(_format_tag, custom_error_type="invalid_format",
                  custom_error_message="type: one of text, json_object, json_schema"),
]


class TextConfig(RequestModel):
    format: TextFormat | None = Field(default=None, description="`text` (free), `json_object` or `json_schema` (the "
                                      "answer is generated under that schema); left out, the role answers as itself")

    def response_format(self) -> ResponseFormat | None:
        """Chat's response_format of the same form (already checked: not validated again)."""
        if self.format is None:
            return None
        if isinstance(self.format, TextFormatJsonSchema):
            spec = JsonSchemaSpec.model_construct(name=self.format.name, description=self.format.description,
                                                  json_schema=self.format.json_schema, strict=self.format.strict)
            return ResponseFormat.model_construct(type="json_schema", json_schema=spec)
        return ResponseFormat.model_construct(type=self.format.type, json_schema=None)


# -- the request ---------------------------------------------------------------------------------------------------


def refuse_include(value: list[str] | None) -> list[str] | None:
    if value:
        raise ValueError(f"{value[0]!r}: no include is supported (an answer's log-probabilities, reasoning and "
                         "built-in tools' outputs are not given here)")
    return value


def refuse_reasoning(value: dict[str, Any] | None) -> dict[str, Any] | None:
    if value and any(setting is not None for setting in value.values()):
        raise ValueError("only null: these roles have no reasoning settings (Kev's analysis is part of his answer)")
    return value


def only_disabled(value: Any) -> Any:
    if value is not None and value != "disabled":
        raise ValueError(f"{value!r}: only 'disabled' (an input over the context is refused, never truncated)")
    return value


Metadata = dict[Annotated[Text, Field(max_length=64)], Annotated[Text, Field(max_length=512)]]
StrictBool = Annotated[bool | None, BeforeValidator(only_bool)]


class ResponsesRequest(RequestModel):
    # Every parameter is honoured or refused: an OpenAI field not listed here (n, service_tier, prompt,
    # conversation, max_tool_calls, top_logprobs, ...) is a 422 naming it, never accepted and ignored.

    model: RequestedAdapter
    input: text_or(Annotated[list[InputItem], Field(min_length=1)]) = Field(
        description="a user message's text, or input items: messages (user, system, developer, assistant), "
        "function_call and function_call_output items")
    instructions: NonBlankText | None = Field(
        default=None, description="a system message first; not carried over from a previous response")
    previous_response_id: Annotated[Text, Field(max_length=100)] | None = Field(
        default=None, description="continue that stored response: its input items and output come first")
    text: TextConfig | None = None
    tools: Annotated[list[FunctionTool], Field(max_length=MAX_TOOLS), AfterValidator(check_function_tools)] | None = (
        Field(default=None, description="function tools: in the system prompt, and an answer's calls name one of "
              "them with arguments valid under its `parameters`, by the grammar"))
    tool_choice: ToolChoice | None = Field(
        default=None, description="`auto` (text or calls; the default), `none` (no calls, as without tools), "
        "`required` (calls only) or `{type: function, name}` (a call of that function)")
    parallel_tool_calls: StrictBool = Field(default=None, description="true (the default): one or more calls; "
                                            "false: one")
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: Temperature = None
    top_p: TopP = None
    metadata: Metadata | None = Field(default=None, max_length=16, description="stored as the job's metadata")
    user: Annotated[Text, Field(max_length=200)] | None = None
    store: StrictBool = Field(default=None, description="true (the default): kept, retrievable and continued; "
                              "false: answered once, then deleted")
    background: StrictBool = Field(default=None, description="answer at once with the queued response; poll, "
                                   "stream or cancel it")
    stream: StrictBool = Field(default=None, description="answer as Server-Sent Events of the Responses event types")
    include: Annotated[list[str] | None, AfterValidator(refuse_include)] = None
    reasoning: Annotated[dict[str, Any] | None, AfterValidator(refuse_reasoning)] = None
    truncation: Annotated[Literal["disabled"] | None, BeforeValidator(only_disabled)] = None

    @field_validator("tool_choice")
    @classmethod
    def _choice_fits_tools(cls, value: Any, info: ValidationInfo) -> Any:
        if value is None or value in ("auto", "none") or "tools" not in info.data:
            return value  # tools that failed their own validation are reported there
        tools = info.data["tools"] or []
        if not tools:
            raise ValueError("needs tools")
        if isinstance(value, FunctionChoice) and value.name not in {tool.name for tool in tools}:
            raise ValueError(f"names no function of tools: {value.name!r}")
        return value

    @field_validator("background")
    @classmethod
    def _background_is_stored(cls, value: bool | None, info: ValidationInfo) -> bool | None:
        if value and info.data.get("store") is False:
            raise ValueError("needs store: true (a background response is read back later)")
        return value

    def items(self) -> list[MessageItem | FunctionCallItem | FunctionCallOutputItem]:
        return [MessageItem(role="user", content=self.input)] if isinstance(self.input, str) else self.input

    def output(self) -> str:
        """The job's output form, as chat chooses it: calls where tools are offered (tool_choice not `none`), text
        in the form `text.format` asks, else the role's own answer (its decision)."""
        if self.tools and self.tool_choice != "none":
            return "tool_calls"
        return "text" if self.text and self.text.format else "decision"

    def to_job(self, earlier: list[dict[str, Any]], previous: uuid.UUID | None = None) -> ResponseJob:
        """The job: `earlier` (a previous response's conversation) and this request's items as chat messages,
        after the instructions. ApiError 422 naming the item that does not fit."""
        system = [{"role": "system", "content": self.instructions}] if self.instructions else []
        messages = [*system, *earlier, *item_messages(self.items(), earlier)]
        try:
            conversation = MessagesInput.model_validate({"messages": messages})
        except ValidationError as exc:  # e.g. more calls in one turn than an answer may make
            error = exc.errors()[0]
            raise ApiError(422, "invalid_request", f"input: {error['msg']}") from None
        output = self.output()
        calls = output == "tool_calls"
        params = JobParams(
            max_new_tokens=self.max_output_tokens, temperature=self.temperature, top_p=self.top_p, output=output,
            response_format=self.text.response_format() if self.text and output != "decision" else None,
            **(dict(tools=[tool.as_chat() for tool in self.tools],
                    tool_choice=_chat_choice(self.tool_choice), parallel_tool_calls=self.parallel_tool_calls)
               if calls else {}))
        return ResponseJob(adapter=self.model, input=conversation, params=params, metadata=self.metadata,
                           response_request=self.stored(), previous_response_id=previous,
                           response_store=self.store is not False)

    def stored(self) -> dict[str, Any]:
        """What the response's row keeps of the request beyond its job (migration 0011): what its `response` object
        echoes, its own input items, and the instructions (the first message of its job, where given)."""
        text_format = self.text.format.model_dump(exclude_none=True) if self.text and self.text.format else None
        return {
            "model": self.model, "instructions": self.instructions,
            "input": [item.stored() for item in self.items()],
            "text": {"format": text_format or {"type": "text"}},
            "tools": [tool.model_dump(exclude_none=True) for tool in self.tools or []],
            "tool_choice": (self.tool_choice.model_dump() if isinstance(self.tool_choice, FunctionChoice)
                            else self.tool_choice or "auto"),
            "parallel_tool_calls": self.parallel_tool_calls is not False,
            "max_output_tokens": self.max_output_tokens, "temperature": self.temperature, "top_p": self.top_p,
            "background": bool(self.background), "user": self.user,
        }


def _chat_choice(choice: str | FunctionChoice | None) -> Any:
    if isinstance(choice, FunctionChoice):
        return {"type": "function", "function": {"name": choice.name}}
    return choice


def item_messages(items: list[Any], earlier: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Input items as chat messages: a message as its role's (developer: system); function_call items as the calls
    of an assistant message (joining the assistant message just before them); function_call_output items as `tool`
    messages, each answering a call of the assistant message before it (or of the previous response's output)."""
    out: list[dict[str, Any]] = []
    last = earlier[-1] if earlier else None
    open_calls = {call["id"] for call in last.get("tool_calls") or []} if last and last["role"] == "assistant" \
        else set()
    for index, item in enumerate(items):
        if isinstance(item, MessageItem):
            out.append({"role": "system" if item.role == "developer" else item.role, "content": item.text()})
            open_calls = set()
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
                open_calls.add(item.call_id)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
                open_calls = {item.call_id}
        else:
            if item.call_id not in open_calls:
                raise ApiError(422, "invalid_request", f"input.{index}.call_id: {item.call_id!r} is no call of the "
                               "function_call items just before it (nor of the previous response's output)")
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
    return out


class ResponseJob(JobCreate):
    """A response's job, and what its row holds beyond the job (migration 0011)."""

    response_request: dict[str, Any]
    previous_response_id: uuid.UUID | None = None
    response_store: bool = True

    def row_columns(self) -> dict[str, Any]:
        return {"response_request": self.response_request, "previous_response_id": self.previous_response_id,
                "response_store": self.response_store}


# -- the response --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StoredResponse:
    """What a response's row holds beyond its job."""

    request: dict[str, Any]
    previous: uuid.UUID | None
    store: bool

    @classmethod
    def of(cls, row: Job) -> StoredResponse | None:
        """None for a job that is no response."""
        if row.response_request is None:
            return None
        return cls(row.response_request, row.previous_response_id, row.response_store is not False)


class ResponseError(BaseModel):
    code: str
    message: str


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: dict[str, int]
    output_tokens: int
    output_tokens_details: dict[str, int]
    total_tokens: int


ResponseStatus = Literal["queued", "in_progress", "completed", "incomplete", "failed", "cancelled"]


class ResponseObject(BaseModel):
    """OpenAI's `response` object, and the service's `kevlaya` extension (clients ignore it)."""

    id: str
    object: Literal["response"]
    created_at: int
    status: ResponseStatus
    background: bool
    completed_at: int | None
    error: ResponseError | None
    incomplete_details: IncompleteDetails | None
    instructions: str | None
    max_output_tokens: int | None
    metadata: dict[str, str]
    model: str
    output: list[dict[str, Any]] = Field(description="`message` items (`output_text` content) and `function_call` "
                                         "items (`call_id`, `name`, `arguments`)")
    parallel_tool_calls: bool
    previous_response_id: str | None
    reasoning: None
    store: bool
    temperature: float | None
    text: dict[str, Any]
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    top_p: float | None
    truncation: Literal["disabled"]
    usage: ResponseUsage | None
    user: str | None
    kevlaya: KevlayaExtra


class ResponseDeleted(BaseModel):
    id: str
    object: Literal["response"] = "response"
    deleted: bool = True


def status_of(job: JobOut) -> ResponseStatus:
    """The response's status: an answer cut by max_output_tokens is `incomplete` (its text so far kept)."""
    if job.status == "queued":
        return "queued"
    if job.status == "running":
        return "in_progress"
    if job.status == "cancelled":
        return "cancelled"
    if not chat_answered(job):
        return "failed"
    calls, whole = answer_calls(job)
    cut = (not whole) if calls else job.result is not None and job.result.finish_reason == "length"
    return "incomplete" if cut or job.status == "failed" else "completed"


def message_id(job_id: uuid.UUID) -> str:
    return f"msg_{job_id.hex}"


def function_call_item(job: JobOut, index: int, call: dict[str, Any], status: str = "completed") -> dict[str, Any]:
    """A call of the answer as a `function_call` item; its call id is chat's (api/openai/chat/schemas.py `call_out`)."""
    return {"type": "function_call", "id": f"fc_{job.id.hex}_{index}", "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"], "status": status}


def message_item(job_id: uuid.UUID, text: str, status: str) -> dict[str, Any]:
    return {"type": "message", "id": message_id(job_id), "status": status, "role": "assistant",
            "content": [output_text(text)]}


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def answer_of(job: JobOut) -> tuple[str, list[dict[str, Any]]]:
    """A finished job's answer as a response gives it: (text, calls), the text empty where it is calls."""
    calls, _whole = answer_calls(job)
    return answer_text(job), calls


def output_items(job: JobOut, status: ResponseStatus) -> list[dict[str, Any]]:
    if status not in ("completed", "incomplete"):
        return []
    calls, _whole = answer_calls(job)
    if calls:  # a call that max_output_tokens cut short comes last, incomplete
        complete = len(leading_calls(job.result.text if job.result else "")[0])
        return [function_call_item(job, index, call, "completed" if index < complete else "incomplete")
                for index, call in enumerate(calls)]
    text = answer_text(job)
    return [message_item(job.id, text, status)]


def _epoch(value: Any) -> int | None:
    return None if value is None else int(value.timestamp())


def response_object(job: JobOut, stored: StoredResponse) -> ResponseObject:
    request, status = stored.request, status_of(job)
    prompt, completion = job.tokens.prompt or 0, job.tokens.completion or 0
    finished = status in ("completed", "incomplete", "failed")
    error = job.error if status == "failed" else None
    return ResponseObject.model_validate({
        "id": response_id(job.id), "object": "response", "created_at": _epoch(job.created_at), "status": status,
        "background": request.get("background", False),
        "completed_at": _epoch(job.finished_at) if status == "completed" else None,
        "error": {"code": error.code, "message": error.message or error.code} if error else (
            {"code": "internal", "message": "the job ended without an answer"} if status == "failed" else None),
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": request.get("instructions"), "max_output_tokens": request.get("max_output_tokens"),
        "metadata": job.metadata or {}, "model": request["model"], "output": output_items(job, status),
        "parallel_tool_calls": request.get("parallel_tool_calls", True),
        "previous_response_id": response_id(stored.previous) if stored.previous else None,
        "reasoning": None, "store": stored.store, "temperature": request.get("temperature"),
        "text": request.get("text") or {"format": {"type": "text"}},
        "tool_choice": request.get("tool_choice") or "auto", "tools": request.get("tools") or [],
        "top_p": request.get("top_p"), "truncation": "disabled",
        "usage": {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": completion,
                  "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": prompt + completion}
        if finished and job.tokens.prompt is not None else None,
        "user": request.get("user"),
        "kevlaya": {"job_id": str(job.id), "answered_by": job.answered_by, "adapter_version": job.adapter_version,
                    "decision": job.result.decision if job.result else None, "timings": job.timings.model_dump()},
    })


def output_messages(job: JobOut) -> list[dict[str, Any]]:
    """A response's output as the chat messages a response that continues it holds."""
    text, calls = answer_of(job)
    if calls:
        return [{"role": "assistant", "content": None, "tool_calls": calls}]
    return [{"role": "assistant", "content": text}] if text.strip() else []


def conversation(job: JobOut, stored: StoredResponse) -> list[dict[str, Any]]:
    """The messages a response continuing this one starts with: this one's (its own previous conversation and
    input, less its instructions), then its output."""
    messages = list(job.input["messages"]) if isinstance(job.input, dict) else [{"role": "user", "content": job.input}]
    if stored.request.get("instructions") is not None:
        messages = messages[1:]
    return [*messages, *output_messages(job)]


def input_item_list(job_id: uuid.UUID, stored: StoredResponse) -> list[dict[str, Any]]:
    """The response's own input items, as `GET /v1/responses/{id}/input_items` lists them: each with an id (its
    own where it came with one) and a status."""
    items = []
    for index, item in enumerate(stored.request.get("input") or []):
        prefix = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}[item.get("type", "message")]
        items.append({"id": f"{prefix}_{job_id.hex}_in{index}", **item, "status": item.get("status", "completed")})
    return items
