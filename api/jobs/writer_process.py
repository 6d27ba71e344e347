"""The job writer in a process of its own (`KEVLAYA_API__WRITER=process`, the default).

In the API's process the writer (api/jobs/writer.py) is a thread, and every round trip it makes to the database or
the broker lets go of the interpreter lock; under load, taking it back from the busy event loop costs up to a
switch interval each time. A unit then waited mostly for the lock, and its submits with it (RELIABILITY.md,
Load). Here the same JobWriter runs in a child process with a lock of its own. The API hands each submit over a
socket pair and awaits its answer on the event loop: no thread on its side, and one message each way per submit.

Messages are pickled, each after its length (4 bytes):
- to the child: `(id, key id, requests)` per submit, `("cancel", id)` for a submit whose client left before its
  unit (it is then not stored, as with the thread), and `None` to stop once everything handed over is stored;
- to the API: `(id, accepted | ApiError)` per submit, and `("unit", submits, seconds)` per insert, for /metrics.

A child that dies fails the submits it held with 503 (they may or may not be stored: a retry with the same
`idempotency_key` is safe) and is started again for the next submit. Each API process has its own child.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import logging
import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

from api.http.errors import RETRY_AFTER_S, ApiError, as_api_error
from api.jobs.submission import Accepted, Stored
from api.jobs.wakeups import WakeupPublisher
from api.jobs.writer import JobWriter
from shared.collector import settled_collector
from shared.logs import configure_logging
from shared.models import ApiKey
from shared.schemas import JobCreate
from shared.settings import get_settings

log = logging.getLogger("kevlaya.api")

_LENGTH = struct.Struct("!I")


def frame(message: Any) -> bytes:
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _LENGTH.pack(len(body)) + body


def _stopped() -> ApiError:
    return ApiError(503, "writer_unavailable", "the job writer stopped; the submit may or may not be stored: retry "
                    "with the same idempotency_key", headers={"Retry-After": RETRY_AFTER_S})


class WriterProcess:
    """The API's side: starts the child, sends it submits, hands each answer to the submit awaiting it."""

    def __init__(self, on_unit: Callable[[int, float], None] | None = None):
        self.on_unit = on_unit
        self._ids = itertools.count()
        self._pending: dict[int, asyncio.Future[list[Accepted]]] = {}
        self._process: subprocess.Popen[bytes] | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._reading: asyncio.Task[None] | None = None
        self._starting = asyncio.Lock()
        self._closed = False

    async def start(self) -> None:
        async with self._starting:
            if self._reading is not None and not self._reading.done():
                return
            ours, theirs = socket.socketpair()
            with theirs:
                self._process = subprocess.Popen(
                    [sys.executable, "-m", "api.jobs.writer_process", str(theirs.fileno())], pass_fds=[theirs.fileno()])
            reader, self._writer = await asyncio.open_unix_connection(sock=ours)
            self._reading = asyncio.create_task(self._read_answers(reader), name="job-writer-answers")
            log.info("job writer started (process %d)", self._process.pid)

    async def store(self, key: ApiKey, requests: list[JobCreate]) -> list[Accepted]:
        if self._closed:
            raise ApiError(503, "shutting_down", "the API is shutting down, nothing was stored; retry",
                           headers={"Retry-After": RETRY_AFTER_S})
        if self._reading is None or self._reading.done():
            await self.start()  # again after a child died
        submit_id = next(self._ids)
        answer = self._pending[submit_id] = asyncio.get_running_loop().create_future()
        assert self._writer is not None
        self._writer.write(frame((submit_id, key.id, requests)))
        try:
            return await answer
        except asyncio.CancelledError:  # the client left: not stored, unless its unit has started already
            if self._pending.pop(submit_id, None) is not None and not self._writer.is_closing():
                self._writer.write(frame(("cancel", submit_id)))
            raise

    async def aclose(self, timeout_s: float) -> None:
        """Let the child store what it was handed and publish its wake-ups, then stop; later submits get 503."""
        self._closed = True
        if self._writer is None or self._reading is None or self._process is None:
            return
        if not self._writer.is_closing():
            self._writer.write(frame(None))
        try:
            await asyncio.wait_for(asyncio.shield(self._reading), timeout_s)
            await asyncio.wait_for(asyncio.to_thread(self._process.wait), timeout_s)
        except TimeoutError:
            log.error("job writer (process %d) did not stop in %.0f s; killed", self._process.pid, timeout_s)
            self._process.kill()
        self._writer.close()

    async def _read_answers(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                (length,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
                message = pickle.loads(await reader.readexactly(length))
                if message[0] == "unit":
                    if self.on_unit is not None:
                        self.on_unit(message[1], message[2])
                    continue
                submit_id, answer = message
                waiting = self._pending.pop(submit_id, None)
                if waiting is None or waiting.done():
                    continue
                if isinstance(answer, ApiError):
                    waiting.set_exception(answer)
                else:
                    waiting.set_result(answer)
        except (asyncio.IncompleteReadError, ConnectionError):
            return  # the child's end closed: it stopped (the finally below answers what it held)
        finally:
            if not self._closed:
                log.error("job writer (process %s) stopped; %d submit(s) answered 503; it starts again for the "
                          "next submit", self._process.pid if self._process else "?", len(self._pending))
            for waiting in self._pending.values():
                if not waiting.done():
                    waiting.set_exception(_stopped())
            self._pending.clear()


# -- the child --------------------------------------------------------------------------------------------------

def _messages(connection: socket.socket) -> Iterator[Any]:
    stream = connection.makefile("rb")
    while header := stream.read(_LENGTH.size):
        (length,) = _LENGTH.unpack(header)
        yield pickle.loads(stream.read(length))


def serve(connection: socket.socket) -> None:
    """Run a JobWriter for the API at the other end of `connection` until it says stop or goes away."""
    sending = threading.Lock()

    def send(message: Any) -> None:
        data = frame(message)
        with sending, contextlib.suppress(OSError):  # OSError: the API went away, nobody waits for answers
            connection.sendall(data)

    writer = JobWriter(WakeupPublisher(get_settings().engine.max_batch), on_unit=lambda submits, seconds: send(("unit", submits, seconds)))
    handed: dict[int, Future[list[Stored]]] = {}

    def answer(submit_id: int, done: Future[list[Stored]]) -> None:
        handed.pop(submit_id, None)
        if done.cancelled():
            return
        if (error := done.exception()) is not None:
            if not isinstance(error, ApiError):
                log.error("storing a submit failed", exc_info=error)
            send((submit_id, as_api_error(error)))
        else:
            send((submit_id, [Accepted.of(stored) for stored in done.result()]))

    for message in _messages(connection):
        if message is None:
            break
        if message[0] == "cancel":
            if (cancelled := handed.pop(message[1], None)) is not None:
                cancelled.cancel()
            continue
        submit_id, key_id, requests = message
        handed[submit_id] = future = writer.hand_over(ApiKey(id=key_id), requests)
        future.add_done_callback(lambda done, submit_id=submit_id: answer(submit_id, done))
    writer.shut_down(30.0)  # what was handed over is stored, answered and announced


def main() -> None:
    # Ctrl-C and a stop sent to the whole process group are the API's to handle: it stops this child once what
    # it handed over is stored (or the child sees the API's end of the socket close).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    configure_logging(get_settings().monitoring.log_format)
    with socket.socket(fileno=int(sys.argv[1])) as connection, settled_collector():  # as in the API's process
        # a full collection walking every module would hold a unit, and every submit in it, for 50-100 ms
        log.info("job writer ready (process %d, %d objects out of the collector's sight)", os.getpid(),
                 gc.get_freeze_count())
        serve(connection)
    os._exit(0)  # daemon threads (the wake-up publisher) end with the process


if __name__ == "__main__":
    main()
