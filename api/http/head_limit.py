"""The HTTP server protocol: uvicorn's httptools parser, with bounds on a request head's size and on the time it
takes to come, and every connection counted against the process's caps (api/http/connection_limits.py).

httptools parses several times faster than h11 (RELIABILITY.md, Load), but it takes a head of any size: it
keeps a header that arrives in pieces until the header ends. This protocol counts the bytes of a head still
being received and refuses it with 431 once they pass `KEVLAYA_LIMITS__HEADER_BYTES`, so nobody can make the
server hold an endless head; a head that arrived whole is measured once parsed, so the bound is the same
however the head was cut into reads. A refused request never reaches the app.

uvicorn starts no timer before a connection's first request, nor while a head arrives: an idle socket, or one
trickling a header line every few seconds, stayed open for good. Here a connection waiting for a head (from its
opening, or from the end of its previous response) is closed after `KEVLAYA_CONNECTIONS__HEAD_TIMEOUT_S`, and one whose
body comes too slowly gets 408 and is closed (api/http/body_timeout.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
from functools import lru_cache
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from api.http.body_timeout import CHECK_EVERY_S, BodyClock
from api.http.connection_limits import OpenConnections, connection_caps
from api.http.errors import error_body
from shared.settings import get_settings

log = logging.getLogger("kevlaya.api")


@lru_cache
def open_connections() -> OpenConnections:
    """This process's connections (one event loop serves them all)."""
    caps = connection_caps(get_settings())
    return OpenConnections(caps.total, caps.per_address)


def _answer(status: bytes, code: str, message: str) -> bytes:
    body = json.dumps(error_body(code, message)).encode()
    return (b"HTTP/1.1 %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n%s"
            % (status, len(body), body))


class BoundedHeadProtocol(HttpToolsProtocol):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        settings = get_settings()
        self.max_head_bytes = settings.limits.header_bytes
        self.head_timeout_s = settings.connections.head_timeout_s
        self.body_timeout_s = settings.connections.body_timeout_s
        self.body_min_rate = settings.connections.body_min_bytes_per_s
        self._body: BodyClock | None = None  # while a request's body is awaited
        self._body_timer: asyncio.TimerHandle | None = None
        self.open = open_connections()
        self._head_bytes = 0  # received since the request began, while its head is incomplete
        self._in_head = True
        self._refused = False
        self._head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if not self.open.admit(self, self.client[0] if self.client else ""):
            # every counted connection is in the middle of a request: this one cannot be held
            self._refused = True
            self.transport.write(_answer(b"503 Service Unavailable", "too_many_connections",
                                         f"the server holds {len(self.open)} connections, each busy; retry later"))
            self.transport.close()
            return
        self._await_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_head_timer()
        self._stop_body_clock()
        self.open.leave(self)
        super().connection_lost(exc)

    def close_idle(self) -> None:
        """Closed to make room for a new connection (api/http/connection_limits.py), while it waits for a head."""
        self._stop_head_timer()
        self._refused = True
        self.transport.close()

    def _await_head(self) -> None:
        self._stop_head_timer()
        self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_timed_out)
        self.open.waiting(self)

    def _stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing():
            return
        self._refused = True
        if self._head_bytes:  # a head begun and never finished: the client is told why
            self.transport.write(_answer(b"408 Request Timeout", "request_timeout",
                                         f"request line and headers not received within {self.head_timeout_s} s"))
        self.transport.close()

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # the connection is closing; what else arrives is not read
        if self._in_head:
            self._head_bytes += len(data)
        super().data_received(data)
        if self._in_head and self._head_bytes > self.max_head_bytes:
            self._refuse()  # every byte counted belongs to a head that has not ended yet

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._stop_head_timer()
        self.open.busy(self)
        if len(self.url) + sum(len(name) + len(value) for name, value in self.headers) > self.max_head_bytes:
            self._refuse()
            return
        super().on_headers_complete()
        self._body = BodyClock(self.body_timeout_s, self.body_min_rate, self.loop.time())
        self._body_timer = self.loop.call_later(CHECK_EVERY_S, self._check_body)

    def _check_body(self) -> None:
        clock, self._body_timer = self._body, None
        if clock is None or self.transport.is_closing():
            return
        clock.tick(self.loop.time(), reading=not (self.flow and self.flow.read_paused))
        if not clock.late():
            self._body_timer = self.loop.call_later(CHECK_EVERY_S, self._check_body)
            return
        self._refused = True
        log.warning("request from %s closed: %d bytes of its body in %.0f s", self.client[0] if self.client else "?",
                    clock.received, clock.counted_s)
        if self.cycle is not None and not self.cycle.response_started:
            self.transport.write(_answer(b"408 Request Timeout", "request_timeout",
                                         f"request body not received at {self.body_min_rate:g} bytes/s or more "
                                         f"after {self.body_timeout_s:g} s (KEVLAYA_CONNECTIONS__BODY_TIMEOUT_S)"))
        self.transport.close()

    def _stop_body_clock(self) -> None:
        self._body = None
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def on_body(self, body: bytes) -> None:
        if self._body is not None:
            self._body.received += len(body)
        if not self._refused:
            super().on_body(body)

    def on_message_complete(self) -> None:
        self._stop_body_clock()
        self._in_head, self._head_bytes = True, 0
        if not self._refused:
            super().on_message_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.timeout_keep_alive_task is not None:  # no pipelined request queued: the next head is awaited
            self._await_head()

    def _refuse(self) -> None:
        if self._refused:
            return
        self._refused = True
        message = f"request line and headers exceed {self.max_head_bytes} bytes"
        log.warning("request from %s refused: %s", self.client[0] if self.client else "?", message)
        self.transport.write(_answer(b"431 Request Header Fields Too Large", "headers_too_large", message))
        self.transport.close()
