"""A running job's events for the clients that follow it: `GET /v1/jobs/{id}/events` and streamed chat completions
(docs/architecture.md §8, Events).

One reader per API process reads every followed job's stream (shared/job_stream.py) with one blocking XREAD and
hands each follower the entries after its own position, in a bounded queue. A follower whose queue is full, one
that starts or resumes, and every follower after Redis went away read what they missed from the stream
themselves, so a slow client costs its own reads and never holds the others or the worker back. The end of a job
comes from the "finished" notices (api/streams/notices.py), the same path the long-polls wait on; its answer is the stored
row.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import redis.asyncio as aioredis

from api.streams.notices import notices, registered, stop
from shared.job_stream import entry_order, read_entry, stream_key
from shared.models import JobStatus
from shared.schemas import JobOut
from shared.settings import get_settings

log = logging.getLogger("kevlaya.api")

QUEUE_EVENTS = 256  # per follower; beyond this it reads from the stream itself
READ_COUNT = 512  # entries per catch-up read
READ_CONNECTIONS = 32  # Redis connections for the catch-up reads of all followers
BLOCK_MS = 100  # a reader's XREAD waits this long at most (a new follower's stream wakes it: `StreamReader.follow`)
WAKE_KEEP_S = 60  # a reader's wake-up stream outlives its last use this long (an API process that died leaves none)
# Followers woken between two turns of the event loop: each turn also serves the other requests (a health probe
# waits for at most one slice of deliveries, not for every client of every job).
WAKE_SLICE = 32


@dataclass(frozen=True)
class StreamEvent:
    id: str  # the stream entry's id: the SSE event id a client resumes from
    event: str
    data: dict[str, Any]
    raw: str  # the data as JSON, as stored: written to every client as it is

    @cached_property
    def sse(self) -> str:
        """The event as Server-Sent Events text, made once for all the clients that follow it."""
        return f"id: {self.id}\nevent: {self.event}\ndata: {self.raw}\n\n"


class Gap(Exception):
    """The stream no longer holds what comes after a follower's position (trimmed, expired or lost with Redis)."""


@dataclass(eq=False)  # followed by identity, in sets
class Follower:
    job_id: uuid.UUID
    position: str  # the last entry handed to the client ("0": none)
    queue: asyncio.Queue[StreamEvent] = field(default_factory=lambda: asyncio.Queue(QUEUE_EVENTS))
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    behind: bool = True  # read from the stream itself before taking from the queue
    finished: bool = False  # a "finished" notice for the job arrived

    def set(self) -> None:
        """The finished notice (api/streams/notices.py calls it)."""
        self.finished = True
        self.wake.set()

    def is_new(self, entry_id: str) -> bool:
        return entry_order(entry_id) > entry_order(self.position)

    async def events(self, client: aioredis.Redis, wait_s: float) -> list[StreamEvent]:
        """The next entries after `position` (advancing it), waiting up to `wait_s` for some; [] on a timeout or a
        finished notice. Raises Gap when the stream cannot continue from `position`."""
        if not self.behind and self.queue.empty() and not self.finished and not self.wake.is_set():
            try:
                async with asyncio.timeout(wait_s):  # no task per wait: hundreds of clients wake at every step
                    await self.wake.wait()
            except TimeoutError:
                pass
        self.wake.clear()
        if self.behind or self.finished:
            self.behind = False  # the reader queues what comes next while this reads what came before
            try:
                out = await read_after(client, self.job_id, self.position)
            except BaseException:
                self.behind = True  # what this read was to bring is still to be read
                raise
            # Still behind if there is more to read, or if the queue filled up during the read (the reader then
            # dropped what it could not queue).
            self.behind = self.behind or len(out) == READ_COUNT
            while not self.queue.empty():  # what the reader queued meanwhile is in what was just read, or after it
                event = self.queue.get_nowait()
                if not self.behind and self.is_new(event.id) and (not out or
                                                                   entry_order(event.id) > entry_order(out[-1].id)):
                    out.append(event)
        else:
            out = []
            while not self.queue.empty():
                event = self.queue.get_nowait()
                if self.is_new(event.id):
                    out.append(event)
        if out:
            self.position = out[-1].id
        return out


