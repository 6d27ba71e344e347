"""Realistic job and batch rows in bulk, to measure /v1/stats on a large table (`kevlaya dev seed-jobs`).

Rows look like the service's own: kev, laya and `auto` jobs (some escalated, with their Laya stage and Kev
child), grouped into per-adapter batches, mostly succeeded with a few failures of each code, queued and
running ones in the last minute, prompts and answers of a realistic length, spread over the last `hours`."""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

from sqlalchemy import Engine, insert

from shared.models import ClaimGroup, Job

FAILURES = (("invalid_output", 0.6), ("out_of_memory", 0.15), ("numerical_error", 0.1), ("internal", 0.15))
PROMPT = ("Options: A cost {a} risk low days 12 quality 6; B cost {b} risk high days 5 quality 8; C cost {c} risk "
          "medium days 9 quality 7. Constraints: budget 45, max risk medium. Objective: lowest cost.")
ANSWER = '{{"options": ["A {a}", "C {c}"], "decision": "{d}", "rationale": "A meets the budget and the risk cap."}}'
CHUNK = 5_000


class _Batcher:
    """Jobs of one adapter fill that adapter's open batch (up to 16), as the scheduler groups them."""

    def __init__(self, rng: random.Random, worker: str):
        self.rng, self.worker = rng, worker
        self.current: dict[str, dict[str, Any]] = {}
        self.done: list[dict[str, Any]] = []

    def place(self, adapter: str, started: datetime, job: dict[str, Any]) -> uuid.UUID:
        batch = self.current.get(adapter)
        if batch is None or batch["size"] >= batch["capacity"]:
            batch = self.current[adapter] = {
                "id": uuid.uuid4(), "adapters": adapter, "size": 0, "capacity": self.rng.randint(4, 16),
                "prefill_ms": 0.0, "decode_ms": 0.0, "tokens": 0,
                "peak_vram_bytes": self.rng.randint(3_000_000_000, 5_800_000_000),
                "worker": self.worker, "started_at": started, "finished_at": started,
            }
            self.done.append(batch)
        batch["size"] += 1
        batch["prefill_ms"] = max(batch["prefill_ms"], job["prefill_ms"] or 0.0)
        batch["decode_ms"] = max(batch["decode_ms"], job["decode_ms"] or 0.0)
        batch["tokens"] += job["completion_tokens"] or 0
        batch["finished_at"] = max(batch["finished_at"], job["finished_at"] or started)
        return batch["id"]


def _job(rng: random.Random, adapter: str, requested: str, created: datetime, now: datetime,
         parent: uuid.UUID | None = None, status: str | None = None) -> dict[str, Any]:
    a, b, c = rng.randint(10, 60), rng.randint(10, 60), rng.randint(10, 60)
    kev = adapter == "kev"
    queue_ms = rng.lognormvariate(4.5, 1.0)  # ~90 ms median, a long tail
    prefill_ms = rng.uniform(15, 60)
    tokens = rng.randint(150, 500) if kev else rng.randint(12, 40)
    decode_ms = tokens * rng.uniform(18, 30)
    finished = created + timedelta(milliseconds=queue_ms + prefill_ms + decode_ms)
    if status is None:
        roll = rng.random()
        status = "succeeded" if roll < 0.94 else "failed" if roll < 0.99 else "cancelled"
        if finished > now:  # still in progress at the end of the span
            status = "running" if created + timedelta(milliseconds=queue_ms) <= now else "queued"
    error_code = None
    if status == "failed":
        error_code = rng.choices([c for c, _ in FAILURES], [w for _, w in FAILURES])[0]
    ran = status in ("succeeded", "failed", "running")
    done = status in ("succeeded", "failed")
    return {
        "id": uuid.uuid4(), "adapter": adapter, "requested_adapter": requested, "status": status,
        "input": PROMPT.format(a=a, b=b, c=c), "params": {"output": "decision"},
        "result_text": ANSWER.format(a=a, c=c, d="A") if done else None,
        "decision": {"decision": "A", "confidence": round(rng.uniform(0.5, 1), 4)} if status == "succeeded" else None,
        "error_code": error_code, "error_message": f"seeded {error_code}" if error_code else None,
        "parent_job_id": parent, "batch_id": None, "attempts": 1 if ran else 0,
        "created_at": created,
        "started_at": created + timedelta(milliseconds=queue_ms) if ran else None,
        "finished_at": finished if done else (created if status == "cancelled" else None),
        "queue_ms": queue_ms if ran else None,
        "prefill_ms": prefill_ms if done else None, "decode_ms": decode_ms if done else None,
        "ttft_ms": queue_ms + prefill_ms if done else None,
        "total_ms": (finished - created).total_seconds() * 1000 if done else None,
        "prompt_tokens": rng.randint(150, 260) if ran else None, "completion_tokens": tokens if done else None,
    }


