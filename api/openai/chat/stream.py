"""OpenAI's `chat.completion.chunk` stream of a job's answer (`POST /v1/chat/completions` with `stream: true`), made
of the answer's updates (api/openai/answers.py). docs/architecture.md §8 describes it."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi.responses import StreamingResponse

from api.openai.answers import Diverged, Ended, Failed, NewCalls, TextDelta, TimedOut, answer_updates
from api.streams.sse import HEADERS, HEARTBEAT, sse
from shared.models import ApiKey
from shared.schemas import JobOut
from shared.settings import Settings


def chat_chunk_stream(key: ApiKey, job: JobOut, model: str, include_usage: bool, settings: Settings,
                      final: Callable[[JobOut], dict[str, Any]]) -> StreamingResponse:
    """OpenAI's `chat.completion.chunk` stream of the job's answer (`answer_updates`): its text as content deltas,
    its calls as OpenAI's `tool_calls` deltas (each call's id, type and name, then its arguments)."""
    created, chunk_id = int(job.created_at.timestamp()), f"chatcmpl-{job.id}"
    timeout_s = settings.limits.chat_timeout_s

    def chunk(delta: dict[str, Any], finish_reason: str | None = None, logprobs: Any = None, **extra: Any) -> str:
        return sse(None, {"id": chunk_id, "object": "chat.completion.chunk", "created": created, "model": model,
                          "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason,
                                       "logprobs": logprobs}], **extra})

    def call_chunks(calls: list[dict[str, Any]], first: int) -> list[str]:
        return [piece for index, call in enumerate(calls, first) for piece in (
            chunk({"tool_calls": [{"index": index, "id": call["id"], "type": "function",
                                   "function": {"name": call["function"]["name"], "arguments": ""}}]}),
            chunk({"tool_calls": [{"index": index, "function": {"arguments": call["function"]["arguments"]}}]}))]

    # an answer that can only be calls has no content, as OpenAI's first chunk then says
    only_calls = job.params.get("output") == "tool_calls" and (job.params.get("tool_choice") or "auto") != "auto"

    def error(code: str, message: str) -> str:
        return sse(None, {"error": {"code": code, "message": message}})

    async def chunks() -> AsyncIterator[str]:
        yield chunk({"role": "assistant", "content": None if only_calls else ""})
        async for updates in answer_updates(key, job, timeout_s, settings.streams.heartbeat_s):
            if updates is None:
                yield HEARTBEAT
                continue
            pieces: list[str] = []
            text = ""  # the text of consecutive deltas goes as one chunk
            for update in updates:
                if isinstance(update, TextDelta):
                    text += update.text
                    continue
                if text:
                    pieces.append(chunk({"content": text}))
                    text = ""
                if isinstance(update, NewCalls):
                    pieces += call_chunks(update.calls, update.first)
                elif isinstance(update, Ended):
                    completion = final(update.job)
                    choice = completion["choices"][0]
                    # The log-probabilities, when asked for, come whole with the last chunk.
                    pieces.append(chunk({}, choice["finish_reason"], choice["logprobs"], kevlaya={
                        "job_id": str(update.job.id), "answered_by": completion["kevlaya"]["answered_by"],
                        "adapter_version": completion["kevlaya"]["adapter_version"],
                        "decision": completion["kevlaya"]["decision"]}))
                    if include_usage:
                        pieces.append(sse(None, {"id": chunk_id, "object": "chat.completion.chunk", "created": created,
                                                 "model": model, "choices": [], "usage": completion["usage"]}))
                elif isinstance(update, Failed):
                    ended = update.job
                    message = ended.error.message if ended.error else ended.status
                    pieces.append(error(ended.error.code if ended.error else ended.status,
                                        f"job {ended.id} failed: {message}"))
                elif isinstance(update, Diverged):
                    pieces.append(error("internal", f"job {update.job.id} was run again and its answer differs from "
                                        f"the text already streamed; read it with GET /v1/jobs/{update.job.id}"))
                elif isinstance(update, TimedOut):
                    pieces.append(error("timeout", f"job {job.id} did not finish within {timeout_s} s; it stays "
                                        f"queued: poll GET /v1/jobs/{job.id}"))
            if text:
                pieces.append(chunk({"content": text}))
            yield "".join(pieces)
        yield sse(None, "[DONE]")

    return StreamingResponse(chunks(), media_type="text/event-stream", headers=HEADERS)
