""""Job finished" notices on Redis pub/sub: the worker announces every final state, the API's long-polls
wake up on them. A notice is a hint: waiters re-read the job row, and re-check on their own now and then
in case a notice was lost (Redis down, a subscriber reconnecting)."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterable

import redis

from shared.queue import redis_client

FINISHED_CHANNEL = "kevlaya:jobs:finished"

log = logging.getLogger("kevlaya.notify")


def publish_finished(job_ids: Iterable[uuid.UUID]) -> None:
    """Announce finished jobs; never raises (the rows are committed, waiters re-check on their own)."""
    ids = [str(job_id) for job_id in job_ids]
    try:
        pipeline = redis_client().pipeline(transaction=False)
        for job_id in ids:
            pipeline.publish(FINISHED_CHANNEL, job_id)
        pipeline.execute()
    except redis.RedisError as exc:
        log.warning("could not announce %d finished job(s) (waiters will find them on their re-check): %s",
                    len(ids), exc)
