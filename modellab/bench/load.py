"""`kevlaya load`: submit throughput and latency of the API, then an exactly-once check of the drain.

Bounded in requests and in time, and loopback only. By default it starts its own service: a private Redis, a
migrated SQLite file (or the PostgreSQL at `--database-url`) and `kevlaya api`. Two submit phases run at a
fixed concurrency: single submits (`POST /v1/jobs`), then batch submits (`POST /v1/jobs/batch`). Only then is a
real worker (`kevlaya worker`, a tiny random-weight model on the CPU, large batches of one new token) started,
so that it does not take CPU from the API while submits are timed; it drains every stored job, and the rows
and Redis "finished" notices are checked: each accepted job stored once, run once, announced once."""

from __future__ import annotations

import asyncio
import gc
import ipaddress
import json
import logging
import statistics
import threading
import time
import uuid
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import httpx

from modellab.bench.disk_probe import DiskProbe

log = logging.getLogger("kevlaya.load")
API_KEY = "kl_load_admin_key_for_local_runs_7c3e91"  # as strong as KEVLAYA_API__KEY must be


def require_loopback(url: str) -> None:
    """Load is only ever sent to this machine."""
    host = urlsplit(url).hostname or ""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise ValueError(f"{url}: load goes to loopback addresses only (127.0.0.0/8, ::1, localhost)")


@dataclass
class LoadConfig:
    workdir: Path
    warmup: int = 256  # single submits sent first and left out of the figures
    singles: int = 2000
    batches: int = 40
    batch_size: int = 256
    concurrency: int = 32
    rate: float | None = None  # single submits/s on schedule (open loop); None: closed loop
    batch_concurrency: int = 4
    time_limit_s: float = 120.0
    drain: bool = True
    drain_timeout_s: float = 300.0
    database_url: str | None = None  # default: a SQLite file in workdir
    url: str | None = None  # an API already running (then no service is started)
    api_key: str = API_KEY
    redis_url: str | None = None
    settings: dict[str, str] = field(default_factory=dict)  # extra KEVLAYA_* for the API it starts
    disk_probe: Path | None = None  # a directory on the database's disk, to time its flushes meanwhile


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=1000, method="inclusive")[round(q * 10) - 1]


@dataclass
class Phase:
    name: str
    requests: int = 0
    jobs: int = 0
    errors: Counter = field(default_factory=Counter)
    seconds: float = 0.0
    latencies_ms: list[float] = field(default_factory=list)
    job_ids: list[str] = field(default_factory=list)
    rate: float | None = None  # requests/s sent on schedule (open loop); None: as fast as answered
    writes: dict[str, Any] | None = None  # the API's own figures for its database writes during the phase
    disk: dict[str, Any] | None = None  # --disk-probe: the disk's flush times during the phase

    def figures(self) -> dict[str, Any]:
        ok = len(self.latencies_ms)
        return {
            "requests": self.requests, "accepted_jobs": len(self.job_ids), "errors": dict(self.errors),
            "offered_rate_per_s": self.rate,
            "seconds": round(self.seconds, 3),
            "submits_per_s": round(ok / self.seconds, 1) if self.seconds else None,
            "jobs_per_s": round(len(self.job_ids) / self.seconds, 1) if self.seconds else None,
            **{f"p{q}_ms": (round(v, 2) if (v := percentile(self.latencies_ms, q)) is not None else None)
               for q in (50, 95, 99)},
            "max_ms": round(max(self.latencies_ms), 2) if self.latencies_ms else None,
            "database_writes": self.writes,
            "disk_flushes": self.disk,
        }


def job_body(n: int) -> dict[str, Any]:
    return {"adapter": "kev" if n % 2 else "laya", "input": f"Load job {n}: option A costs {n % 17}, B costs "
            f"{(n * 7) % 17}. Which is cheaper?", "params": {"output": "text", "max_new_tokens": 1}}


