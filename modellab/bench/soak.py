"""`kevlaya soak`: a bounded soak of the whole service, for memory that grows and jobs that run twice.

It starts Redis, the API and a CPU worker with the shipped demo model (end-of-sequence ignored, so every job
writes exactly its tokens; the worker's torch on one thread, as `stream-load` and `batch-load` run it), on a SQLite
file or the PostgreSQL at `--database-url`. Short-output jobs (`laya`, `kev` and `auto`, 4 to 8 new tokens, text)
go in open loop at `--rate` jobs per second, one request in ten a batch submit, until `--minutes` or `--jobs`
runs out, while a thread samples every `--sample-every` seconds the resident memory of each process of the API and
the worker (found by process tree: the API and its job writer, the Celery parent and its pool child that holds the
model), the queue backlog and the jobs finished. After the drain, `kevlaya load`'s check says whether every job
ended exactly once; memory is judged after the warm-up: growth between the medians of its first and its last
tenth (the verdict, at most 5 %), and beside it the end point, the most it grew, and a least-squares slope.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import statistics
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import httpx
from sqlalchemy.exc import OperationalError

from modellab.bench.batch_load import decision_prompt, service_settings
from modellab.bench.chaos import (
    BATCH_FILE_EVERY_S,
    FOLLOW_EVERY,
    FOLLOWED_NEW_TOKENS,
    FOLLOWERS,
    BatchFiles,
    Chaos,
    StreamWatch,
    fault_figures,
    follow,
)
from modellab.bench.load import Announcements, check_drain, make_kind, percentile
from modellab.bench.service import API_KEY, Service
from modellab.bench.stream_load import cpu_seconds, resident_bytes

log = logging.getLogger("kevlaya.soak")

# jobs/s that the 2-core development machine's CPU worker keeps up with, with a margin (results README: the soak)
DEFAULT_RATE = 10.0
ROLES = ("laya", "kev", "auto")
NEW_TOKENS = (4, 5, 6, 7, 8)
BATCH_EVERY = 10  # one request in ten is a batch submit
BATCH_SIZE = 8
GROWTH_TARGET_PCT = 5.0
KEPT_UP_S = 30.0  # the worker kept up when it finished everything within this many seconds of the last submit


@dataclass
class SoakConfig:
    workdir: Path
    minutes: float = 30.0
    jobs: int = 50_000
    rate: float = DEFAULT_RATE
    sample_every_s: float = 10.0
    warmup_minutes: float | None = None  # default: a tenth of the run
    database_url: str | None = None  # default: a SQLite file in workdir
    redis_url: str | None = None  # default: a private server
    concurrency: int = 32  # requests in flight at most
    drain_timeout_s: float = 600.0
    seed: int = 0
    chaos: bool = False  # faults at random while the load runs (modellab/bench/chaos.py)
    fault_every_s: tuple[float, float] = (30.0, 90.0)

    @property
    def run_s(self) -> float:
        """How long submitting lasts: the time bound or the job bound, whichever comes first."""
        return min(self.minutes * 60, self.jobs / self.rate)

    @property
    def warmup_s(self) -> float:
        return self.warmup_minutes * 60 if self.warmup_minutes is not None else self.run_s / 10


def soak_settings(workdir: Path) -> dict[str, str]:
    """The demo model as `batch-load` serves it; an escalated `auto` job's Kev stage takes the role's default
    length, which is cut to the workload's longest so that every run stays short."""
    return {**service_settings(workdir), "KEVLAYA_KEV__MAX_NEW_TOKENS": str(max(NEW_TOKENS))}


def job_body(rng: random.Random, n: int) -> dict[str, Any]:
    """Text answers: a decision fails unless its object closes within `max_new_tokens`, which 8 never allow."""
    return {"adapter": ROLES[n % len(ROLES)], "input": decision_prompt(rng),
            "params": {"output": "text", "max_new_tokens": NEW_TOKENS[n % len(NEW_TOKENS)]}}


# -- submitting -----------------------------------------------------------------------------------------------

@dataclass
class Submits:
    """What the open loop sent and what was accepted."""

    ids: list[str] = field(default_factory=list)
    sent: int = 0  # jobs sent, accepted or not
    requests: int = 0
    batch_requests: int = 0
    errors: Counter = field(default_factory=Counter)
    max_lag_s: float = 0.0  # the most a request went out after it was due (connections all busy)
    seconds: float = 0.0
    latencies: list[tuple[float, float]] = field(default_factory=list)  # (sent at, s since the start; answer ms)
    resent: int = 0  # requests sent again after no answer or a 5xx (chaos: same idempotency keys)
    given_up: int = 0  # requests never accepted within RESEND_FOR_S


