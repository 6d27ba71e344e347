"""Per-key caps on the requests that stay open: event streams and long-polls (RELIABILITY.md, Security).

Each holds a connection and a task of the API process for as long as its job runs, so one key's thousands of them
slowed every other key's requests. Counted per API process (its event loop alone touches the counts): with
`KEVLAYA_API__WORKERS` processes a key may hold that many times the cap in all.
"""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from api.http.errors import ApiError

RETRY_AFTER_S = "1"


class OpenPerKey:
    def __init__(self, what: str, code: str, variable: str) -> None:
        self.what, self.code, self.variable = what, code, variable
        self._open: Counter[uuid.UUID] = Counter()

    def open(self, key_id: uuid.UUID) -> int:
        return self._open[key_id]

    def take(self, key_id: uuid.UUID, cap: int) -> Callable[[], None]:
        """A place for one more of the key's requests, or 429 naming the cap; the function returned gives it back
        (once, however often it is called)."""
        if self._open[key_id] >= cap:
            raise ApiError(429, self.code, f"this key holds {cap} {self.what} open in this server process, the most "
                           f"{self.variable} allows; close one first", headers={"Retry-After": RETRY_AFTER_S})
        self._open[key_id] += 1
        given_back = False

        def give_back() -> None:
            nonlocal given_back
            if not given_back:
                given_back = True
                self._open[key_id] -= 1
                if not self._open[key_id]:
                    del self._open[key_id]

        return give_back

    @contextmanager
    def hold(self, key_id: uuid.UUID, cap: int) -> Iterator[None]:
        give_back = self.take(key_id, cap)
        try:
            yield
        finally:
            give_back()


streams = OpenPerKey("event streams", "too_many_streams", "KEVLAYA_CONNECTIONS__STREAMS_PER_KEY")
long_polls = OpenPerKey("long-polls", "too_many_long_polls", "KEVLAYA_CONNECTIONS__LONG_POLLS_PER_KEY")


class HeldStream(StreamingResponse):
    """`stream`, giving its key's place back however it ends: finished, its client gone, or the server stopping."""

    def __init__(self, stream: StreamingResponse, give_back: Callable[[], None]) -> None:
        super().__init__(stream.body_iterator, stream.status_code, headers=stream.headers,
                         background=stream.background)
        self.give_back = give_back

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.give_back()
