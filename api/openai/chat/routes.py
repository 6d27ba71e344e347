"""`POST /v1/chat/completions`: OpenAI-compatible, through the same queue as every job, waiting for it."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import StreamingResponse

from api.http.deps import reject_unknown_query_parameters
from api.http.errors import AUTH_ERRORS, ApiError, ErrorResponse, error_responses
from api.jobs.intake import IntakeDep
from api.jobs.lookup import read_visible
from api.jobs.waiting import wait_finished
from api.keys.auth import SubmitterKey
from api.keys.caps import HeldStream, long_polls, streams
from api.openai.chat.schemas import CHAT_FIELDS, ChatCompletion, ChatRequest, chat_answered, completion
from api.openai.chat.stream import chat_chunk_stream

router = APIRouter(prefix="/v1/chat", tags=["chat"], dependencies=[Depends(reject_unknown_query_parameters)])


@router.post("/completions", response_model=ChatCompletion, responses={
    200: {"content": {"text/event-stream": {}}, "description": "The completion; with `stream: true`, Server-Sent "
          "Events of `chat.completion.chunk` objects and a last `data: [DONE]`"},
    **error_responses(400, 413, *AUTH_ERRORS, 504),
    422: {"model": ErrorResponse, "description": "Invalid request (the message names the field), or the job "
          "failed: the code is the job's error code"},
})
async def chat_completions(request: ChatRequest, key: SubmitterKey, intake: IntakeDep
                           ) -> ChatCompletion | StreamingResponse:
    job_request = request.to_job()
    intake.check(job_request, names=CHAT_FIELDS)
    settings = intake.settings
    # The key's place is taken before the job is stored: a request over its cap stores nothing.
    if request.stream:
        give_back = streams.take(key.id, settings.connections.streams_per_key)
        try:
            [accepted] = await intake.store(key, [job_request])
            job = await run_in_threadpool(read_visible, key, accepted.id)
        except BaseException:
            give_back()
            raise
        return HeldStream(chat_chunk_stream(
            key, job, request.model, bool(request.stream_options and request.stream_options.include_usage),
            settings, lambda done: completion(done, request.model).model_dump(mode="json")), give_back)
    with long_polls.hold(key.id, settings.connections.long_polls_per_key):
        [accepted] = await intake.store(key, [job_request])
        finished = await wait_finished(key, accepted.id, settings.limits.chat_timeout_s)
    timeout_s = settings.limits.chat_timeout_s
    if chat_answered(finished):
        return completion(finished, request.model)
    if finished.status == "failed":
        raise ApiError(422, finished.error.code, f"job {finished.id} failed: {finished.error.message}")
    raise ApiError(504, "timeout", f"job {finished.id} did not finish within {timeout_s} s; "
                   f"it stays queued: poll GET /v1/jobs/{finished.id}")