async def read_after(client: aioredis.Redis, job_id: uuid.UUID, position: str) -> list[StreamEvent]:
    key = stream_key(job_id)
    start = "-" if position == "0" else f"({position}"
    rows = await client.xrange(key, min=start, max="+", count=READ_COUNT)
    if position != "0":
        if not rows and not await client.exists(key):
            raise Gap(f"the stream of job {job_id} is gone")
        info = await client.xinfo_stream(key)
        deleted = info.get("max-deleted-entry-id", b"0-0")
        if entry_order(deleted.decode() if isinstance(deleted, bytes) else str(deleted)) > entry_order(position):
            raise Gap(f"the stream of job {job_id} no longer holds what follows {position}")
    return [_event(entry_id, fields) for entry_id, fields in rows]


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _event(entry_id: bytes | str, fields: dict[bytes, bytes]) -> StreamEvent:
    event, data = read_entry(fields)
    return StreamEvent(_text(entry_id), event, data, fields[b"data"].decode())


class StreamReader:
    """The reader of one event loop, and the followers it feeds."""

    def __init__(self) -> None:
        self._followers: dict[str, set[Follower]] = {}  # by stream key
        self._cursors: dict[str, str] = {}
        # The XREAD in flight names the streams followed when it began. A stream followed since wakes it through
        # this reader's own stream, one entry per XREAD at most, so the new one's first text does not wait out
        # the block.
        self._wake_key, self._wake_position = f"kevlaya:job-events-reader:{uuid.uuid4().hex}", "0"
        self._reads = self._woken_read = 0  # XREADs begun; the one a wake-up was sent for
        self._waking: set[asyncio.Task[None]] = set()
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._client: aioredis.Redis | None = None
        self._joined = asyncio.Event()

    def client(self) -> aioredis.Redis:
        """The connection pool followers read their catch-ups with. Hundreds start or fall behind at once: a
        catch-up waits for one of READ_CONNECTIONS (redis-py's own pool would refuse it beyond 100)."""
        if self._client is None:
            pool = aioredis.BlockingConnectionPool.from_url(get_settings().redis.url, max_connections=READ_CONNECTIONS,
                                                            timeout=5, socket_connect_timeout=2, socket_timeout=5)
            self._client = aioredis.Redis.from_pool(pool)  # closed with the client
        return self._client

    @contextmanager
    def follow(self, job_id: uuid.UUID, position: str = "0") -> Iterator[Follower]:
        """A follower of the job's stream from after `position`, also woken by the job's "finished" notice."""
        self._ensure_reading()
        key = stream_key(job_id)
        if key not in self._cursors:
            self._cursors[key] = position
            self._wake_reader()
        self._joined.set()
        with registered(self._followers, key, Follower(job_id, position),
                        on_last=lambda gone: self._cursors.pop(gone, None)) as follower:
            with notices.watch(job_id, follower):
                yield follower

    def _wake_reader(self) -> None:
        if self._reads == self._woken_read:  # this XREAD is already woken: the next one names every stream
            return
        self._woken_read = self._reads
        task = asyncio.get_running_loop().create_task(self._send_wake_up())
        self._waking.add(task)
        task.add_done_callback(self._waking.discard)

    async def _send_wake_up(self) -> None:
        try:
            async with self.client().pipeline(transaction=False) as pipe:
                pipe.xadd(self._wake_key, {"wake": "1"}, maxlen=1, approximate=False)
                pipe.expire(self._wake_key, WAKE_KEEP_S)
                await pipe.execute()
        except Exception as exc:  # the XREAD still ends within BLOCK_MS
            log.debug("could not wake the job stream reader: %s", exc)

    async def close(self) -> None:
        for task in list(self._waking):
            await stop(task)
        await stop(self._task)
        self._task = None
        if self._client is not None:
            await self._client.aclose()
        self._client = None

    def _ensure_reading(self) -> None:
        loop = asyncio.get_running_loop()
        if self._task is None or self._task.done() or self._loop is not loop:
            self._loop, self._joined, self._client = loop, asyncio.Event(), None
            self._task = loop.create_task(self._read(), name="job-stream-reader")

    async def _read(self) -> None:
        client = aioredis.Redis.from_url(get_settings().redis.url, socket_connect_timeout=2,
                                         socket_timeout=BLOCK_MS / 1000 + 5)
        try:
            while True:
                if not self._cursors:
                    self._joined.clear()
                    await self._joined.wait()
                    continue
                self._reads += 1
                try:
                    replies = await client.xread({**self._cursors, self._wake_key: self._wake_position},
                                                 count=READ_COUNT, block=BLOCK_MS)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # Redis away: every follower reads for itself once it is back
                    log.warning("job streams unreadable, retrying in 1 s: %s", exc)
                    for followers in self._followers.values():
                        for follower in followers:
                            follower.behind = True
                            follower.wake.set()
                    await asyncio.sleep(1)
                    continue
                woken = 0
                for key, rows in replies or ():
                    key = _text(key)
                    if key == self._wake_key:
                        self._wake_position = _text(rows[-1][0])
                        continue
                    woken = await self._hand_out(key, [_event(entry_id, fields) for entry_id, fields in rows], woken)
        finally:
            await client.aclose()

    async def _hand_out(self, key: str, events: list[StreamEvent], woken: int = 0) -> int:
        """Queue the entries for the key's followers and wake them; returns `woken` plus the followers woken."""
        if not events or key not in self._cursors:
            return woken
        self._cursors[key] = events[-1].id
        # A copy: followers come and go while the loop turns. One that joins meanwhile starts behind and reads
        # these entries itself.
        for follower in list(self._followers.get(key, ())):
            woken += 1
            if woken % WAKE_SLICE == 0:
                await asyncio.sleep(0)
            if not follower.behind:
                for event in events:
                    try:
                        follower.queue.put_nowait(event)
                    except asyncio.QueueFull:
                        follower.behind = True  # it reads the rest itself; the queue stays bounded
                        break
            follower.wake.set()
        return woken


