"""Worker heartbeats in Redis: readiness needs a live worker with its model loaded."""

from __future__ import annotations

import json
from typing import Any

from shared.queue import redis_client

PREFIX = "kevlaya:worker:"


def beat(worker: str, info: dict[str, Any], ttl_s: int) -> None:
    redis_client().set(PREFIX + worker, json.dumps(info), ex=ttl_s)


def live_workers() -> dict[str, dict[str, Any]]:
    client = redis_client()
    workers = {}
    for key in client.scan_iter(match=PREFIX + "*", count=100):
        raw = client.get(key)
        if raw is not None:
            workers[key.decode().removeprefix(PREFIX)] = json.loads(raw)
    return workers
