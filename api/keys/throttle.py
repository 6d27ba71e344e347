"""Failed authentications throttled per client address (RELIABILITY.md, Security).

A wrong or revoked key counts one failure for the address it came from, in Redis (a moving window, api/keys/limiter.py),
so every API process counts together. Past `KEVLAYA_KEYS__AUTH_FAILURES_PER_ADDRESS` failures within
`KEVLAYA_KEYS__AUTH_FAILURE_WINDOW_S`, the address gets 429 with `Retry-After` until its oldest failure leaves the
window, whatever key it sends: its keys are no longer looked at, so guessing stops there. The refusal is remembered in
each process that saw it, so a request with a good key costs no Redis round trip; a process that has not seen the
address fail yet looks at one more of its keys, counts the failure and refuses it from then on.

With Redis away nothing is counted and nobody is locked out (logged): the keys are still checked.
"""

from __future__ import annotations

import logging
import math
import time

import redis

from api.http.errors import ApiError
from api.keys.limiter import Window
from shared.settings import Settings

log = logging.getLogger("kevlaya.api")


def _refusal(address: str, wait_s: float, failures: int, window_s: int) -> ApiError:
    return ApiError(429, "too_many_auth_failures",
                    f"{failures} failed authentications from {address} within {window_s} s "
                    "(KEVLAYA_KEYS__AUTH_FAILURES_PER_ADDRESS); retry later", headers={"Retry-After": str(int(wait_s))})


class AuthThrottle:
    def __init__(self) -> None:
        self._refused_until: dict[str, float] = {}  # address -> time.monotonic() its refusal ends

    def check(self, address: str, settings: Settings) -> None:
        """429 while this process knows the address to be over its failures."""
        until = self._refused_until.get(address)
        if until is None:
            return
        left = until - time.monotonic()
        if left > 0:
            keys = settings.keys
            raise _refusal(address, math.ceil(left), keys.auth_failures_per_address, keys.auth_failure_window_s)
        del self._refused_until[address]

    def failed(self, address: str, settings: Settings) -> None:
        """Count a failure; 429 when the address is over the limit with it."""
        failures, window_s = settings.keys.auth_failures_per_address, settings.keys.auth_failure_window_s
        try:
            wait_s = Window(failures, window_s).take(f"auth-failures:{address}")
        except redis.RedisError:
            log.warning("failed authentication from %s not counted: Redis unavailable", address)
            return
        if wait_s is None:
            return
        if len(self._refused_until) > 10_000:  # addresses whose refusal has ended
            now = time.monotonic()
            self._refused_until = {a: until for a, until in self._refused_until.items() if until > now}
        self._refused_until[address] = time.monotonic() + wait_s
        log.warning("authentication from %s refused for %d s: %d failures within %d s", address, wait_s, failures,
                    window_s)
        raise _refusal(address, wait_s, failures, window_s)

