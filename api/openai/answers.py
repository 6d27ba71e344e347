"""The updates of a job's answer (`answer_updates`), out of its followed events (api/streams/follow.py), that OpenAI's
chunk stream (`POST /v1/chat/completions` with `stream: true`, api/openai/chat/stream.py) and the Responses API's
events (api/openai/responses/stream.py) are made of. docs/architecture.md §8 and §17 describe them."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from api.jobs.lookup import visible_reader
from api.openai.chat.schemas import answer_calls, answer_text, call_out, chat_answered
from api.streams.follow import Gap, StreamEvent, follow_job
from shared.job_stream import ESCALATED, RUNNING
from shared.models import ApiKey
from shared.schemas import JobOut
from shared.tools import leading_calls, may_open_call


@dataclass(frozen=True)
class TextDelta:
    """More of the answer's text."""

    text: str


@dataclass(frozen=True)
class NewCalls:
    """Calls whose text is complete, after the `first` already told."""

    calls: list[dict[str, Any]]  # in OpenAI's chat shape (api/openai/chat/schemas.py `call_out`)
    first: int


@dataclass(frozen=True)
class Ended:
    """The job's answer is whole: everything of it was told before this."""

    job: JobOut


@dataclass(frozen=True)
class Failed:
    """The job ended without an answer (failed, or cancelled)."""

    job: JobOut


@dataclass(frozen=True)
class Diverged:
    """The job was run again and its stored answer differs from what was told already."""

    job: JobOut


@dataclass(frozen=True)
class TimedOut:
    """The job did not finish within the stream's time; it goes on."""


Update = TextDelta | NewCalls | Ended | Failed | Diverged | TimedOut


class AnswerTracker:
    """What a client of a job's answer is told, entry by entry of the job's stream: the answer's text as it grows
    and its calls once each is complete, never taking back what it was told (docs/architecture.md §8, Events).

    An `auto` job tells the stage that answers: Laya's short answer whole once it is known to be the answer, Kev's
    as it is written once Laya escalated. A run that restarts (its worker died, or the stream was lost) cannot take
    back text already told: the rest then comes as the stored answer's remainder, or, where it differs, `Diverged`.
    A tool_calls job's calls come each whole once its text is complete; text that may still open a call is held
    back until it cannot. One update list per entry, so the same entries always give the same updates (the
    Responses API numbers its events by them)."""

    def __init__(self, job: JobOut) -> None:
        self.sent, self.run, self.buffering = "", "", job.requested_adapter == "auto"
        self.sent_calls: list[dict[str, Any]] = []  # the calls told so far
        self.tools_job = job.params.get("output") == "tool_calls"
        self.job = job

    def restart(self) -> None:
        """A gap in the stream: what it still holds comes again from its start."""
        self.run = ""

    def entry(self, event: StreamEvent) -> list[Update]:
        if event.event == "status" and event.data.get("status") == RUNNING:
            self.run = ""
        elif event.event == "status" and event.data.get("status") == ESCALATED:
            self.run, self.buffering = "", False
        elif event.event == "delta":
            self.run += event.data["text"]
        else:
            return []
        if self.buffering:
            return []
        if self.tools_job and may_open_call(self.run):
            calls = [call_out(self.job, i, name, arguments)
                     for i, (name, arguments) in enumerate(leading_calls(self.run)[0])]
            if calls[:len(self.sent_calls)] == self.sent_calls and len(calls) > len(self.sent_calls):
                first, self.sent_calls = len(self.sent_calls), calls
                return [NewCalls(calls[first:], first)]
        elif self.run.startswith(self.sent) and len(self.run) > len(self.sent):
            delta, self.sent = self.run[len(self.sent):], self.run
            return [TextDelta(delta)]
        return []

    def end(self, job: JobOut) -> list[Update]:
        """The finished job, as stored: the rest of its answer and `Ended`, or why it has none to tell."""
        if not chat_answered(job):
            return [Failed(job)]
        calls, _whole = answer_calls(job)
        text = answer_text(job)
        if not text.startswith(self.sent) or calls[:len(self.sent_calls)] != self.sent_calls:
            return [Diverged(job)]
        rest: list[Update] = [TextDelta(text[len(self.sent):])] if len(text) > len(self.sent) else []
        if len(calls) > len(self.sent_calls):
            rest.append(NewCalls(calls[len(self.sent_calls):], len(self.sent_calls)))
        self.sent, self.sent_calls = text, calls
        return [*rest, Ended(job)]


async def answer_updates(key: ApiKey, job: JobOut, timeout_s: float,
                         heartbeat_s: float) -> AsyncIterator[list[Update] | None]:
    """The updates of a job's answer (`AnswerTracker`) as its stream brings them, those of one wake-up together;
    None when `heartbeat_s` passed in silence. Ends after the last update: `Ended`, `Failed`, `Diverged`, or
    `TimedOut` once `timeout_s` has passed."""
    deadline, tracker = time.monotonic() + timeout_s, AnswerTracker(job)
    # Something comes at least every `beat` seconds, so the deadline is checked in time.
    async for item in follow_job(job, visible_reader(key, job.id), "0", min(heartbeat_s, timeout_s)):
        if time.monotonic() > deadline and not isinstance(item, JobOut):
            yield [TimedOut()]
            return
        if item is None:
            yield None
        elif isinstance(item, Gap):
            tracker.restart()
        elif isinstance(item, list):
            if updates := [update for event in item for update in tracker.entry(event)]:
                yield updates
        else:
            yield tracker.end(item)
            return
