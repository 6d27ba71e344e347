"""The chat completion's request and answer, in OpenAI's shapes: used by `POST /v1/chat/completions` and by the
lines of a file batch (docs/architecture.md §8, §15)."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, Field, ValidationInfo, field_validator

from api.jobs.prompt_budget import FieldNames
from shared.grammar import TOOL_CALL_OPEN, TOOL_CALL_SEPARATOR
from shared.schemas import (
    MAX_TOP_LOGPROBS,
    JobCreate,
    JobOut,
    JobParams,
    JobTimings,
    Messages,
    MessagesInput,
    RequestedAdapter,
    RequestModel,
    ResponseFormat,
    Seed,
    Stop,
    Temperature,
    Text,
    TokenLogprob,
    ToolChoice,
    Tools,
    TopP,
    check_stop,
    check_tool_choice,
    check_top_logprobs,
    not_bool,
    only_bool,
)
from shared.tools import cut_call, leading_calls

# Limits are reported under the names this request uses.
CHAT_FIELDS = FieldNames(input="messages", max_new_tokens="max_tokens", adapter="model")


def only_zero(value: float | None) -> float | None:
    if value:
        raise ValueError("only 0 is supported: this server applies no penalty")
    return value


NoPenalty = Annotated[float | None, Field(default=None, allow_inf_nan=False), AfterValidator(only_zero)]


class StreamOptions(RequestModel):
    include_usage: bool | None = Field(default=None, description="a last chunk with the usage and no choices")


def check_stream_options(value: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
    if value is not None and not info.data.get("stream"):
        raise ValueError("only with stream: true")
    return value


class ChatRequest(RequestModel):
    # Every parameter is honoured or refused: an OpenAI field not listed here (logit_bias, ...) is a 422 naming it,
    # never accepted and ignored; and JSON types are strict (RequestModel).

    model: RequestedAdapter
    messages: Messages
    max_tokens: int | None = Field(default=None, ge=1, description="deprecated by OpenAI; max_completion_tokens wins")
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: Temperature = None
    top_p: TopP = None
    seed: Seed = None
    stop: Annotated[Stop, AfterValidator(check_stop)] = None
    response_format: ResponseFormat | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    _top_needs_logprobs = field_validator("top_logprobs")(check_top_logprobs)
    user: Annotated[Text, Field(max_length=200)] | None = Field(
        default=None, description="the end user's id: stored in the job's metadata as `user`")
    metadata: dict[Annotated[Text, Field(max_length=64)], Annotated[Text, Field(max_length=512)]] | None = Field(
        default=None, max_length=16, description="stored as the job's metadata")
    frequency_penalty: NoPenalty = None
    presence_penalty: NoPenalty = None
    stream: Annotated[bool | None, BeforeValidator(only_bool)] = Field(
        default=None, description="answer as Server-Sent Events of `chat.completion.chunk` objects, ending with "
        "`data: [DONE]`")
    stream_options: StreamOptions | None = None
    _options_need_stream = field_validator("stream_options")(check_stream_options)
    n: Annotated[Literal[1] | None, BeforeValidator(not_bool)] = None
    tools: Tools | None = Field(default=None, description="function tools: in the system prompt, and an answer's "
                                "calls name one of them with arguments valid under its `parameters`, by the grammar")
    tool_choice: ToolChoice | None = Field(
        default=None, description="`auto` (text or calls; the default with tools), `none` (no calls, as without "
        "tools), `required` (calls only) or `{type: function, function: {name}}` (a call of that function)")
    _choice_fits_tools = field_validator("tool_choice")(check_tool_choice)
    parallel_tool_calls: Annotated[bool | None, BeforeValidator(only_bool)] = Field(
        default=None, description="true (the default): one or more calls; false: one")

    def to_job(self) -> JobCreate:
        metadata = {**(self.metadata or {}), **({"user": self.user} if self.user is not None else {})}
        calls = bool(self.tools) and self.tool_choice != "none"
        # A role answers as itself: its decision under its grammar (Kev's analysis first), unless the request
        # offers tools to call, asks for another form (any response_format, `text` included) or ends the answer
        # with stop strings.
        output = "tool_calls" if calls else "text" if self.response_format or self.stop else "decision"
        return JobCreate(
            adapter=self.model,
            input=MessagesInput(messages=self.messages),
            params=JobParams(max_new_tokens=self.max_completion_tokens or self.max_tokens,
                             temperature=self.temperature, top_p=self.top_p, seed=self.seed, output=output,
                             stop=self.stop, response_format=self.response_format, logprobs=self.logprobs,
                             top_logprobs=self.top_logprobs,
                             **(dict(tools=self.tools, tool_choice=self.tool_choice,
                                     parallel_tool_calls=self.parallel_tool_calls) if calls else {})),
            metadata=metadata or None,
        )


class CalledFunctionOut(BaseModel):
    name: str
    arguments: str = Field(description="the arguments, a JSON object as a string")


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"]
    function: CalledFunctionOut


class ChatMessageOut(BaseModel):
    role: Literal["assistant"]
    content: str | None = Field(description="null when the answer is tool calls")
    tool_calls: list[ToolCallOut] | None = None


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    finish_reason: Literal["stop", "length", "tool_calls"]
    logprobs: ChatLogprobs | None


class ChatUsage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class KevlayaExtra(BaseModel):
    """Not in OpenAI's schema; clients ignore it, ours can read the decision and the job behind it."""

    job_id: str
    answered_by: str | None = Field(
        description="the adapter whose answer this is (`model` is the one asked for): for `auto`, laya, or kev once "
        "Laya escalated")
    adapter_version: str | None = Field(
        default=None, description="the sha256 of the version of `answered_by` that wrote the answer (GET /v1/models)")
    decision: dict[str, Any] | None
    timings: JobTimings


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: ChatUsage
    kevlaya: KevlayaExtra


