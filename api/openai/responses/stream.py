"""A response's Server-Sent Events, in the Responses API's event types (docs/architecture.md §17): built on the
job's answer updates as chat's chunk stream is (api/openai/answers.py `answer_updates`).

Every event carries a `sequence_number`, from 0. The updates come one list per entry of the job's stream, so the
same stream always gives the same events with the same numbers: a client that lost its connection asks for the
response again with `stream=true&starting_after=N` and gets the events after N (while the job's live events are
kept: `stream_keep_s` after it ended; after that a replay tells the stored answer in one delta). A stream that
reaches the timeout ends with an `error` event (`timeout`) that takes no number of its own: the job goes on, and
the client resumes after the last event it had."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi.responses import StreamingResponse

from api.openai.answers import Diverged, Ended, Failed, NewCalls, TextDelta, TimedOut, Update, answer_updates
from api.openai.responses.schemas import (
    StoredResponse,
    function_call_item,
    message_id,
    message_item,
    output_text,
    response_id,
    response_object,
    status_of,
)
from api.streams.sse import HEADERS, HEARTBEAT, sse
from shared.models import ApiKey
from shared.schemas import JobOut


class ResponseEvents:
    """The numbered events of one response, from its answer's updates."""

    def __init__(self, job: JobOut, stored: StoredResponse) -> None:
        self.job, self.stored = job, stored
        self.sequence = 0
        self.items = 0  # output items opened so far
        self.text: str | None = None  # the open message's text so far; None: no message open

    def event(self, kind: str, **fields: Any) -> tuple[int, str]:
        number = self.sequence
        self.sequence += 1
        return number, sse(kind, {"type": kind, **fields, "sequence_number": number})

    def snapshot(self, status: str) -> dict[str, Any]:
        """The response as it stands before its answer: no output, no usage."""
        shown = response_object(self.job, self.stored).model_dump(mode="json")
        return {**shown, "status": status, "output": [], "usage": None, "error": None, "incomplete_details": None,
                "completed_at": None}

    def start(self) -> list[tuple[int, str]]:
        first = "queued" if self.job.status == "queued" else "in_progress"
        return [self.event("response.created", response=self.snapshot(first)),
                self.event("response.in_progress", response=self.snapshot("in_progress"))]

    def _open_message(self) -> list[tuple[int, str]]:
        self.text = ""
        index, item_id = self.items, message_id(self.job.id)
        self.items += 1
        return [self.event("response.output_item.added", output_index=index,
                           item={**message_item(self.job.id, "", "in_progress"), "content": []}),
                self.event("response.content_part.added", item_id=item_id, output_index=index, content_index=0,
                           part=output_text(""))]

    def _close_message(self, status: str) -> list[tuple[int, str]]:
        text, index, item_id = self.text or "", self.items - 1, message_id(self.job.id)
        self.text = None
        return [self.event("response.output_text.done", item_id=item_id, output_index=index, content_index=0,
                           text=text, logprobs=[]),
                self.event("response.content_part.done", item_id=item_id, output_index=index, content_index=0,
                           part=output_text(text)),
                self.event("response.output_item.done", output_index=index,
                           item=message_item(self.job.id, text, status))]

    def update(self, update: Update) -> list[tuple[int, str]]:
        out: list[tuple[int, str]] = []
        if isinstance(update, TextDelta):
            if self.text is None:
                out += self._open_message()
            self.text += update.text
            out.append(self.event("response.output_text.delta", item_id=message_id(self.job.id),
                                  output_index=self.items - 1, content_index=0, delta=update.text, logprobs=[]))
        elif isinstance(update, NewCalls):
            for offset, call in enumerate(update.calls):
                index, item = self.items, function_call_item(self.job, update.first + offset, call)
                self.items += 1
                out += [self.event("response.output_item.added", output_index=index,
                                   item={**item, "arguments": "", "status": "in_progress"}),
                        self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                                   delta=item["arguments"]),
                        self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                   name=item["name"], arguments=item["arguments"]),
                        self.event("response.output_item.done", output_index=index, item=item)]
        elif isinstance(update, Ended):
            self.job = update.job
            status = status_of(update.job)
            if self.text is not None or not self.items:  # an answer of no text and no calls is an empty message
                if self.text is None:
                    out += self._open_message()
                out += self._close_message(status)
            shown = response_object(update.job, self.stored).model_dump(mode="json")
            out.append(self.event(f"response.{'incomplete' if status == 'incomplete' else 'completed'}",
                                  response=shown))
        elif isinstance(update, Failed):
            self.job = update.job
            out.append(self.event("response.failed", response=response_object(update.job, self.stored)
                                  .model_dump(mode="json")))
        elif isinstance(update, Diverged):
            out.append(self.event("error", code="internal", param=None, message=(
                f"response {response_id(update.job.id)} was run again and its answer differs from the text already "
                f"streamed; read it with GET /v1/responses/{response_id(update.job.id)}")))
        return out

    def timed_out(self, timeout_s: float) -> str:
        """Not numbered: the events after it come on a resumed stream, after the last numbered one."""
        rid = response_id(self.job.id)
        return sse("error", {"type": "error", "code": "timeout", "param": None, "sequence_number": self.sequence - 1,
                             "message": f"response {rid} did not finish within {timeout_s:g} s; it goes on: retrieve "
                             f"it, or stream it again with GET /v1/responses/{rid}?stream=true&starting_after="
                             f"{self.sequence - 1}"})


def response_stream(key: ApiKey, job: JobOut, stored: StoredResponse, timeout_s: float, heartbeat_s: float,
                    starting_after: int | None = None,
                    on_end: Callable[[uuid.UUID], Any] | None = None) -> StreamingResponse:
    """The response's events from the start, those numbered up to `starting_after` left out. `on_end` (awaited)
    runs once the stream told the response's end (a `store: false` response is deleted then)."""
    events = ResponseEvents(job, stored)
    after = -1 if starting_after is None else starting_after

    def told(numbered: list[tuple[int, str]]) -> str:
        return "".join(text for number, text in numbered if number > after)

    async def body() -> AsyncIterator[str]:
        if started := told(events.start()):
            yield started
        ended = False
        async for updates in answer_updates(key, job, timeout_s, heartbeat_s):
            if updates is None:
                yield HEARTBEAT
                continue
            pieces = []
            for update in updates:
                if isinstance(update, TimedOut):
                    pieces.append(events.timed_out(timeout_s))
                else:
                    pieces.append(told(events.update(update)))
                    ended = ended or isinstance(update, (Ended, Failed))
            if text := "".join(pieces):
                yield text
        if ended and on_end is not None:
            await on_end(job.id)

    return StreamingResponse(body(), media_type="text/event-stream", headers=HEADERS)
