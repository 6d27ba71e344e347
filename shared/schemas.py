"""Job request/response schemas shared by the API (validation) and the worker (reading params)."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

RequestedAdapter = Literal["kev", "laya", "auto"]
OutputFormat = Literal["decision", "text"]


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant"]
    content: str = Field(min_length=1)


class MessagesInput(BaseModel):
    model_config = ConfigDict(extra="forbid")

    messages: list[Message] = Field(min_length=1)


class JobParams(BaseModel):
    """Generation overrides; anything left out takes the adapter's configured default."""

    model_config = ConfigDict(extra="forbid")

    max_new_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    seed: int | None = Field(default=None, ge=0, le=2**31 - 1)
    output: OutputFormat = Field(
        default="decision",
        description="'decision': the answer must be a JSON decision object (else failed/invalid_output); "
        "'text': the raw text is the result, a decision is attached when one parses",
    )


class JobCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    adapter: RequestedAdapter
    input: str | MessagesInput
    params: JobParams = Field(default_factory=JobParams)
    idempotency_key: str | None = Field(default=None, min_length=1, max_length=200)
    metadata: dict[str, Any] | None = None

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