async def run_phase(client: aiohttp.ClientSession, phase: Phase, count: int, size: int, concurrency: int,
                    deadline: float) -> None:
    """`count` requests of `size` jobs (1: single submits), `concurrency` at a time, none sent after `deadline`.

    Without `phase.rate` each connection sends its next request as soon as it has its answer (closed loop: the figures
    are the most the API takes, and the latency it then has). With a rate, request n is due `n / rate` seconds
    after the start (open loop) and its latency counts from then, so a request that had to wait for a free
    connection counts its wait: the latency the API gives at that load."""
    counter = iter(range(count))
    rate = phase.rate

    async def one_by_one() -> None:
        for n in counter:
            if time.monotonic() > deadline:
                return
            bodies = [job_body(n * size + i) for i in range(size)]
            path, body = ("/v1/jobs", bodies[0]) if size == 1 else ("/v1/jobs/batch", {"jobs": bodies})
            if rate:
                due = phase_started + n / rate
                await asyncio.sleep(max(0.0, due - time.perf_counter()))
                started = due
            else:
                started = time.perf_counter()
            try:
                async with client.post(path, json=body) as response:
                    answer = await response.read()
            except (aiohttp.ClientError, TimeoutError) as exc:
                phase.requests += 1
                phase.errors[exc.__class__.__name__] += 1
                continue
            elapsed_ms = (time.perf_counter() - started) * 1000
            phase.requests += 1
            if response.status != 202:
                phase.errors[str(response.status)] += 1
                continue
            phase.latencies_ms.append(elapsed_ms)
            accepted = json.loads(answer)
            phase.job_ids += [accepted["id"]] if size == 1 else [j["id"] for j in accepted["jobs"]]

    phase_started = time.perf_counter()
    gc.disable()  # a collection in the generator would be timed as the API's latency
    try:
        await asyncio.gather(*(one_by_one() for _ in range(concurrency)))
    finally:
        gc.enable()
    phase.seconds = time.perf_counter() - phase_started


async def write_buckets(client: aiohttp.ClientSession) -> dict[float, float]:
    """The API's histogram of its job writer's commits (kevlaya_submit_write_seconds): upper bound -> count;
    empty for a target that has no such histogram."""
    from prometheus_client.parser import text_string_to_metric_families

    async with client.get("/metrics") as response:
        if response.status != 200:
            return {}
        text = await response.text()
    return {float(sample.labels["le"]): sample.value
            for family in text_string_to_metric_families(text) if family.name == "kevlaya_submit_write_seconds"
            for sample in family.samples if sample.name.endswith("_bucket")}


def write_figures(before: dict[float, float], after: dict[float, float], slow_s: float = 0.05) -> dict[str, Any]:
    """How many commits the phase made and how many took longer than `slow_s`: a submit waits for its unit's
    commit, so a storage flush stall in the database shows here and in the latency tail at once."""
    counts = {le: after[le] - before.get(le, 0.0) for le in after}
    units = int(counts.get(float("inf"), 0))
    finite = sorted(le for le in counts if le != float("inf"))
    slowest = next((le for le in finite if counts[le] == units), None) if units else None  # each took at most
    return {"commits": units, f"over_{round(slow_s * 1000)}ms": units - int(counts.get(slow_s, 0)),
            "slowest_at_most_s": slowest}


async def submit_all(config: LoadConfig, base_url: str, probe: DiskProbe | None = None) -> list[Phase]:
    """Both phases on keep-alive connections. The client is aiohttp: httpx costs several times more CPU per
    request, and the generator shares the machine's cores with the API it measures (RELIABILITY.md, Load)."""
    headers = {"Authorization": f"Bearer {config.api_key}"}
    deadline = time.monotonic() + config.time_limit_s
    phases = [Phase("warmup"), Phase("single", rate=config.rate), Phase("batch")]
    connector = aiohttp.TCPConnector(limit=max(config.concurrency, config.batch_concurrency))
    async with aiohttp.ClientSession(base_url, headers=headers, connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=60)) as client:
        async with client.get("/healthz") as response:
            response.raise_for_status()
        # A fresh API's first answers carry its one-time costs (every key not yet cached, connections opened,
        # modules imported on first use): measured, but apart from the figures.
        sizes = [(config.warmup, 1, config.concurrency), (config.singles, 1, config.concurrency),
                 (config.batches, config.batch_size, config.batch_concurrency)]
        for phase, (count, size, concurrency) in zip(phases, sizes):
            before, started = await write_buckets(client), probe.mark() if probe else 0
            await run_phase(client, phase, count, size, concurrency, deadline)
            if after := await write_buckets(client):
                phase.writes = write_figures(before, after)
            if probe:
                phase.disk = probe.figures(started, probe.mark())
    return phases


# -- the service it starts, and the drain check -------------------------------------------------------------

class LoadService:
    """Redis, the database and the API as real processes; the worker once the submits are done."""

    def __init__(self, config: LoadConfig):
        from modellab.bench.service import Processes, free_port

        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.processes = Processes(
            config.workdir, {"KEVLAYA_API__KEY": config.api_key, "KEVLAYA_API__PORT": str(self.port),
                             "KEVLAYA_API__HOST": "127.0.0.1", **config.settings},
            config.database_url or f"sqlite:///{config.workdir / 'load.db'}",
            config.redis_url or f"redis://127.0.0.1:{free_port()}/0")
        self.database_url, self.redis_url = self.processes.database_url, self.processes.redis_url

    def __enter__(self) -> LoadService:
        self.processes.prepare()
        self.processes.start("api")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            self.processes.check_alive("api")
            try:
                if httpx.get(f"{self.base_url}/healthz", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"the API did not answer in 60 s:\n{self.processes.log_tail('api')}")

    def start_worker(self) -> None:
        from modellab.model_factory import build_random_model

        model = build_random_model(self.processes.workdir / "model", "tiny", seed=0)
        self.processes.start("worker", {
            "KEVLAYA_MODEL__BASE": str(model["base"]), "KEVLAYA_KEV__PATH": str(model["kev"]),
            "KEVLAYA_LAYA__PATH": str(model["laya"]), "KEVLAYA_MODEL__DEVICE": "cpu",
            # many slots of one new token: the drain checks bookkeeping, not the model
            "KEVLAYA_ENGINE__MAX_BATCH": "256"})

    def __exit__(self, *_exc: object) -> None:
        self.processes.stop()


