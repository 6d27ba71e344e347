"""The `limits` library's moving window, stored in the service's Redis, so every API process counts together.

A moving window counts what happened in the last `window` seconds from now, unlike a fixed window, which lets a
client spend its whole allowance just before a window's edge and again just after it (twice its rate).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from functools import lru_cache

import redis
from limits import RateLimitItemPerSecond
from limits.storage import RedisStorage
from limits.strategies import MovingWindowRateLimiter

from shared.queue import redis_client

KEY_PREFIX = "kevlaya:limits"


@lru_cache(maxsize=4)
def _limiter(pool: redis.ConnectionPool) -> MovingWindowRateLimiter:
    # The service's own connection pool (its URL, password and timeouts), not a second client of limits' making.
    return MovingWindowRateLimiter(RedisStorage("redis://", connection_pool=pool, key_prefix=KEY_PREFIX))


@dataclass(frozen=True)
class Window:
    """At most `amount` in any `seconds` seconds."""

    amount: int
    seconds: int

    def take(self, name: str, cost: int = 1) -> float | None:
        """Count `cost` under `name` if it fits in the window; else count nothing and return the seconds until it
        would fit at the earliest (the oldest entry leaving the window). Raises redis.RedisError when Redis is away."""
        item = RateLimitItemPerSecond(self.amount, self.seconds)
        limiter = _limiter(redis_client().connection_pool)
        if limiter.hit(item, name, cost=cost):
            return None
        reset_at = limiter.get_window_stats(item, name).reset_time
        return max(1.0, math.ceil(reset_at - time.time()))
