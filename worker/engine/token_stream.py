"""The token publisher: a thread that writes each running job's new text to its stream (shared/job_stream.py), so
clients watch a job think while the decode loop never waits on Redis (docs/architecture.md §3, Stream).

The decode loop only says that a step is done (`tick`); the thread reads the new tokens of every row in flight,
turns them into text (whole characters only, and never the start of a stop string), and writes one entry per job
for all the steps it has not published yet, at most every `streams.interval_ms` (its work is Python that holds the
interpreter's lock, which the decode loop needs to launch each step). The result writer hands over each finished
job's stored text before it commits it (`finish`), so a stream holds every character of the answer before the job
is announced finished.

Redis being away costs nothing but the live view: a stream found missing (Redis restarted, or it expired) is
written again from the start of the run, with its whole text so far.
"""

from __future__ import annotations

import codecs
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import redis

from shared.job_stream import ESCALATED, FIRST_TOKEN_AT, QUEUED, RUNNING, entry, stream_key
from shared.models import Job
from shared.queue import redis_client
from shared.settings import Settings
from worker.ledger.cascade import is_cascade_head
from worker.ledger.outcomes import stored_text

if TYPE_CHECKING:
    from worker.decoder.state import Row

log = logging.getLogger("kevlaya.worker")
FINISH_WAIT_S = 1.0  # the result writer waits this long at most for a job's last text to be written


@dataclass
class LiveJob:
    """A job this worker runs, and what of its text its stream already holds."""

    job_id: uuid.UUID
    keys: tuple[str, ...]  # its own stream, and its `auto` parent's for a Kev stage
    attempt: int
    stage: str | None
    stop: tuple[str, ...]
    tokens: int = 0  # of its row's tokens, those turned into text
    text: str = ""  # published
    held: str = ""  # decoded, not published: it may begin a stop string
    # A stop string was reached, or bytes that are not UTF-8 (whose replacement characters decoders count in
    # different ways): nothing more is published until the stored text brings the rest.
    stopped: bool = False
    written: bool = False  # its `running` entry, which creates the stream, is written
    first_token_at: float | None = None  # its run's first token, on the wall clock (time.time())
    utf8: codecs.IncrementalDecoder = field(default_factory=lambda: codecs.getincrementaldecoder("utf-8")("replace"))

    def take(self, piece: str) -> str:
        """Add decoded text; returns what may be published of it."""
        if self.stopped or "\ufffd" in piece:
            self.stopped = True
            return ""
        self.held += stored_text(piece)
        if not self.stop:
            out, self.held = self.held, ""
            return out
        ends = [i for i in (self.held.find(s) for s in self.stop) if i != -1]
        if ends:
            out, self.held, self.stopped = self.held[:min(ends)], "", True
            return out
        keep = max((k for s in self.stop for k in range(1, len(s)) if self.held.endswith(s[:k])), default=0)
        out, self.held = self.held[:len(self.held) - keep], self.held[len(self.held) - keep:]
        return out


def on_wall_clock(instant: float) -> float:
    """A time.perf_counter() instant (the decoder's) as time.time()."""
    return instant + time.time() - time.perf_counter()


def _first_text(fields: dict[str, str], live: LiveJob) -> dict[str, str]:
    """A delta entry whose text starts the run's: it also holds when the run's first token was made, beside its
    data (clients never see it), so the stream's delay can be measured from the token itself."""
    if live.first_token_at is not None:
        fields[FIRST_TOKEN_AT] = repr(live.first_token_at)
    return fields