def generate(count: int, hours: float, seed: int = 0, now: datetime | None = None,
             escalation_rate: float = 0.3) -> Iterator[tuple[str, dict[str, Any]]]:
    """("job" | "batch", row) in insert order: every batch before its jobs, every parent before its children."""
    rng = random.Random(seed)
    now = now or datetime.now(timezone.utc)
    start = now - timedelta(hours=hours)
    step = timedelta(hours=hours) / max(count, 1)
    batcher = _Batcher(rng, "seed-host:1")
    made = 0
    pending: list[dict[str, Any]] = []

    def flush() -> Iterator[tuple[str, dict[str, Any]]]:
        for batch in batcher.done:
            yield "batch", {k: v for k, v in batch.items() if k != "capacity"}
        batcher.done.clear()
        for job in pending:
            yield "job", job
        pending.clear()

    while made < count:
        created = start + step * made
        requested = rng.choices(("kev", "laya", "auto"), (0.35, 0.45, 0.2))[0]
        adapter = "laya" if requested == "auto" else requested
        job = _job(rng, adapter, requested, created, now)
        rows = [job]
        if requested == "auto" and job["status"] == "succeeded" and rng.random() < escalation_rate:
            # escalated: the Laya stage is recorded, Kev runs as a child, the parent takes Kev's answer
            stage = _job(rng, "laya", "laya", created, now, parent=job["id"], status=job["status"])
            stage.update({k: job[k] for k in ("queue_ms", "prefill_ms", "decode_ms", "ttft_ms", "started_at")})
            kev = _job(rng, "kev", "kev", job["finished_at"], now, parent=job["id"])
            job.update(status=kev["status"], error_code=kev["error_code"], finished_at=kev["finished_at"])
            rows += [stage, kev]
        for row in rows:
            if row["started_at"] is not None and not (row is job and len(rows) > 1):
                row["batch_id"] = batcher.place(row["adapter"], row["started_at"], row)
        if len(rows) > 1:
            job["batch_id"] = rows[1]["batch_id"]
        pending.extend(rows)
        made += len(rows)
        if len(pending) >= CHUNK:
            yield from flush()
    yield from flush()


def seed_jobs(engine: Engine, count: int, hours: float = 24, seed: int = 0,
              progress: Callable[[int], None] | None = None) -> dict[str, float]:
    """Insert about `count` job rows (and their batches); returns rows and seconds."""
    started = time.perf_counter()
    jobs = batches = 0
    seen_batches: set[uuid.UUID] = set()
    buffer: dict[str, list[dict[str, Any]]] = {"batch": [], "job": []}

    def write(connection: Any) -> None:
        nonlocal jobs, batches
        if buffer["batch"]:
            connection.execute(insert(ClaimGroup), buffer["batch"])
            batches += len(buffer["batch"])
        if buffer["job"]:
            connection.execute(insert(Job), buffer["job"])
            jobs += len(buffer["job"])
            if progress:
                progress(len(buffer["job"]))
        buffer["batch"], buffer["job"] = [], []

    with engine.begin() as connection:
        for kind, row in generate(count, hours, seed):
            if kind == "batch":
                # A batch still filling at a chunk's end is written then; its later jobs refer to it.
                if row["id"] in seen_batches:
                    continue
                seen_batches.add(row["id"])
            buffer[kind].append(row)
            if len(buffer["job"]) >= CHUNK:
                write(connection)
        write(connection)
    return {"jobs": jobs, "batches": batches, "seconds": time.perf_counter() - started}