RESEND_FOR_S = 300.0


async def post(client: aiohttp.ClientSession, bodies: list[dict[str, Any]], submits: Submits, t0: float,
               resend: bool) -> list[str]:
    """The ids accepted. With `resend`, as a client of a service that can fail: a request that got no answer, or a
    5xx or 429, goes again with the same idempotency keys, so a job stored before its answer was lost is
    answered, not stored twice. Without, a refusal is counted and the jobs are not sent again."""
    path, body = ("/v1/jobs", bodies[0]) if len(bodies) == 1 else ("/v1/jobs/batch", {"jobs": bodies})
    deadline = time.monotonic() + RESEND_FOR_S
    while True:
        sent = time.perf_counter()
        try:
            async with client.post(path, json=body) as response:
                answer = await response.json() if response.status == 202 else None
                status = response.status
        except (aiohttp.ClientError, TimeoutError) as exc:
            answer, status = None, exc.__class__.__name__
        if answer is not None:
            submits.latencies.append((round(sent - t0, 3), round((time.perf_counter() - sent) * 1000, 2)))
            return [answer["id"]] if len(bodies) == 1 else [job["id"] for job in answer["jobs"]]
        submits.errors[str(status)] += 1
        if not resend:
            return []
        if isinstance(status, int) and status < 500 and status != 429 or time.monotonic() > deadline:
            submits.given_up += 1
            return []
        submits.resent += 1
        await asyncio.sleep(1.0)


async def submit_open_loop(config: SoakConfig, base_url: str, submits: Submits, alive: Callable[[], None],
                           t0: float, streams: StreamWatch | None = None, batch_files: BatchFiles | None = None,
                           ) -> None:
    """Job k is due k / rate seconds after the start, whatever the answers take (at most `concurrency` requests in
    flight): a service that slows down meets the same arrivals, and its backlog shows it. Under chaos (`streams`),
    requests are sent again until accepted, one single job in FOLLOW_EVERY is followed by a stream client, and a
    Batch API file goes in every BATCH_FILE_EVERY_S, accounted for line by line at the end."""
    rng = random.Random(config.seed)
    connector = aiohttp.TCPConnector(limit=config.concurrency + (FOLLOWERS if streams else 0))
    async with aiohttp.ClientSession(base_url, headers={"Authorization": f"Bearer {API_KEY}"}, connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=60)) as client:
        in_flight, tasks, followers, files = asyncio.Semaphore(config.concurrency), set(), set(), []

        async def send(bodies: list[dict[str, Any]], followed: bool) -> None:
            ids = await post(client, bodies, submits, t0, resend=streams is not None)
            submits.ids += ids
            if followed and ids:
                followers.add(asyncio.create_task(follow(client, ids[0], streams)))

        started, jobs = time.perf_counter(), 0
        while jobs < config.jobs and jobs / config.rate < config.minutes * 60:
            alive()
            if batch_files is not None and time.perf_counter() - started >= len(files) * BATCH_FILE_EVERY_S:
                files.append(asyncio.create_task(batch_files.send(client, len(files), config.seed)))
            size = min(BATCH_SIZE if submits.requests % BATCH_EVERY == BATCH_EVERY - 1 else 1, config.jobs - jobs)
            due = started + jobs / config.rate
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            await in_flight.acquire()
            submits.max_lag_s = max(submits.max_lag_s, time.perf_counter() - due)
            bodies = [job_body(rng, jobs + i) for i in range(size)]
            if streams is not None:  # the same key on every resend of these jobs
                for i, body in enumerate(bodies):
                    body["idempotency_key"] = f"soak-{config.seed}-{jobs + i}"
            followed = streams is not None and size == 1 and submits.requests % FOLLOW_EVERY == 0
            if followed:  # long enough that a fault finds streams open
                bodies[0]["params"]["max_new_tokens"] = FOLLOWED_NEW_TOKENS
            task = asyncio.create_task(send(bodies, followed))
            tasks.add(task)
            task.add_done_callback(lambda done: (tasks.discard(done), in_flight.release()))
            jobs += size
            submits.sent = jobs
            submits.requests += 1
            submits.batch_requests += size > 1
        await asyncio.gather(*tasks)
        submits.seconds = time.perf_counter() - started
        await asyncio.gather(*followers)  # each ends at its job's `done`, during the drain
        await asyncio.gather(*files)
        if batch_files is not None:
            batch_files.figures = await batch_files.account(client)