class TokenPublisher:
    def __init__(self, settings: Settings, rows: Callable[[], list[Row]], token_bytes: Callable[[int], bytes]):
        """`token_bytes`: the bytes a token adds to the stored text (none for a special token)."""
        self.settings, self._rows, self._token_bytes = settings, rows, token_bytes
        self._live: dict[uuid.UUID, LiveJob] = {}
        self._entries: list[tuple[str, dict[str, str]]] = []  # status entries to write, in order
        self._finals: list[tuple[uuid.UUID, str | None, int, float | None]] = []
        self._expire: list[str] = []
        self._ticked = False
        self._written_up_to = 0  # finals handed over / written: `finish` waits for its own
        self._handed = 0
        self._changed = threading.Condition()
        self._thread: threading.Thread | None = None
        self._down_since: float | None = None

    # -- called by the decode loop and the result writer -------------------------------------------------------

    def started(self, jobs: Iterable[Job]) -> None:
        """Jobs just claimed: their streams restart with a `running` entry."""
        with self._changed:
            for job in jobs:
                stage = "laya" if is_cascade_head(job) else "kev" if job.parent_job_id is not None else None
                keys = (stream_key(job.id),) + ((stream_key(job.parent_job_id),) if job.parent_job_id else ())
                stop = job.params.get("stop") or ()
                self._live[job.id] = LiveJob(job.id, keys, job.attempts, stage,
                                             (stop,) if isinstance(stop, str) else tuple(stop))
            self._wake()

    def tick(self) -> None:
        """A step or a prefill made tokens."""
        with self._changed:
            self._ticked = True
            self._wake()

    def requeued(self, job_ids: Iterable[uuid.UUID]) -> None:
        """Jobs given back to the queue unrun: their text so far is void."""
        with self._changed:
            for job_id in job_ids:
                if (live := self._live.pop(job_id, None)) is not None:
                    self._entries += [(key, entry("status", status=QUEUED, attempt=live.attempt))
                                      for key in live.keys]
            self._wake()

    def escalated(self, parent_id: uuid.UUID, child_id: uuid.UUID) -> None:
        with self._changed:
            self._entries.append((stream_key(parent_id), entry("status", status=ESCALATED, stage="kev",
                                                               job_id=str(child_id))))
            self._wake()

    def finish(self, texts: list[tuple[uuid.UUID, str | None, int, float | None]]) -> None:
        """The stored text, token count and first token's perf_counter instant of finished jobs (None: the job
        never reached the model); returns once their streams hold it, or after FINISH_WAIT_S (Redis away: the
        stored row is what readers get). A job that ends before the publisher saw its tokens (a short answer
        within one interval) has its first text go out here, marked with that instant all the same."""
        with self._changed:
            self._finals += texts
            self._handed += 1
            mine = self._handed
            self._wake()
            self._changed.wait_for(lambda: self._written_up_to >= mine, FINISH_WAIT_S)

    # -- the thread --------------------------------------------------------------------------------------------

    def _wake(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="token-publisher", daemon=True)
            self._thread.start()
        self._changed.notify_all()

    def _run(self) -> None:
        interval, published = self.settings.streams.interval_ms / 1000, -math.inf
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._ticked or self._entries or self._finals)
                # new tokens alone wait out the interval; a status or a finished job's text goes at once
                self._changed.wait_for(lambda: self._entries or self._finals,
                                       published + interval - time.monotonic())
                published = time.monotonic()
                ticked, self._ticked = self._ticked, False
                statuses, self._entries = self._entries, []
                finals, self._finals, handed = self._finals, [], self._handed
            try:
                self._publish(statuses, self._deltas() if ticked else [], finals)
            except Exception as exc:  # never let one failure stop the live view of every later job
                self._went_down(exc)
            with self._changed:
                self._written_up_to = handed
                self._changed.notify_all()

    def _deltas(self) -> list[tuple[LiveJob, str]]:
        out = []
        for row in self._rows():
            live = self._live.get(row.request.job_id)
            if live is None:
                continue
            count = len(row.tokens)
            if count and live.first_token_at is None:  # the decode thread sets it just after the token
                live.first_token_at = on_wall_clock(row.first_token_at or time.perf_counter())
            new = row.tokens[live.tokens:count]
            live.tokens = count
            piece = live.utf8.decode(b"".join(self._token_bytes(t) for t in new))
            if text := live.take(piece):
                out.append((live, text))
        return out

    def _publish(self, statuses: list[tuple[str, dict[str, str]]], deltas: list[tuple[LiveJob, str]],
                 finals: list[tuple[uuid.UUID, str | None, int]]) -> None:
        client, limit = redis_client(), self.settings.streams.max_events
        pipe = client.pipeline(transaction=False)
        appended: list[tuple[LiveJob, int]] = []  # deltas written with NOMKSTREAM: the job, the command's place
        running_ttl = self.settings.reliability.job_time_limit_s + self.settings.streams.keep_s

        def restart(live: LiveJob) -> None:
            for key in live.keys:
                pipe.xadd(key, entry("status", status=RUNNING, attempt=live.attempt, stage=live.stage),
                          maxlen=limit, approximate=True)
                if live.text:
                    pipe.xadd(key, _first_text(entry("delta", text=live.text, tokens=live.tokens), live),
                              maxlen=limit, approximate=True)
                pipe.expire(key, running_ttl)
            live.written = True

        def delta(live: LiveJob, text: str) -> None:
            first = not live.text
            live.text += text
            if not live.written:
                restart(live)
                return
            fields = entry("delta", text=text, tokens=live.tokens)
            if first:
                _first_text(fields, live)
            for key in live.keys:
                appended.append((live, len(pipe)))
                pipe.xadd(key, fields, maxlen=limit, approximate=True, nomkstream=True)

        for key, fields in statuses:
            pipe.xadd(key, fields, maxlen=limit, approximate=True)
        for live in list(self._live.values()):
            if not live.written:
                restart(live)
        for live, text in deltas:
            delta(live, text)
        for job_id, final, tokens, first_token_at in finals:
            live = self._live.pop(job_id, None)
            if live is None:
                continue
            live.tokens = tokens
            if live.first_token_at is None and first_token_at is not None:
                live.first_token_at = on_wall_clock(first_token_at)
            final = stored_text(final) if final is not None else None
            if final is not None and final != live.text:
                if final.startswith(live.text):
                    delta(live, final[len(live.text):])
                else:  # the stored text is not what was streamed (a tokenizer's clean-up): the run restarts
                    live.text, live.written = final, False
                    restart(live)
            self._expire += live.keys
        for key in self._expire:
            pipe.expire(key, self.settings.streams.keep_s)
        replies = pipe.execute()
        self._expire = []
        for live, place in appended:
            if replies[place] is None:  # NOMKSTREAM: the stream is gone; written again from the run's start next time
                live.written = False
        if self._down_since is not None:
            log.info("live job streams written again after %.0f s", time.monotonic() - self._down_since)
            self._down_since = None

    def _went_down(self, exc: Exception) -> None:
        for live in self._live.values():
            live.written = False  # whatever the streams hold now, each is written again from its run's start
        if self._down_since is None:
            self._down_since = time.monotonic()
            level = logging.WARNING if isinstance(exc, redis.RedisError) else logging.ERROR
            log.log(level, "live job streams not written (clients read the stored rows when jobs end): %s", exc,
                    exc_info=level == logging.ERROR)
        time.sleep(0.2)