class Announcements:
    """The Redis "finished" notices per job id. Subscribed before the first job can finish, so a run whose worker
    serves while it submits misses none; `collect` may be called from more than one thread."""

    def __init__(self, redis_url: str):
        import redis

        from shared.notify import FINISHED_CHANNEL

        self.counts: Counter[str] = Counter()
        self.outages = 0
        self._lock = threading.Lock()
        self._subscriber = redis.Redis.from_url(redis_url).pubsub()
        self._subscriber.subscribe(FINISHED_CHANNEL)

    def collect(self) -> None:
        import redis

        with self._lock:
            try:
                while (message := self._subscriber.get_message(timeout=0.01)) is not None:
                    if message["type"] == "message":
                        self.counts[message["data"].decode()] += 1
            except (redis.ConnectionError, redis.TimeoutError):
                # Redis restarted (a chaos soak's fault): the next call connects and subscribes again; notices
                # published meanwhile are lost, so the counts are a lower bound from here on.
                self.outages += 1

    def close(self) -> None:
        with self._lock:
            self._subscriber.close()


def check_drain(database_url: str, redis_url: str, accepted: list[str], timeout_s: float,
                alive: Any = None, announcements: Announcements | None = None) -> dict[str, Any]:
    """Wait until every accepted job is finished, then check it was stored, run and announced exactly once.

    `announcements` subscribed earlier (and closed by its owner) counts notices sent before the drain began."""
    from sqlalchemy import create_engine, func, select
    from sqlalchemy.orm import Session

    from shared.models import ClaimGroup, Job, JobStatus

    engine = create_engine(database_url)
    notices = announcements or Announcements(redis_url)
    started = time.perf_counter()
    deadline = time.monotonic() + timeout_s
    pending = len(accepted)
    try:
        while time.monotonic() < deadline:
            notices.collect()
            with Session(engine) as session:
                pending = session.scalar(select(func.count()).select_from(Job)
                                         .where(Job.status.not_in(JobStatus.FINISHED)))
            if pending == 0:
                break
            if alive is not None:
                alive()
            time.sleep(0.2)
        seconds = time.perf_counter() - started
        time.sleep(0.5)
        notices.collect()
        with Session(engine) as session:
            rows = session.execute(select(Job.id, Job.status, Job.attempts, Job.batch_id, Job.parent_job_id,
                                          Job.adapter, Job.file_batch_id)).all()
            batches = {b.id: b for b in session.scalars(select(ClaimGroup))}
    finally:
        if announcements is None:
            notices.close()
        engine.dispose()
    return {"jobs": len(set(accepted)), "pending": pending, "seconds": round(seconds, 2),
            "jobs_per_s": round(len(set(accepted)) / seconds, 1) if seconds else None,
            **drain_problems(rows, batches, accepted, notices.counts)}


def drain_problems(rows: list[Any], batches: dict[Any, Any], accepted: list[str],
                   announced: Counter[str]) -> dict[str, Any]:
    """What breaks exactly-once in the stored rows. An escalated `auto` job has two child rows: the record of its
    Laya stage, which ran inside the parent's claim and is no run of its own, and its Kev stage, a run."""
    # A Batch API file's lines are runs too, but accounted for by the file's output, not by submits (a chaos soak
    # sends both).
    top = Counter(str(r.id) for r in rows if r.parent_job_id is None and getattr(r, "file_batch_id", None) is None)
    stages = Counter((str(r.parent_job_id), r.adapter) for r in rows if r.parent_job_id is not None)
    stage_records = sum(n for (_, adapter), n in stages.items() if adapter == "laya")
    wanted = set(accepted)
    finished_batches = [b for b in batches.values() if b.finished_at is not None]
    problems = {
        "accepted_twice": len(accepted) - len(wanted),
        "accepted_not_stored": len(wanted - set(top)),
        "stored_not_accepted": len(set(top) - wanted),
        # a Batch API line's status is its answer's (a decision cut by max_tokens is `failed`, its output line a
        # 200 with finish_reason length): the file's output accounts for it
        "not_succeeded": sum(1 for r in rows if r.status != "succeeded" and getattr(r, "file_batch_id", None) is None),
        "attempts_not_1": sum(1 for r in rows if r.attempts != 1),
        "in_no_finished_batch": sum(1 for r in rows if r.batch_id not in batches
                                    or batches[r.batch_id].finished_at is None),
        "runs_minus_jobs": sum(b.size for b in finished_batches) - (len(rows) - stage_records),
        "announced_not_once": sum(1 for i in wanted if announced[i] != 1),
        "stage_of_no_accepted_job": sum(n for (parent, _), n in stages.items() if parent not in wanted),
        "stage_more_than_once": sum(1 for n in stages.values() if n != 1),
    }
    from shared.models import JobStatus

    pending = sum(1 for r in rows if r.status not in JobStatus.FINISHED)
    return {"batches": len(finished_batches), "stage_rows": sum(stages.values()),
            "problems": problems, "exactly_once": pending == 0 and not any(problems.values())}