# -- sampling -------------------------------------------------------------------------------------------------

def parents() -> dict[int, int]:
    """pid -> parent pid of every process now."""
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                found[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue  # gone meanwhile
    return found


def command_line(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def process_labels(roots: dict[str, int]) -> dict[str, int]:
    """label -> pid for each root and its descendants: the root is its kind ("api", "worker"); a descendant is
    named by its `-m` module ("api/api.jobs.writer_process"), or "child" when it runs what its root runs (a forked
    Celery pool child); a second process of one name gets "#2"."""
    tree = parents()
    labels: dict[str, int] = {}
    for kind, root in roots.items():
        labels[kind] = root
        root_command, below, frontier = command_line(root), [], [root]
        while frontier:
            children = sorted(pid for pid, ppid in tree.items() if ppid in frontier)
            below += children
            frontier = children
        for pid in below:
            command = command_line(pid)
            module = command[command.index("-m") + 1] if "-m" in command[:-1] else "child"
            name = f"{kind}/{'child' if command == root_command else module}"
            labels[name if name not in labels else next(f"{name}#{n}" for n in range(2, 99)
                                                         if f"{name}#{n}" not in labels)] = pid
    return labels


class QueueCounts:
    """Jobs by state from the database: the backlog (queued and running rows, an `auto` job's Kev stage among
    them) and the submitted jobs finished so far."""

    def __init__(self, database_url: str):
        from sqlalchemy import create_engine

        self.engine = create_engine(database_url)

    def read(self) -> dict[str, int]:
        from sqlalchemy import func, select
        from sqlalchemy.orm import Session

        from shared.models import Job, JobStatus

        # Finished: the soak's own submits, not a Batch API file's lines (a chaos soak's; accounted for apart).
        top = Job.parent_job_id.is_(None) & Job.file_batch_id.is_(None)
        with Session(self.engine) as session:
            rows = session.execute(select(Job.status, top, func.count()).group_by(Job.status, top)).all()
        counts = dict.fromkeys((JobStatus.QUEUED, JobStatus.RUNNING, *JobStatus.FINISHED), 0)
        for status, is_top, n in rows:
            if status not in JobStatus.FINISHED or is_top:
                counts[status] = counts.get(status, 0) + n
        return counts

    def close(self) -> None:
        self.engine.dispose()


class Sampler:
    """A thread that samples the processes' RSS, the queue and the submits every `every_s` (and once at the end of
    the warm-up), collecting the "finished" notices each second in between so none piles up in Redis."""

    def __init__(self, roots: dict[str, int], counts: QueueCounts, submitted: Callable[[], int],
                 announcements: Announcements, every_s: float, warmup_s: float):
        self.roots, self.counts, self.submitted, self.announcements = roots, counts, submitted, announcements
        self.every_s, self.warmup_s = every_s, warmup_s
        self.samples: list[dict[str, Any]] = []
        self.missed = 0  # samples skipped while the database was unreachable
        self.error: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-sampler", daemon=True)

    def start(self) -> Sampler:
        self.started = time.perf_counter()
        self._thread.start()
        return self

    def sample(self) -> None:
        labels = process_labels(self.roots)
        rss: dict[str, float] = {}
        cpu: dict[str, float] = {}
        for label, pid in labels.items():
            try:
                rss[label] = round(resident_bytes(pid) / 2**20, 2)
                cpu[label] = round(cpu_seconds(pid), 2)
            except (OSError, RuntimeError):
                rss.pop(label, None)  # it exited between the scan and the reads
        self.samples.append({"t_s": round(time.perf_counter() - self.started, 2), "rss_mib": rss,
                             "cpu_s": cpu, "pids": {label: labels[label] for label in rss},
                             "submitted": self.submitted(), **self.counts.read()})
        if len(self.samples) % max(1, round(60 / self.every_s)) == 1:  # about once a minute, for a long run
            last = self.samples[-1]
            log.info("%.1f min: %d accepted, %d succeeded, %d failed, %d queued; RSS MiB %s", last["t_s"] / 60,
                     last["submitted"], last["succeeded"], last["failed"], last["queued"],
                     ", ".join(f"{label} {mib:.1f}" for label, mib in rss.items()))

    def _run(self) -> None:
        tick, warmup_pending = 0.0, True
        try:
            while True:
                due = min(tick, self.warmup_s) if warmup_pending else tick
                while (left := due - (time.perf_counter() - self.started)) > 0:
                    if self._stop.wait(min(1.0, left)):
                        return
                    self.announcements.collect()
                try:
                    self.sample()
                except OperationalError as exc:  # the database away (a chaos soak's fault): this sample is skipped
                    self.missed += 1
                    log.warning("sample skipped: the database is unreachable (%s)", exc.__class__.__name__)
                warmup_pending = warmup_pending and due < self.warmup_s
                tick += self.every_s if due == tick else 0.0
        except Exception as exc:  # reported in the result; the run goes on without samples
            self.error = f"{exc.__class__.__name__}: {exc}"
            log.exception("the sampler stopped")

    def halt(self) -> None:
        self._stop.set()
        self._thread.join(30)

    def stop(self) -> list[dict[str, Any]]:
        """The last sample is taken here, after the drain."""
        self.halt()
        self.sample()
        return self.samples


# -- figures --------------------------------------------------------------------------------------------------

def growth_figures(samples: list[dict[str, Any]], label: str, warmup_s: float) -> dict[str, Any]:
    """A process's RSS from the end of the warm-up on: at its start and at the end, growth, the most it grew, and a
    least-squares slope, which a slow leak shows even when the end point is noisy."""
    points = [(s["t_s"], s["rss_mib"][label], s["pids"][label], s["cpu_s"][label]) for s in samples
              if label in s["rss_mib"]]
    after = [p for p in points if p[0] >= warmup_s]
    figures: dict[str, Any] = {"samples": len(points), "samples_after_warmup": len(after),
                               "pids": sorted({p[2] for p in points})}
    if len(after) < 2:
        return figures
    base, end, peak = after[0][1], after[-1][1], max(p[1] for p in after)
    slope = statistics.linear_regression([p[0] / 3600 for p in after], [p[1] for p in after]).slope
    # the model's child swings by a few percent from one batch to the next: medians of the first and the last
    # tenth after the warm-up judge the trend, not where one sample fell
    k = max(1, min(len(after) // 2, len(after) // 10 if len(after) >= 30 else 3))
    first, last = (statistics.median(p[1] for p in part) for part in (after[:k], after[-k:]))
    restarted = len({p[2] for p in after}) > 1
    return {**figures, "rss_start_mib": points[0][1], "rss_warmup_end_mib": base, "rss_end_mib": end,
            "rss_max_after_warmup_mib": peak, "growth_pct": round((end - base) / base * 100, 2),
            "max_growth_pct": round((peak - base) / base * 100, 2), "slope_mib_per_hour": round(slope, 2),
            "median_of": k, "rss_first_median_mib": first, "rss_last_median_mib": last,
            "growth_median_pct": round((last - first) / first * 100, 2),
            "restarted_after_warmup": restarted,
            # of one core, from the end of the warm-up on: how near the worker's child runs to its limit
            "cpu_share_after_warmup": None if restarted else round(
                (after[-1][3] - after[0][3]) / (after[-1][0] - after[0][0]), 3)}


def backlog_figures(samples: list[dict[str, Any]], warmup_s: float, submit_s: float, drain_s: float,
                    ) -> dict[str, Any]:
    """The queued count while submitting: a worker that falls behind shows a backlog that keeps rising, and over a
    long run a deficit of a few percent leaves more than `KEPT_UP_S` of work behind the last submit."""
    during = [s for s in samples if s["t_s"] <= submit_s + 1e-6]
    after = [s for s in during if s["t_s"] >= warmup_s]
    last = during[-1]["queued"] if during else None
    figures = {"queued_at_warmup_end": after[0]["queued"] if after else None, "queued_at_last_submit": last,
               "queued_max_after_warmup": max((s["queued"] for s in after), default=None),
               "queued_max": max((s["queued"] for s in samples), default=None),
               "drain_after_last_submit_s": drain_s, "kept_up_within_s": KEPT_UP_S, "kept_up": drain_s <= KEPT_UP_S}
    if len(after) >= 2:
        figures["slope_jobs_per_min"] = round(statistics.linear_regression(
            [s["t_s"] / 60 for s in after], [s["queued"] for s in after]).slope, 2)
    return figures


def figures(config: SoakConfig, submits: Submits, samples: list[dict[str, Any]], drain: dict[str, Any],
            wall_s: float) -> dict[str, Any]:
    labels = sorted({label for s in samples for label in s["rss_mib"]}, key=lambda x: (x.split("/")[0], x))
    memory = {label: growth_figures(samples, label, config.warmup_s) for label in labels}
    grown = [m["growth_median_pct"] for m in memory.values() if "growth_median_pct" in m]
    last = samples[-1] if samples else {}
    return {
        "jobs": {"submitted": submits.sent, "accepted": len(submits.ids), "succeeded": last.get("succeeded"),
                 "failed": last.get("failed"), "submit_errors": dict(submits.errors), "requests": submits.requests,
                 "batch_requests": submits.batch_requests,
                 "submit_s": round(submits.seconds, 2), "submit_max_lag_s": round(submits.max_lag_s, 3),
                 "api_p99_ms": _ms(percentile([ms for _, ms in submits.latencies], 99)),
                 "accepted_per_s": round(len(submits.ids) / submits.seconds, 2) if submits.seconds else None,
                 "finished_per_s": round((last.get("succeeded", 0) + last.get("failed", 0)) / wall_s, 2)
                 if wall_s else None},
        "exactly_once": drain["exactly_once"], "drain": drain,
        "backlog": backlog_figures(samples, config.warmup_s, submits.seconds, drain["seconds"]),
        "memory": memory,
        "targets": {"growth_pct_at_most": GROWTH_TARGET_PCT,
                    "memory_flat": bool(grown) and len(grown) == len(memory)
                    and max(grown) <= GROWTH_TARGET_PCT},
    }


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


# -- the run --------------------------------------------------------------------------------------------------

def require_fresh(database_url: str) -> None:
    """Rows from an earlier run would read as jobs stored but never submitted: the check needs an empty table, and
    says so before the service starts. A database not migrated yet holds no jobs."""
    from sqlalchemy import create_engine, func, select
    from sqlalchemy.exc import DBAPIError

    from shared.models import Job

    engine = create_engine(database_url)
    try:
        with engine.connect() as connection:
            stored = connection.scalar(select(func.count()).select_from(Job))
    except DBAPIError:
        return
    finally:
        engine.dispose()
    if stored:
        raise RuntimeError(f"the database already holds {stored} job(s): give the soak a fresh one")


def run_soak(config: SoakConfig) -> dict[str, Any]:
    settings = soak_settings(config.workdir / "service")
    result: dict[str, Any] = {"load_average": {"start": os.getloadavg()}}
    database_url = config.database_url or f"sqlite:///{config.workdir / 'service' / 'soak.db'}"
    require_fresh(database_url)
    service = Service(config.workdir / "service", settings, config.redis_url, database_url)
    service.processes.redis_persistent = config.chaos  # a restart "with its data" keeps it
    with service:
        processes = service.processes
        roots = {kind: processes.running[kind].pid for kind in ("api", "worker")}
        announcements = Announcements(processes.redis_url)
        counts, submits = QueueCounts(processes.database_url), Submits()
        streams = StreamWatch() if config.chaos else None
        batch_files = BatchFiles(config.workdir / "batch-files") if config.chaos else None

        def alive() -> None:
            if not config.chaos:  # under chaos a process is down between its kill and its start
                processes.check_alive("api")
                processes.check_alive("worker")

        sampler = Sampler(roots, counts, lambda: len(submits.ids), announcements, config.sample_every_s,
                          config.warmup_s).start()
        chaos = Chaos(processes, roots, config.seed, config.fault_every_s, sampler.started,
                      own_redis="redis" in processes.running,
                      api=httpx.Client(base_url=service.client.base_url, headers=service.client.headers),
                      ).start() if config.chaos else None
        try:
            log.info("submitting %.1f jobs/s for at most %.1f min or %d jobs on %s%s", config.rate, config.minutes,
                     config.jobs, make_kind(processes.database_url), ", faults at random" if chaos else "")
            asyncio.run(submit_open_loop(config, str(service.client.base_url).rstrip("/"), submits, alive,
                                         sampler.started, streams, batch_files))
            faults = chaos.stop() if chaos else []
            log.info("%d jobs accepted in %.0f s; waiting for the drain", len(submits.ids), submits.seconds)
            drain = check_drain(processes.database_url, processes.redis_url, submits.ids, config.drain_timeout_s,
                                alive=alive, announcements=announcements)
            samples = sampler.stop()
            wall_s = time.perf_counter() - sampler.started
        finally:
            if chaos:
                chaos.stop()
            sampler.halt()
            announcements.close()
            counts.close()
        if chaos:
            result["chaos"] = chaos_figures(config, service, faults, drain, submits, streams, announcements,
                                            batch_files.figures, chaos.cut_uploads_stored)
    result["load_average"]["end"] = os.getloadavg()
    return {"database": make_kind(processes.database_url), "wall_s": round(wall_s, 2),
            **figures(config, submits, samples, drain, wall_s),
            "sampler_error": sampler.error, "samples_missed": sampler.missed, "samples": samples, **result,
            "workload": {"adapters": ROLES, "new_tokens": NEW_TOKENS, "output": "text",
                         "batch_every": BATCH_EVERY, "batch_size": BATCH_SIZE},
            "config": {"minutes": config.minutes, "jobs": config.jobs, "rate": config.rate,
                       "sample_every_s": config.sample_every_s, "warmup_s": round(config.warmup_s, 2),
                       "concurrency": config.concurrency, "drain_timeout_s": config.drain_timeout_s,
                       "seed": config.seed, "workdir": str(config.workdir), "chaos": config.chaos,
                       "fault_every_s": list(config.fault_every_s)},
            "service_settings": {k: v for k, v in settings.items() if k != "KEVLAYA_BATCH__FILES_DIR"}}


# Under faults these are expected and judged otherwise: a job whose worker died runs again (matched to its fault
# below), its claim group never finishes, and "finished" notices published while Redis was away are lost (the
# row, not the notice, is the truth).
EXPECTED_UNDER_FAULTS = {"attempts_not_1", "in_no_finished_batch", "runs_minus_jobs", "announced_not_once"}


def chaos_figures(config: SoakConfig, service: Service, faults: list, drain: dict[str, Any], submits: Submits,
                  streams: StreamWatch, announcements: Announcements, files: dict[str, Any],
                  cut_uploads_stored: list[str]) -> dict[str, Any]:
    from sqlalchemy import select
    from sqlalchemy.orm import Session

    from shared.models import Job

    with Session(service.engine) as session:
        rows = session.execute(select(Job.attempts, Job.created_at, Job.started_at, Job.finished_at)).all()
    from shared.settings import Settings

    reliability = Settings().reliability  # the service's: the soak sets none of these
    by_fault = fault_figures(faults, rows, reliability.lease_seconds, reliability.sweep_interval_s)
    windows = [(f.start_s, f.end_s + reliability.sweep_interval_s) for f in faults]
    quiet = [ms for t, ms in submits.latencies if not any(a <= t <= b for a, b in windows)]
    stream = streams.figures()
    lost = {k: v for k, v in drain["problems"].items() if k not in EXPECTED_UNDER_FAULTS}
    return {
        "faults": [f.__dict__ for f in faults], "by_fault": by_fault, "streams": stream, "batch_files": files,
        "submits": {"resent": submits.resent, "given_up": submits.given_up},
        "notice_outages": announcements.outages,
        "api_p99_ms_outside_faults": _ms(percentile(quiet, 99)),
        "targets": {
            "nothing_lost_or_twice": drain["pending"] == 0 and not any(lost.values()) and submits.given_up == 0,
            "no_rerun_outside_a_fault": by_fault["run_more_than_once_outside_a_fault"] == 0,
            "streams_whole": stream["missing"] == stream["repeated"] == stream["unfinished"] == 0,
            "batch_files_whole": files["files"] > 0 and files["not_created"] == files["missing"]
            == files["more_than_once"] == files["errors"] == 0 and files["lines_once"] == files["lines"],
            "faults_applied": bool(faults) and not any(f.error for f in faults),
            "cut_uploads_stored_nothing": not cut_uploads_stored,
        },
        # how soon, not whether: a loaded machine (the suite beside it) can miss it with nothing wrong
        "timing_targets": {
            "jobs_of_each_fault_within_lease_and_sweep": by_fault["faults_whose_jobs_finished_late"] == 0,
        },
    }


# -- the report -----------------------------------------------------------------------------------------------

def table(result: dict[str, Any]) -> str:
    jobs, backlog, drain = result["jobs"], result["backlog"], result["drain"]
    config = result["config"]
    lines = [
        f"soak on {result['database']}: {jobs['accepted']} jobs accepted at {config['rate']}/s over "
        f"{jobs['submit_s'] / 60:.1f} min, warm-up {config['warmup_s'] / 60:.1f} min; {result['wall_s']:.0f} s in all",
        f"jobs: {jobs['succeeded']} succeeded, {jobs['failed']} failed, {sum(jobs['submit_errors'].values())} "
        f"submits refused; {jobs['finished_per_s']} jobs/s; drain after the last submit {drain['seconds']} s",
        f"exactly once: {'yes' if result['exactly_once'] else 'NO'} {drain['problems']}",
        f"backlog (queued): {backlog['queued_at_warmup_end']} at the end of the warm-up, "
        f"{backlog['queued_at_last_submit']} at the last submit, at most {backlog['queued_max_after_warmup']} after "
        f"the warm-up, slope {backlog.get('slope_jobs_per_min', '—')} jobs/min; kept up (all done within "
        f"{KEPT_UP_S:g} s of the last submit): {'yes' if backlog['kept_up'] else 'NO'}",
        "RSS MiB after the warm-up: at its end -> at the end, growth, most growth; medians of the first and the last "
        "tenth, growth between them; slope MiB/h; CPU (of a core)",
    ]
    for label, m in result["memory"].items():
        if "growth_pct" not in m:
            lines.append(f"  {label:<24} too few samples after the warm-up ({m['samples_after_warmup']})")
            continue
        lines.append(f"  {label:<24} {m['rss_warmup_end_mib']:>8.1f} -> {m['rss_end_mib']:>8.1f}  "
                     f"{m['growth_pct']:>+6.2f} %  {m['max_growth_pct']:>+6.2f} %;  {m['rss_first_median_mib']:>8.1f} -> "
                     f"{m['rss_last_median_mib']:>8.1f}  {m['growth_median_pct']:>+6.2f} %;  "
                     f"{m['slope_mib_per_hour']:>+8.2f}"
                     + ("  (restarted)" if m["restarted_after_warmup"] else f"  {m['cpu_share_after_warmup']:>5.0%}"))
    lines.append(f"memory flat (growth between the medians <= {GROWTH_TARGET_PCT:g} % for every process): "
                 f"{'yes' if result['targets']['memory_flat'] else 'NO'}")
    if "chaos" in result:
        lines += chaos_table(result["chaos"])
    return "\n".join(lines)


def chaos_table(chaos: dict[str, Any]) -> list[str]:
    by_fault, streams, submits = chaos["by_fault"], chaos["streams"], chaos["submits"]
    kinds = Counter(f["kind"] for f in chaos["faults"])
    lines = [f"faults: {len(chaos['faults'])} ({', '.join(f'{k} {n}' for k, n in sorted(kinds.items()))}); "
             f"submits resent {submits['resent']}, given up {submits['given_up']}"]
    for fault, applied in zip(by_fault["faults"], chaos["faults"]):
        last, again = fault["in_flight_finished_within_s"], fault["first_finish_after_end_s"]
        lines.append(f"  {fault['start_s']:>7.1f} s {fault['kind']:<20} lasted {fault['lasted_s']:>5.1f} s"
                     f"{' (one of two at once)' if 'two at once' in applied['detail'] else ''}; "
                     f"{fault['in_flight']} in flight" + (f", the last finished {last} s after its start" if last
                                                          else "")
                     + (f"; jobs finished again {again} s after its end" if again is not None else "")
                     + (f"; NOT APPLIED: {applied['error']}" if applied["error"] else ""))
    lines.append(f"run more than once: {by_fault['run_more_than_once']} (outside a fault: "
                 f"{by_fault['run_more_than_once_outside_a_fault']}); streams followed {streams['followed']}: "
                 f"{streams['matched']} matched, {streams['resynced']} resynced, {streams['missing']} missing, "
                 f"{streams['repeated']} repeated, {streams['unfinished']} unfinished, {streams['reconnects']} "
                 f"reconnects; API p99 outside faults {chaos['api_p99_ms_outside_faults']} ms")
    files = chaos["batch_files"]
    lines.append(f"Batch API files: {files['files']} ({files['uploads_resent']} uploads and {files['creates_resent']} "
                 f"creates sent again), {files['completed']} completed; lines {files['lines_once']} of "
                 f"{files['lines']} once, {files['missing']} missing, {files['more_than_once']} more than once, "
                 f"{files['errors']} errors")
    lines.append("chaos: " + ", ".join(f"{name.replace('_', ' ')} {'yes' if ok else 'NO'}"
                                       for name, ok in {**chaos["targets"], **chaos["timing_targets"]}.items()))
    return lines


def plot(result: dict[str, Any], path: Path) -> None:
    """One panel per process (its RSS, the warm-up shaded, the band of the growth target around its value at the end
    of the warm-up) and the backlog below; the last submit is the dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples, config, memory = result["samples"], result["config"], result["memory"]
    fig, axes = plt.subplots(len(memory) + 1, 1, figsize=(11, 2.1 * (len(memory) + 1) + 0.6), sharex=True)
    if "chaos" in result:  # re-runs and lost notices are expected there: the chaos verdict is the one that counts
        chaos = result["chaos"]
        verdict = (f"{len(chaos['faults'])} faults, every chaos target met: "
                   f"{'yes' if all(chaos['targets'].values()) else 'NO'}")
    else:
        verdict = f"exactly once: {'yes' if result['exactly_once'] else 'NO'}"
    fig.suptitle(f"kevlaya soak on {result['database']}: {result['jobs']['accepted']} jobs at {config['rate']}/s, "
                 f"{verdict}")
    for panel, (label, m) in zip(axes, memory.items()):
        points = [(s["t_s"] / 60, s["rss_mib"][label]) for s in samples if label in s["rss_mib"]]
        panel.plot(*zip(*points), marker=".", markersize=3, color="#3366cc")
        title = label
        if "growth_pct" in m:
            base = m["rss_warmup_end_mib"]
            panel.axhspan(base * (1 - GROWTH_TARGET_PCT / 100), base * (1 + GROWTH_TARGET_PCT / 100),
                          color="#33aa33", alpha=0.08)
            title += (f": {base:.1f} -> {m['rss_end_mib']:.1f} MiB, {m['growth_pct']:+.2f} % "
                      f"(at most {m['max_growth_pct']:+.2f} %; medians {m['growth_median_pct']:+.2f} %), "
                      f"{m['slope_mib_per_hour']:+.1f} MiB/h")
        panel.set_title(title, fontsize="small", loc="left")
        panel.set_ylabel("RSS, MiB")
    backlog = axes[-1]
    minutes = [s["t_s"] / 60 for s in samples]
    backlog.plot(minutes, [s["queued"] for s in samples], label="queued")
    backlog.plot(minutes, [s["running"] for s in samples], label="running")
    backlog.set_title("backlog", fontsize="small", loc="left")
    backlog.set_ylabel("jobs")
    backlog.set_xlabel("minutes since the first submit (grey: warm-up; red: a fault; dashed: the last submit; green "
                       f"band: ±{GROWTH_TARGET_PCT:g} % of the RSS at the end of the warm-up)")
    backlog.legend(fontsize="small")
    finished = [s["succeeded"] + s["failed"] for s in samples]
    rate = backlog.twinx()
    rate.plot(minutes[1:], [(b - a) / max(1e-9, (t1 - t0) * 60) for a, b, t0, t1
                            in zip(finished, finished[1:], minutes, minutes[1:])], color="#aa3377", linewidth=0.8)
    rate.set_ylabel("finished/s", color="#aa3377")
    for panel in axes:
        for fault in result.get("chaos", {}).get("faults", []):
            panel.axvspan(fault["start_s"] / 60, (fault["end_s"] or fault["start_s"]) / 60 + 0.05, color="#dd3333",
                          alpha=0.25)
            if panel is axes[0]:
                panel.annotate(fault["kind"], (fault["start_s"] / 60, 1), xycoords=("data", "axes fraction"),
                               fontsize="x-small", rotation=90, va="top", color="#aa0000")
        panel.axvspan(0, config["warmup_s"] / 60, color="#dddddd")
        panel.axvline(result["jobs"]["submit_s"] / 60, color="#888888", linestyle="--")
        panel.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
