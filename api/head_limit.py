"""The HTTP server protocol: uvicorn's httptools parser, with a bound on the request line plus headers.

httptools parses several times faster than h11 (RELIABILITY.md, Load), but it takes a head of any size: it
keeps a header that arrives in pieces until the header ends. This protocol counts the bytes of a head still
being received and refuses it with 431 once they pass `KEVLAYA_MAX_HEADER_BYTES`, so nobody can make the
server hold an endless head; a head that arrived whole is measured once parsed, so the bound is the same
however the head was cut into reads. A refused request never reaches the app.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from api.errors import error_body
from shared.settings import get_settings

log = logging.getLogger("kevlaya.api")


class BoundedHeadProtocol(HttpToolsProtocol):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.max_head_bytes = get_settings().max_header_bytes
        self._head_bytes = 0  # received since the request began, while its head is incomplete
        self._in_head = True
        self._refused = False

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
        if len(self.url) + sum(len(name) + len(value) for name, value in self.headers) > self.max_head_bytes:
            self._refuse()
            return
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        if not self._refused:
            super().on_body(body)

    def on_message_complete(self) -> None:
        self._in_head, self._head_bytes = True, 0
        if not self._refused:
            super().on_message_complete()

    def _refuse(self) -> None:
        if self._refused:
            return
        self._refused = True
        message = f"request line and headers exceed {self.max_head_bytes} bytes"
        log.warning("request from %s refused: %s", self.client[0] if self.client else "?", message)
        body = json.dumps(error_body("headers_too_large", message)).encode()
        self.transport.write(
            b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body)
        )
        self.transport.close()
