"""Job request/response schemas shared by the API (validation) and the worker (reading params)."""

from __future__ import annotations

import math
import uuid
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

RequestedAdapter = Literal["kev", "laya", "auto"]
OutputFormat = Literal["decision", "text"]

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


Text = Annotated[str, AfterValidator(check_text)]
Temperature = Annotated[
    float | None,
    Field(default=None, ge=0, le=2, allow_inf_nan=False,
          description=f"0 = greedy; otherwise at least {MIN_TEMPERATURE}",
          json_schema_extra={"not": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": MIN_TEMPERATURE}}),
    AfterValidator(check_temperature),
]
TopP = Annotated[float | None, Field(default=None, gt=0, le=1, allow_inf_nan=False)]
Seed = Annotated[int | None, Field(default=None, ge=0, le=SEED_MAX)]


class TextPart(BaseModel):
    """OpenAI-style content part; only text is supported."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: Text


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant"]
    content: Annotated[Text, Field(min_length=1)] | Annotated[list[TextPart], Field(min_length=1)] = Field(
        description="a string, or a list of text parts (`[{\"type\": \"text\", \"text\": \"...\"}]`), "
        "which are joined with newlines"
    )

    @field_validator("content")
    @classmethod
    def _parts_to_text(cls, value: str | list[TextPart]) -> str:
        if isinstance(value, str):
            return value
        text = "\n".join(part.text for part in value)
        if not text:
            raise ValueError("the text parts are all empty")
        return text


class MessagesInput(BaseModel):
    model_config = ConfigDict(extra="forbid")

    messages: list[Message] = Field(min_length=1)


class JobParams(BaseModel):
    """Generation overrides; anything left out takes the adapter's configured default."""

    model_config = ConfigDict(extra="forbid")

    max_new_tokens: int | None = Field(default=None, ge=1)
    temperature: Temperature = None
    top_p: TopP = None
    seed: Seed = None
    output: OutputFormat = Field(
        default="decision",
        description="'decision': the answer must be a JSON decision object (else failed/invalid_output); "
        "'text': the raw text is the result, a decision is attached when one parses",
    )


class JobCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    adapter: RequestedAdapter
    input: Annotated[Text, Field(min_length=1)] | MessagesInput
    params: JobParams = Field(default_factory=JobParams)
    idempotency_key: Annotated[Text, Field(min_length=1, max_length=200)] | None = None
    metadata: Annotated[dict[str, Any], AfterValidator(check_json_value)] | None = None

    @field_validator("input")
    @classmethod
    def _input_not_blank(cls, value: str | MessagesInput) -> str | MessagesInput:
        if isinstance(value, str) and not value.strip():
            raise ValueError("input must not be empty")
        return value

    def messages(self) -> list[dict[str, str]]:
        return to_messages(self.input if isinstance(self.input, str) else self.input.model_dump())

    def prompt_chars(self) -> int:
        return sum(len(m["content"]) for m in self.messages())


class JobBatchCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    jobs: list[JobCreate] = Field(min_length=1)


def to_messages(stored_input: str | dict[str, Any]) -> list[dict[str, str]]:
    """A job's input as chat messages, whether it was submitted as a string or as messages."""
    if isinstance(stored_input, str):
        return [{"role": "user", "content": stored_input}]
    return [{"role": m["role"], "content": m["content"]} for m in stored_input["messages"]]


def with_system_prompt(messages: list[dict[str, str]], system_prompt: str) -> list[dict[str, str]]:
    """The messages the model sees: the adapter's system prompt first, unless the job brings its own."""
    if messages[0]["role"] != "system" and system_prompt:
        return [{"role": "system", "content": system_prompt}, *messages]
    return messages


class JobResult(BaseModel):
    text: str | None
    decision: dict[str, Any] | None


class JobError(BaseModel):
    code: str
    message: str | None


class JobTimings(BaseModel):
    queue_ms: float | None = Field(description="waiting for a batch: created to claimed")
    switch_ms: float | None = Field(description="adapter switches in its batch")
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
    status: str
    result: JobResult | None
    error: JobError | None
    timings: JobTimings
    tokens: JobTokens


class JobOut(BaseModel):
    id: uuid.UUID
    status: str
    adapter: str
    requested_adapter: RequestedAdapter
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


class JobBatchAccepted(BaseModel):
    jobs: list[JobAccepted]
