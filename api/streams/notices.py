"""The "job finished" notices, so that what waits for a job's end need not poll the database: the long-polls
(api/jobs/waiting.py) and the followers of a job's event stream (api/streams/follow.py).

One Redis subscription per API process fans the notices out to the waiting requests. A waiter holds no
database connection and no thread while it waits; it reads the job row when its notice arrives and, in case
a notice was lost (Redis down, the subscription reconnecting), every `KEVLAYA_LIMITS__WAIT_RECHECK_S` anyway."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Protocol, TypeVar

import redis.asyncio as aioredis

from shared.notify import FINISHED_CHANNEL
from shared.settings import get_settings

log = logging.getLogger("kevlaya.api")
STOP_RETRY_S = 0.1  # a background task not ended this long after its cancellation is cancelled again


class Waiter(Protocol):
    def set(self) -> None: ...


W = TypeVar("W", bound=Waiter)
T = TypeVar("T")


@contextmanager
def registered(table: dict[str, set[T]], key: str, item: T,
               on_last: Callable[[str], None] | None = None) -> Iterator[T]:
    """`item` in `table[key]` while the block runs; a key whose last item leaves is removed (and `on_last` told)."""
    table.setdefault(key, set()).add(item)
    try:
        yield item
    finally:
        items = table.get(key)
        if items is not None:
            items.discard(item)
            if not items:
                del table[key]
                if on_last is not None:
                    on_last(key)


async def stop(task: asyncio.Task[None] | None) -> None:
    """Cancel a background task and wait until it has ended. The cancellation is repeated until it takes: one that
    lands while redis-py's asyncio client starts a command can be swallowed, and a reader would then go on."""
    if task is None:
        return
    while not task.done():
        task.cancel()
        await asyncio.wait([task], timeout=STOP_RETRY_S)
    if not task.cancelled() and (error := task.exception()) is not None:
        raise error


class FinishedJobNotices:
    """The subscriber of one event loop, and the events of the requests waiting on it."""

    def __init__(self) -> None:
        self._waiters: dict[str, set[Waiter]] = {}
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._subscribed: asyncio.Event | None = None

    @contextmanager
    def watch(self, job_id: uuid.UUID, waiter: W | None = None) -> Iterator[W | asyncio.Event]:
        """`waiter` (by default a new asyncio.Event), set when `job_id` may have finished. Register before reading
        the row, so a notice sent between the read and the wait is not missed."""
        self._ensure_listening()
        with registered(self._waiters, str(job_id), waiter if waiter is not None else asyncio.Event()) as event:
            yield event

    async def subscribed(self, timeout_s: float) -> bool:
        """Wait (briefly) until the subscription is up; False if it is not, and waiters rely on re-checks."""
        self._ensure_listening()
        try:
            await asyncio.wait_for(self._subscribed.wait(), timeout_s)
            return True
        except TimeoutError:
            return False

    async def close(self) -> None:
        await stop(self._task)
        self._task = None

    def _ensure_listening(self) -> None:
        loop = asyncio.get_running_loop()
        if self._task is None or self._task.done() or self._loop is not loop:
            self._loop, self._subscribed = loop, asyncio.Event()
            self._task = loop.create_task(self._listen(), name="finished-job-notices")

    def _wake(self, key: str) -> None:
        for event in self._waiters.get(key, ()):
            event.set()

    def _wake_all(self) -> None:
        for events in self._waiters.values():
            for event in events:
                event.set()

    async def _listen(self) -> None:
        while True:
            client = aioredis.Redis.from_url(get_settings().redis.url, socket_connect_timeout=2,
                                             health_check_interval=30)
            try:
                async with client.pubsub() as pubsub:
                    await pubsub.subscribe(FINISHED_CHANNEL)
                    self._subscribed.set()
                    self._wake_all()  # notices sent while we were not subscribed are lost: everyone re-reads
                    async for message in pubsub.listen():
                        if message["type"] == "message":
                            self._wake(message["data"].decode())
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis down or restarting: waiters fall back to their re-checks
                log.warning("job notices unavailable, retrying in 1 s: %s", exc)
            finally:
                self._subscribed.clear()
                await client.aclose()
            await asyncio.sleep(1)


notices = FinishedJobNotices()
