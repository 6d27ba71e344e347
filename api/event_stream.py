"""Server-Sent Events out of a job's followed events (api/job_events.py): the job's own event stream
(`GET /v1/jobs/{id}/events`) and OpenAI's chunk stream (`POST /v1/chat/completions` with `stream: true`).
docs/architecture.md §8 describes both."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from functools import partial
from typing import Any

from fastapi.concurrency import run_in_threadpool
from fastapi.responses import StreamingResponse

from api.chat_schemas import call_out, chat_answered
from api.errors import ApiError
from api.job_events import Gap, follow_job
from api.submission import read_visible
from shared.job_stream import ESCALATED, RUNNING, is_entry_id
from shared.models import ApiKey, JobStatus
from shared.schemas import JobOut
from shared.settings import Settings
from shared.tools import leading_calls, may_open_call

HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # and no proxy buffering it
HEARTBEAT = ": keep-alive\n\n"


def sse(event: str | None, data: Any, event_id: str | None = None) -> str:
    """One event. The data is one line of JSON (JSON escapes every newline), so no field can end the event."""
    lines = [f"id: {event_id}"] if event_id else []
    if event:
        lines.append(f"event: {event}")
    lines.append("data: " + (data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))))
    return "\n".join(lines) + "\n\n"


def _stored(job: JobOut) -> dict[str, Any]:
    return job.model_dump(mode="json")


def _text(job: JobOut) -> str:
    return (job.result.text if job.result else None) or ""


def _reader(key: ApiKey, job: JobOut) -> Callable[[], Any]:
    return partial(run_in_threadpool, read_visible, key, job.id)


def job_event_stream(key: ApiKey, job: JobOut, last_event_id: str | None, settings: Settings) -> StreamingResponse:
    if last_event_id is not None and not is_entry_id(last_event_id.strip()):
        raise ApiError(422, "invalid_request", "last-event-id: not an event id this stream sent")
    position = last_event_id.strip() if last_event_id else "0"

    async def events() -> AsyncIterator[str]:
        yield "retry: 1000\n\n"
        if last_event_id is None:
            if job.status in JobStatus.FINISHED:  # a new client of an ended job: the job is its whole story
                yield sse("done", _stored(job))
                return
            yield sse("status", {"status": job.status, "attempt": job.attempts})
        # The text the client has built from this connection, as it builds it (docs/api.md: deltas appended, `running`
        # restarting it, `resync` setting it); None where it resumed and its text so far is not known here (its
        # client checks it against `done`).
        built: str | None = "" if last_event_id is None else None
        async for item in follow_job(job, _reader(key, job), position, settings.stream_heartbeat_s):
            if item is None:
                yield HEARTBEAT
            elif isinstance(item, Gap):
                stored = await _reader(key, job)()
                built = _text(stored)
                yield sse("resync", {"reason": str(item), "job": _stored(stored)})
            elif isinstance(item, list):  # the entries one wake-up found: one write for all of them
                for event in item:
                    if event.event == "status" and event.data.get("status") == RUNNING:
                        built = ""
                    elif event.event == "delta" and built is not None:
                        built += event.data["text"]
                yield "".join(event.sse for event in item)
            else:
                # The stream holds an answer's last text before the job is announced, unless its worker gave up
                # waiting on Redis: then the stored text is the text, and the client is told so before `done`.
                if item.status == JobStatus.SUCCEEDED and built is not None and built != _text(item):
                    yield sse("resync", {"reason": f"the stream of job {item.id} ended short of its stored text",
                                         "job": _stored(item)})
                yield sse("done", _stored(item))

    return StreamingResponse(events(), media_type="text/event-stream", headers=HEADERS)


def chat_chunk_stream(key: ApiKey, job: JobOut, model: str, include_usage: bool, settings: Settings,
                      final: Callable[[JobOut], dict[str, Any]]) -> StreamingResponse:
    """OpenAI's `chat.completion.chunk` stream of the job's answer. An `auto` job streams the stage that answers:
    Laya's short answer is sent whole once it is known to be the answer, Kev's as it is written once Laya escalated.
    A run that restarts (its worker died, or the stream was lost) cannot take back text already sent: the rest
    then comes as the stored answer's remainder, or, where it differs, the stream ends with an error. A tool_calls
    job's calls come as OpenAI's `tool_calls` deltas, each whole once its text is complete (its id, type and
    name, then its arguments); text that may still open a call is held back until it cannot."""
    created, chunk_id = int(job.created_at.timestamp()), f"chatcmpl-{job.id}"
    deadline = time.monotonic() + settings.chat_timeout_s

    def chunk(delta: dict[str, Any], finish_reason: str | None = None, logprobs: Any = None, **extra: Any) -> str:
        return sse(None, {"id": chunk_id, "object": "chat.completion.chunk", "created": created, "model": model,
                          "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason,
                                       "logprobs": logprobs}], **extra})

    tools_job = job.params.get("output") == "tool_calls"

    def call_chunks(calls: list[dict[str, Any]], first: int) -> list[str]:
        return [piece for index, call in enumerate(calls[first:], first) for piece in (
            chunk({"tool_calls": [{"index": index, "id": call["id"], "type": "function",
                                   "function": {"name": call["function"]["name"], "arguments": ""}}]}),
            chunk({"tool_calls": [{"index": index, "function": {"arguments": call["function"]["arguments"]}}]}))]

    # an answer that can only be calls has no content, as OpenAI's first chunk then says
    only_calls = tools_job and (job.params.get("tool_choice") or "auto") != "auto"

    async def chunks() -> AsyncIterator[str]:
        yield chunk({"role": "assistant", "content": None if only_calls else ""})
        sent, run, buffering = "", "", job.requested_adapter == "auto"
        sent_calls: list[dict[str, Any]] = []  # the calls streamed so far
        # Something comes at least every `beat` seconds, so the deadline is checked in time.
        beat = min(settings.stream_heartbeat_s, settings.chat_timeout_s)
        async for item in follow_job(job, _reader(key, job), "0", beat):
            if time.monotonic() > deadline and not isinstance(item, JobOut):
                yield sse(None, {"error": {"code": "timeout", "message": f"job {job.id} did not finish within "
                                           f"{settings.chat_timeout_s} s; it stays queued: poll GET /v1/jobs/{job.id}"}})
                break
            if item is None:
                yield HEARTBEAT
            elif isinstance(item, Gap):
                run = ""  # what the stream still holds comes again from its start
            elif isinstance(item, list):
                for event in item:
                    if event.event == "status" and event.data.get("status") == RUNNING:
                        run = ""
                    elif event.event == "status" and event.data.get("status") == ESCALATED:
                        run, buffering = "", False
                    elif event.event == "delta":
                        run += event.data["text"]
                if buffering:
                    continue
                if tools_job and may_open_call(run):
                    calls = [call_out(job, i, name, arguments)
                             for i, (name, arguments) in enumerate(leading_calls(run)[0])]
                    if calls[:len(sent_calls)] == sent_calls and len(calls) > len(sent_calls):
                        for piece in call_chunks(calls, len(sent_calls)):
                            yield piece
                        sent_calls = calls
                elif run.startswith(sent) and len(run) > len(sent):
                    yield chunk({"content": run[len(sent):]})
                    sent = run
            elif isinstance(item, JobOut):
                if not chat_answered(item):
                    message = item.error.message if item.error else item.status
                    yield sse(None, {"error": {"code": item.error.code if item.error else item.status,
                                               "message": f"job {item.id} failed: {message}"}})
                    break
                completion = final(item)
                text = completion["choices"][0]["message"]["content"] or ""
                calls = completion["choices"][0]["message"].get("tool_calls") or []
                if not text.startswith(sent) or calls[:len(sent_calls)] != sent_calls:
                    yield sse(None, {"error": {"code": "internal", "message": f"job {item.id} was run again and its "
                                               "answer differs from the text already streamed; read it with GET "
                                               f"/v1/jobs/{item.id}"}})
                    break
                if len(text) > len(sent):
                    yield chunk({"content": text[len(sent):]})
                for piece in call_chunks(calls, len(sent_calls)):
                    yield piece
                choice = completion["choices"][0]
                # The log-probabilities, when asked for, come whole with the last chunk.
                yield chunk({}, choice["finish_reason"], choice["logprobs"],
                            kevlaya={"job_id": str(item.id), "answered_by": completion["kevlaya"]["answered_by"],
                                     "decision": completion["kevlaya"]["decision"]})
                if include_usage:
                    yield sse(None, {"id": chunk_id, "object": "chat.completion.chunk", "created": created,
                                     "model": model, "choices": [], "usage": completion["usage"]})
        yield sse(None, "[DONE]")

    return StreamingResponse(chunks(), media_type="text/event-stream", headers=HEADERS)
