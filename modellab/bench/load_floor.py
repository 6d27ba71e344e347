"""The floor under `kevlaya load`'s figures: routes with the submit routes' paths and answers (202, job ids)
that validate a job-shaped body and store nothing, publish nothing, check no key. What the load generator
measures against them on a machine is the most any submit path could reach there with this generator
(RELIABILITY.md, Load):

    uvicorn modellab.bench.load_floor:app --port 8100 --log-level warning &
    kevlaya load --url http://127.0.0.1:8100 --singles 2000 --batches 20 --no-drain

`sync_app` is the same with the submit routes run in the thread pool, as the service's are."""

from __future__ import annotations

import uuid
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel


class JobBody(BaseModel):
    adapter: str
    input: Any
    params: dict[str, Any] | None = None
    idempotency_key: str | None = None
    metadata: dict[str, Any] | None = None


class BatchBody(BaseModel):
    jobs: list[JobBody]


def build(run_in_threads: bool) -> FastAPI:
    floor = FastAPI(title="kevlaya load floor")

    def submit(body: JobBody) -> dict[str, Any]:
        return {"id": str(uuid.uuid4()), "status": "queued", "adapter": body.adapter}

    def submit_batch(body: BatchBody) -> dict[str, Any]:
        return {"jobs": [{"id": str(uuid.uuid4()), "status": "queued"} for _ in body.jobs]}

    async def submit_async(body: JobBody) -> dict[str, Any]:
        return submit(body)

    async def submit_batch_async(body: BatchBody) -> dict[str, Any]:
        return submit_batch(body)

    floor.post("/v1/jobs", status_code=202)(submit if run_in_threads else submit_async)
    floor.post("/v1/jobs/batch", status_code=202)(submit_batch if run_in_threads else submit_batch_async)
    floor.get("/healthz")(lambda: {"status": "ok"})
    return floor


app = build(run_in_threads=False)
sync_app = build(run_in_threads=True)
