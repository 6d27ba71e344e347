"""A key's rate limit counts jobs, not requests: `POST /v1/jobs/batch` with 256 jobs costs 256, a chat completion
or `POST /v1/jobs` costs 1. Lines of a Batch API file are not counted (their batch is bounded by the file limits,
runs behind interactive jobs and is shared out between keys by the claims; docs/architecture.md §15)."""

from __future__ import annotations

import logging

import redis
from fastapi.concurrency import run_in_threadpool

from api.http.errors import ApiError
from api.keys.limiter import Window
from shared.models import ApiKey

log = logging.getLogger("kevlaya.api")
WINDOW_S = 60


def _charge(key: ApiKey, jobs: int) -> None:
    per_minute = key.rate_limit_per_minute
    if per_minute is None:
        return
    if jobs > per_minute:  # would never fit: no Retry-After makes it
        raise ApiError(429, "rate_limited", f"{jobs} jobs in one request are more than this key's rate limit of "
                       f"{per_minute} jobs a minute; send at most {per_minute} at once")
    try:
        wait_s = Window(per_minute, WINDOW_S).take(f"jobs:{key.id}", cost=jobs)
    except redis.RedisError:
        log.warning("rate limit of key %s not checked: Redis unavailable", key.id)
        return  # the submit refuses on its own (no broker); reads are not rate limited
    if wait_s is not None:
        raise ApiError(429, "rate_limited", f"this key allows {per_minute} jobs a minute (a moving window); "
                       f"{jobs} more do not fit now", headers={"Retry-After": str(int(wait_s))})


async def charge_jobs(key: ApiKey, jobs: int) -> None:
    """Count `jobs` against the key's rate limit, or 429 with `Retry-After` (nothing counted) when they do not fit."""
    if key.rate_limit_per_minute is not None:
        await run_in_threadpool(_charge, key, jobs)