reader = StreamReader()


async def follow_job(job: JobOut, read_job: Callable[[], Awaitable[JobOut]], position: str,
                     heartbeat_s: float) -> AsyncIterator[list[StreamEvent] | JobOut | Gap | None]:
    """What a client following `job` from `position` is told, in order: stream entries after `position` (as many
    at once as were there), a Gap where the stream cannot continue (then all it holds; or, once the job ended and
    its stream cannot be read, nothing more: the stored text is the text), None when `heartbeat_s` passed in
    silence, and last the finished job, as stored. A job that ended before it was followed is told the same way:
    what its stream holds after `position` (a client that reconnects after the end), then the job."""
    with reader.follow(job.id, position) as follower:
        await notices.subscribed(timeout_s=1.0)
        job = await read_job()  # followed first, read second: a notice in between is not missed
        # Already ended: as after a finished notice, the rest of the stream is read before the end is told.
        follower.finished = ending = job.status in JobStatus.FINISHED
        client = reader.client()
        while ending or job.status not in JobStatus.FINISHED:
            try:
                events = await follower.events(client, heartbeat_s)
            except Gap as gap:
                # The client drops its text and takes what the stream still holds, from its start: after Redis came
                # back empty, the worker wrote the run again there, its whole text first.
                yield gap
                follower.position, follower.behind = "0", True
                continue
            except Exception as exc:  # Redis away: the end still comes from the row
                # Ended, and the rest of its text cannot be read: the stored row is the text. (A notice can also
                # wake a follower whose job goes on: the row says which.)
                if follower.finished and (ended := await read_job()).status in JobStatus.FINISHED:
                    job = ended
                    yield Gap(f"the stream of job {job.id} is unreadable at its end: {exc}")
                    break
                log.warning("job %s: stream unreadable (%s); following its row", job.id, exc)
                events = []
                await asyncio.sleep(min(1.0, heartbeat_s))
            if events:
                yield events
            if follower.finished and not follower.behind:  # everything written before it ended is handed out
                follower.finished = ending = False
                job = await read_job()
            elif not events:
                yield None
                if (await read_job()).status in JobStatus.FINISHED:  # a lost notice costs one heartbeat at most
                    follower.finished = True  # and the rest of the stream is read before the end
        yield job