def submit_and_probe(config: LoadConfig, base_url: str) -> list[Phase]:
    if config.disk_probe is None:
        return asyncio.run(submit_all(config, base_url))
    with DiskProbe(config.disk_probe) as probe:
        return asyncio.run(submit_all(config, base_url, probe))


def run_load(config: LoadConfig) -> dict[str, Any]:
    if config.url:
        require_loopback(config.url)
        phases = submit_and_probe(config, config.url.rstrip("/"))
        result: dict[str, Any] = {"target": config.url}
        if config.drain and config.database_url and config.redis_url:
            # someone else's worker drains it; only the bookkeeping is checked
            result["drain"] = check_drain(config.database_url, config.redis_url,
                                          [i for p in phases for i in p.job_ids], config.drain_timeout_s)
    else:
        with LoadService(config) as service:
            log.info("API at %s on %s", service.base_url, service.database_url.split("://")[0])
            phases = submit_and_probe(config, service.base_url)
            service.processes.check_alive("api")
            result = {"target": f"started: kevlaya api on {make_kind(service.database_url)}"}
            if config.drain:
                log.info("submits done; starting a worker to drain %d job(s)",
                         sum(len(p.job_ids) for p in phases))
                service.start_worker()
                result["drain"] = check_drain(service.database_url, service.redis_url,
                                              [i for p in phases for i in p.job_ids], config.drain_timeout_s,
                                              alive=lambda: service.processes.check_alive("worker"))
    result.update({p.name: p.figures() for p in phases})
    result["config"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(config).items()
                        if k not in ("api_key",)}
    return result


def make_kind(database_url: str) -> str:
    return "PostgreSQL" if database_url.startswith("postgresql") else "SQLite"


def table(result: dict[str, Any]) -> str:
    lines = [f"target: {result['target']}",
             f"{'phase':<8}{'requests':>9}{'jobs':>8}{'errors':>8}{'submits/s':>11}{'jobs/s':>10}"
             f"{'p50 ms':>9}{'p95 ms':>9}{'p99 ms':>9}"]
    for name in ("warmup", "single", "batch"):
        f = result[name]
        lines.append(f"{name:<8}{f['requests']:>9}{f['accepted_jobs']:>8}{sum(f['errors'].values()):>8}"
                     f"{f['submits_per_s'] or 0:>11.1f}{f['jobs_per_s'] or 0:>10.1f}"
                     f"{f['p50_ms'] or 0:>9.1f}{f['p95_ms'] or 0:>9.1f}{f['p99_ms'] or 0:>9.1f}")
    for name in ("warmup", "single", "batch"):
        parts = []
        if (writes := result[name].get("database_writes")) and writes["commits"]:
            slowest = writes["slowest_at_most_s"]
            parts.append(f"{writes['commits']} database commits, {writes['over_50ms']} over 50 ms, the slowest "
                         f"{'≤ ' + format(slowest * 1000, 'g') + ' ms' if slowest else 'over 5 s'}")
        if (disk := result[name].get("disk_flushes")) and disk["flushes"]:
            parts.append(f"{disk['flushes']} disk flushes, p99 {disk['p99_ms']} ms, max {disk['max_ms']} ms, "
                         f"{disk['over_50ms']} over 50 ms")
        if parts:
            lines.append(f"{name}: {'; '.join(parts)}")
    if drain := result.get("drain"):
        lines.append(f"drain: {drain['jobs']} jobs in {drain['seconds']} s by {drain['batches']} batches; "
                     f"exactly once: {'yes' if drain['exactly_once'] else 'NO'} {json.dumps(drain['problems'])}")
    return "\n".join(lines)


def new_workdir() -> Path:
    import tempfile

    return Path(tempfile.mkdtemp(prefix=f"kevlaya-load-{uuid.uuid4().hex[:6]}-"))
