"""Long-polls: a job waited for until it has finished (`GET /v1/jobs/{id}/wait`, chat completions, responses), on
the "finished" notices (api/streams/notices.py) instead of polling the database."""

from __future__ import annotations

import asyncio
import time
import uuid

from fastapi.concurrency import run_in_threadpool

from api.jobs.lookup import read_visible
from api.streams.notices import notices
from shared.models import ApiKey, JobStatus
from shared.schemas import JobOut
from shared.settings import get_settings


async def wait_finished(key: ApiKey, job_id: uuid.UUID, timeout_s: float) -> JobOut:
    """The job as soon as it is finished, or as it stands when `timeout_s` has passed. While it waits it holds
    no database connection and no thread: it wakes on the job's "finished" notice, or re-checks every
    `KEVLAYA_LIMITS__WAIT_RECHECK_S` in case a notice was lost."""

    def read() -> JobOut:
        return read_visible(key, job_id)

    deadline = time.monotonic() + timeout_s
    recheck_s = get_settings().limits.wait_recheck_s
    with notices.watch(job_id) as finished:
        await notices.subscribed(timeout_s=min(1.0, timeout_s))
        job = await run_in_threadpool(read)
        while job.status not in JobStatus.FINISHED:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                await asyncio.wait_for(finished.wait(), min(remaining, recheck_s))
            except TimeoutError:
                pass
            finished.clear()
            job = await run_in_threadpool(read)
    return job
