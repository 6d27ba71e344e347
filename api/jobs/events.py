"""`GET /v1/jobs/{id}/events`: a job's own event stream, as Server-Sent Events of its followed stream entries
(api/streams/follow.py): `status`, `delta`, `resync` and a last `done` carrying the job (docs/architecture.md §8,
Events)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import StreamingResponse

from api.http.errors import ApiError
from api.jobs.lookup import visible_reader
from api.streams.follow import Gap, follow_job
from api.streams.sse import HEADERS, HEARTBEAT, sse
from shared.job_stream import RUNNING, is_entry_id
from shared.models import ApiKey, JobStatus
from shared.schemas import JobOut
from shared.settings import Settings


def _stored(job: JobOut) -> dict[str, Any]:
    return job.model_dump(mode="json")


def _text(job: JobOut) -> str:
    return (job.result.text if job.result else None) or ""


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
        async for item in follow_job(job, visible_reader(key, job.id), position, settings.streams.heartbeat_s):
            if item is None:
                yield HEARTBEAT
            elif isinstance(item, Gap):
                stored = await visible_reader(key, job.id)()
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
