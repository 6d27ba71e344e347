"""The whole service as a user runs it, as real processes: a Redis-protocol server, the API and the Celery worker
(`kevlaya api`, `kevlaya worker`) on a SQLite file or a PostgreSQL. Jobs go in over HTTP; what happened is read from
the rows."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import create_engine, select
from sqlalchemy.orm import Session

from shared.migrate import upgrade
from shared.models import ClaimGroup, Job, JobStatus
from shared.redis_server import answers, start_redis_server

log = logging.getLogger("kevlaya.bench")
API_KEY = "kl_bench_admin_key_for_local_runs_4b8d27"  # as strong as KEVLAYA_API__KEY must be


_handed_out: set[int] = set()


def free_port() -> int:
    """A port nothing listens on and not handed out before by this process: the servers it is for bind it later,
    and the kernel may offer a port again until then."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port


@dataclass
class JobRow:
    id: str
    adapter: str
    status: str
    error_code: str | None
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    total_ms: float | None
    ttft_ms: float | None
    queue_ms: float | None
    batch_id: str | None
    completion_tokens: int | None = None


@dataclass
class BatchRow:
    id: str
    adapters: str
    size: int
    started_at: datetime
    finished_at: datetime | None
    peak_vram_bytes: int | None


class Processes:
    """The service's own processes for one measurement, each logging to `workdir/<kind>.log`: a Redis-protocol
    server when none answers at the URL, then `kevlaya api` and `kevlaya worker` as a user runs them."""

    def __init__(self, workdir: Path, settings: dict[str, str], database_url: str, redis_url: str):
        self.workdir, self.database_url, self.redis_url = workdir, database_url, redis_url
        self.env = {**os.environ, **settings, "KEVLAYA_DATABASE__URL": database_url, "KEVLAYA_REDIS__URL": redis_url}
        self.running: dict[str, subprocess.Popen] = {}
        self.redis_persistent = False  # an append-only file, for a Redis restarted "with its data"

    def prepare(self) -> None:
        """The database migrated, and a Redis answering (a private server if none does)."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        upgrade(self.database_url)
        if not answers(self.redis_url):
            port = int(self.redis_url.rsplit(":", 1)[1].split("/")[0])
            self.running["redis"] = start_redis_server(port, self.workdir / "redis", persistent=self.redis_persistent)

    def start(self, kind: str, extra: dict[str, str] | None = None) -> None:
        log_file = open(self.workdir / f"{kind}.log", "ab")  # a restarted process logs after its predecessor
        self.running[kind] = subprocess.Popen([sys.executable, "-m", "cli", kind],
                                              env={**self.env, **(extra or {})}, stdout=log_file,
                                              stderr=subprocess.STDOUT, start_new_session=True)

    def check_alive(self, kind: str) -> None:
        if self.running[kind].poll() is not None:
            raise RuntimeError(f"the {kind} exited:\n{self.log_tail(kind)}")

    def log_tail(self, kind: str, chars: int = 3000) -> str:
        return (self.workdir / f"{kind}.log").read_text(errors="replace")[-chars:]

    def stop(self) -> None:
        for name in ("worker", "api", "redis"):
            process = self.running.get(name)
            if process is None or process.poll() is not None:
                continue
            os.killpg(process.pid, 15) if name != "redis" else process.terminate()
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                process.kill()


class Service:
    """API + worker + Redis for one benchmark run; `settings` are KEVLAYA_* values (e.g. the model paths). The
    database is a SQLite file in `workdir` unless `database_url` names another (migrated on start)."""

    def __init__(self, workdir: Path, settings: dict[str, str], redis_url: str | None = None,
                 database_url: str | None = None):
        self.port, self.metrics_port = free_port(), free_port()
        database_url = database_url or f"sqlite:///{workdir / 'bench.db'}"
        self.processes = Processes(workdir, {**settings, "KEVLAYA_API__KEY": API_KEY,
                                              "KEVLAYA_API__PORT": str(self.port),
                                              "KEVLAYA_MONITORING__METRICS_PORT": str(self.metrics_port)},
                                   database_url, redis_url or f"redis://127.0.0.1:{free_port()}/0")
        self.client = httpx.Client(base_url=f"http://127.0.0.1:{self.port}",
                                   headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120)
        self.engine = create_engine(database_url)

    def __enter__(self) -> Service:
        self.processes.prepare()
        self.processes.start("api")
        self.processes.start("worker")
        self._wait_ready(timeout=900)
        return self

    def __exit__(self, *_exc: object) -> None:
        self.client.close()
        self.processes.stop()
        self.engine.dispose()

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.processes.check_alive("api")
            self.processes.check_alive("worker")
            if "model load failed" in self.processes.log_tail("worker", 100_000):  # it would wait for a fix in vain
                raise RuntimeError(f"the worker could not load the model:\n{self.processes.log_tail('worker')}")
            try:
                if self.client.get("/readyz").status_code == 200:
                    return
            except httpx.TransportError:
                pass  # not listening yet
            time.sleep(0.5)
        raise RuntimeError(f"the service was not ready after {timeout:.0f}s:\n{self.processes.log_tail('worker')}")

    def worker_status(self) -> dict[str, Any]:
        """The heartbeat of this run's worker (slots, window, GPU memory), as the status page sees it."""
        response = self.client.get("/v1/stats/live")
        response.raise_for_status()
        workers = (response.json()["workers"] or {}).values()
        return next((w for w in workers if w.get("model_loaded")), {})

    def engine_phases(self) -> dict[str, tuple[float, float]]:
        """The worker's engine phase totals so far, from its /metrics: {phase: (count, seconds)}, and the decode
        steps launched as {"steps": (count, 0)}."""
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10).text
        totals: dict[str, dict[str, float]] = {}
        for family in text_string_to_metric_families(text):
            if family.name == "kevlaya_engine_phase_seconds":
                for sample in family.samples:  # _count and _sum per phase (the _bucket samples are not needed)
                    name = sample.name.removeprefix(family.name)
                    totals.setdefault(sample.labels["phase"], {})[name] = sample.value
            elif family.name == "kevlaya_engine_steps":
                for sample in family.samples:
                    if sample.name.endswith("_total"):
                        totals["steps"] = {"_count": sample.value, "_sum": 0.0}
        return {phase: (values["_count"], values["_sum"]) for phase, values in totals.items()}

    # -- jobs ------------------------------------------------------------------------------------------------

    def submit(self, bodies: list[dict[str, Any]]) -> list[str]:
        """Submit over HTTP, in batch requests of at most 256 jobs; returns the job ids in order."""
        ids: list[str] = []
        for start in range(0, len(bodies), 256):
            response = self.client.post("/v1/jobs/batch", json={"jobs": bodies[start:start + 256]})
            if response.status_code != 202:
                raise RuntimeError(f"batch submit answered {response.status_code}: {response.text}")
            ids += [job["id"] for job in response.json()["jobs"]]
        return ids

    def submit_one(self, body: dict[str, Any]) -> str:
        response = self.client.post("/v1/jobs", json=body)
        if response.status_code != 202:
            raise RuntimeError(f"submit answered {response.status_code}: {response.text}")
        return response.json()["id"]

    def wait(self, ids: list[str], timeout: float = 1800) -> list[JobRow]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            rows = self.jobs(ids)
            if all(row.status in JobStatus.FINISHED for row in rows):
                return rows
            self.processes.check_alive("worker")
            time.sleep(0.2)
        raise RuntimeError(f"{len(ids)} job(s) not finished after {timeout:.0f}s")

    def pending(self, ids: list[str]) -> int:
        return sum(row.status not in JobStatus.FINISHED for row in self.jobs(ids))

    def jobs(self, ids: list[str]) -> list[JobRow]:
        import uuid

        wanted = [uuid.UUID(i) for i in ids]
        with Session(self.engine) as session:
            found = {str(j.id): j for j in session.scalars(select(Job).where(Job.id.in_(wanted)))}
        return [JobRow(id=i, adapter=(j := found[i]).adapter, status=j.status, error_code=j.error_code,
                       created_at=j.created_at, started_at=j.started_at, finished_at=j.finished_at,
                       total_ms=j.total_ms, ttft_ms=j.ttft_ms, queue_ms=j.queue_ms,
                       batch_id=str(j.batch_id) if j.batch_id else None, completion_tokens=j.completion_tokens)
                for i in ids if i in found]  # a job deleted (DELETE /v1/jobs/{id} of a finished one) is gone

    def batches(self, since: datetime | None = None) -> list[BatchRow]:
        with Session(self.engine) as session:
            query = select(ClaimGroup).order_by(ClaimGroup.started_at)
            if since is not None:
                query = query.where(ClaimGroup.started_at >= since)
            return [BatchRow(id=str(b.id), adapters=b.adapters, size=b.size, started_at=b.started_at,
                             finished_at=b.finished_at, peak_vram_bytes=b.peak_vram_bytes)
                    for b in session.scalars(query)]