def chat_answered(job: JobOut) -> bool:
    """Whether a finished job is a chat answer: it succeeded, or it ran out of tokens before its decision closed (a
    chat client asked for at most that many: OpenAI's `finish_reason: "length"` with the text so far, where the
    jobs API reports the job failed)."""
    return job.status == "succeeded" or (job.status == "failed" and job.error is not None
                                         and job.error.code == "length" and job.result is not None)


def call_out(job: JobOut, index: int, name: str, arguments: dict[str, Any] | str) -> dict[str, Any]:
    """A call in OpenAI's shape (`arguments` as text where max_tokens cut them). Its id is the job's and its place,
    so the answer, its stream and a batch's output line agree."""
    return {"id": f"call_{job.id.hex}_{index}", "type": "function",
            "function": {"name": name, "arguments": arguments if isinstance(arguments, str)
                         else json.dumps(arguments, ensure_ascii=False)}}


def answer_calls(job: JobOut) -> tuple[list[dict[str, Any]], bool]:
    """The calls a tool_calls job's answer opens with (none for text), and whether they are the whole answer.
    Where max_tokens cut the answer inside a call, that call comes last with its arguments so far, as OpenAI
    hands it back; a client's parser then reports it as an invalid call, never as the model's words."""
    text = (job.result.text if job.result else None) or ""
    if job.params.get("output") != "tool_calls":
        return [], False
    complete, end = leading_calls(text)
    calls = [call_out(job, i, name, arguments) for i, (name, arguments) in enumerate(complete)]
    rest = text[end:].removeprefix(TOOL_CALL_SEPARATOR) if complete else text
    if cut := cut_call(rest):
        calls.append(call_out(job, len(calls), *cut))
    return calls, bool(complete) and end == len(text)


def answer_text(job: JobOut) -> str:
    """The answer's text as a client is given it: none where the answer is calls, or a call cut short (its wire
    format is never shown as the model's words)."""
    text = (job.result.text if job.result else None) or ""
    return "" if job.params.get("output") == "tool_calls" and text.startswith(TOOL_CALL_OPEN) else text


def completion(job: JobOut, model: str) -> ChatCompletion:
    prompt, completion = job.tokens.prompt or 0, job.tokens.completion or 0
    result = job.result
    calls, whole = answer_calls(job)
    return ChatCompletion.model_validate({
        "id": f"chatcmpl-{job.id}",
        "object": "chat.completion",
        "created": int(job.created_at.timestamp()),
        "model": model,
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": None, "tool_calls": calls} if calls else {
                "role": "assistant", "content": answer_text(job)},
            "finish_reason": "tool_calls" if calls and whole else (result.finish_reason if result else None) or "stop",
            "logprobs": {"content": result.logprobs} if result and job.params.get("logprobs") else None,
        }],
        "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion},
        # Not in OpenAI's schema; clients ignore it, ours can read the decision and the job behind it.
        "kevlaya": {"job_id": str(job.id), "answered_by": job.answered_by, "adapter_version": job.adapter_version,
                    "decision": result.decision if result else None,
                    "timings": job.timings.model_dump()},
    })
