"""How long a request body may take (RELIABILITY.md, Security).

A head is timed (api/http/head_limit.py); without a bound on the body, a client that sends its head, then a byte of body
every few seconds, held its connection for good. A body must come at `KEVLAYA_CONNECTIONS__BODY_MIN_BYTES_PER_S` on
average or better, counted from the end of its head, once `KEVLAYA_CONNECTIONS__BODY_TIMEOUT_S` have passed: a small
body has that long whole, a large upload all the time its size needs at that rate, and a trickle is cut off. Time in
which the server itself stopped reading (the app not taking the body yet: uvicorn's flow control) is not counted.
"""

from __future__ import annotations

CHECK_EVERY_S = 0.5


class BodyClock:
    def __init__(self, grace_s: float, min_bytes_per_s: float, now: float) -> None:
        self.grace_s, self.min_bytes_per_s = grace_s, min_bytes_per_s
        self.counted_s = 0.0  # time the client could have sent in
        self.received = 0
        self._last = now

    def tick(self, now: float, reading: bool) -> None:
        if reading:
            self.counted_s += now - self._last
        self._last = now

    def late(self) -> bool:
        """True when the body has come too slowly to go on waiting for it."""
        return self.counted_s >= self.grace_s and self.received < self.min_bytes_per_s * self.counted_s
