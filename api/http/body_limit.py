"""Refuse request bodies over the configured size with 413, whether declared (Content-Length) or chunked.

The body is read here, up to the limit, before the app sees it; the app then reads it from memory. A body
over the limit is still read and discarded up to a bound before the 413 goes out: clients that send the whole
body before reading the answer (Python's urllib, requests) would otherwise see a connection reset instead
of the 413. Past the bound the connection is closed, so nobody can make the server read without end.
"""

from __future__ import annotations

import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.http.errors import ApiError, error_body

# How much of an oversized body is read (and thrown away) so the client can receive its 413.
DRAIN_BYTES = 16 * 1024 * 1024


class BodySizeLimit:
    """`streamed`: paths whose route reads the body as a stream (uploads), each with its own limit: their bodies
    are passed on as they come, counted, and a body that grows past the limit ends in a 413 from the route."""

    def __init__(self, app: ASGIApp, max_bytes: int, drain_bytes: int = DRAIN_BYTES,
                 streamed: dict[str, int] | None = None):
        self.app, self.max_bytes, self.drain_bytes = app, max_bytes, max(drain_bytes, max_bytes)
        self.streamed = streamed or {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.streamed.get(scope["path"])
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > (limit or self.max_bytes):
            await self._reject(receive, send, received=0, declared=int(declared), limit=limit)
            return
        if limit is not None:
            await self.app(scope, _counted(receive, limit), send)
            return

        chunks: list[bytes] = []
        received = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client went away; nobody is waiting for an answer
            chunk = message.get("body", b"")
            received += len(chunk)
            if received > self.max_bytes:
                await self._reject(receive, send, received=received, more=message.get("more_body", False))
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break

        body = b"".join(chunks)
        replayed = False

        async def buffered_receive() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: wait for the disconnect, as the server would report it

        await self.app(scope, buffered_receive, send)

    async def _reject(self, receive: Receive, send: Send, *, received: int, more: bool = True,
                      declared: int | None = None, limit: int | None = None) -> None:
        complete = not more
        if declared is None or declared <= self.drain_bytes:
            while not complete and received <= self.drain_bytes:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return
                received += len(message.get("body", b""))
                complete = not message.get("more_body", False)
        headers = [(b"content-type", b"application/json")]
        if not complete:
            headers.append((b"connection", b"close"))  # the rest of the body stays unread
        body = json.dumps(
            error_body("payload_too_large", f"request body exceeds {limit or self.max_bytes} bytes")
        ).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [*headers, (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


def _counted(receive: Receive, limit: int) -> Receive:
    received = 0

    async def counted_receive() -> Message:
        nonlocal received
        message = await receive()
        received += len(message.get("body", b""))
        if received > limit:
            raise ApiError(413, "payload_too_large", f"request body exceeds {limit} bytes")
        return message

    return counted_receive
