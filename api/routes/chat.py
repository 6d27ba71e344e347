"""`POST /v1/chat/completions`: OpenAI-compatible, through the same queue as every job, waiting for it."""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter, Depends
from pydantic import BaseModel, ConfigDict, Field

from api.deps import IntakeDep, SubmitterKey, reject_unknown_query_parameters
from api.errors import AUTH_ERRORS, ApiError, ErrorResponse, error_responses
from api.prompt_budget import FieldNames
from api.submission import wait_finished
from shared.schemas import (
    JobCreate,
    JobOut,
    JobParams,
    JobTimings,
    Message,
    MessagesInput,
    RequestedAdapter,
    Seed,
    Temperature,
    TopP,
)

router = APIRouter(prefix="/v1/chat", tags=["chat"], dependencies=[Depends(reject_unknown_query_parameters)])

# Limits are reported under the names this request uses.
CHAT_FIELDS = FieldNames(input="messages", max_new_tokens="max_tokens")


class ChatRequest(BaseModel):
    # Unknown OpenAI fields (user, n=1, ...) are accepted and ignored, as other compatible servers do.
    model_config = ConfigDict(extra="ignore")

    model: RequestedAdapter
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: Temperature = None
    top_p: TopP = None
    seed: Seed = None
    stream: Literal[False] | None = Field(default=None, description="streaming is not supported")
    n: Literal[1] | None = None

    def to_job(self) -> JobCreate:
        return JobCreate(
            adapter=self.model,
            input=MessagesInput(messages=self.messages),
            # Chat clients want the text; a decision is attached to the job when one parses.
            params=JobParams(max_new_tokens=self.max_completion_tokens or self.max_tokens,
                             temperature=self.temperature, top_p=self.top_p, seed=self.seed, output="text"),
        )


class ChatMessageOut(BaseModel):
    role: Literal["assistant"]
    content: str


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    finish_reason: Literal["stop", "length"]
    logprobs: None


class ChatUsage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class KevlayaExtra(BaseModel):
    """Not in OpenAI's schema; clients ignore it, ours can read the decision and the job behind it."""

    job_id: str
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


def _completion(job: JobOut, model: str) -> ChatCompletion:
    limit = job.params.get("max_new_tokens")
    finish_reason = "length" if limit is not None and job.tokens.completion == limit else "stop"
    prompt, completion = job.tokens.prompt or 0, job.tokens.completion or 0
    return ChatCompletion.model_validate({
        "id": f"chatcmpl-{job.id}",
        "object": "chat.completion",
        "created": int(job.created_at.timestamp()),
        "model": model,
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": job.result.text if job.result else ""},
            "finish_reason": finish_reason,
            "logprobs": None,
        }],
        "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion},
        # Not in OpenAI's schema; clients ignore it, ours can read the decision and the job behind it.
        "kevlaya": {"job_id": str(job.id), "decision": job.result.decision if job.result else None,
                    "timings": job.timings.model_dump()},
    })


@router.post("/completions", responses={
    **error_responses(400, 413, *AUTH_ERRORS, 504),
    422: {"model": ErrorResponse, "description": "Invalid request (the message names the field), or the job "
          "failed: the code is the job's error code"},
})
async def chat_completions(request: ChatRequest, key: SubmitterKey, intake: IntakeDep) -> ChatCompletion:
    job_request = request.to_job()
    intake.check(job_request, names=CHAT_FIELDS)
    [accepted] = await intake.store(key, [job_request])
    timeout_s = intake.settings.chat_timeout_s
    finished = await wait_finished(key, accepted.id, timeout_s)
    if finished.status == "succeeded":
        return _completion(finished, request.model)
    if finished.status == "failed":
        raise ApiError(422, finished.error.code, f"job {finished.id} failed: {finished.error.message}")
    raise ApiError(504, "timeout", f"job {finished.id} did not finish within {timeout_s} s; "
                   f"it stays queued: poll GET /v1/jobs/{finished.id}")
