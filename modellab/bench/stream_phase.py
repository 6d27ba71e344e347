"""The benchmark's streaming phase: the same Kev jobs with no client and with one Server-Sent Events client per job
following `GET /v1/jobs/{id}/events`, alternately, so what streaming costs the worker (jobs/s, decode step) is
measured beside the delay a client sees, in one run on one model."""

from __future__ import annotations

import logging
import os
import signal
import sqlite3
import statistics
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from typing import Any

import httpx
import redis

from modellab.bench.load import percentile
from modellab.bench.service import Service
from modellab.bench.sse import SseParser
from modellab.bench.stream_load import ClientRun
from modellab.bench.workload import BenchJob
from shared.job_stream import FIRST_TOKEN_AT, stream_key

log = logging.getLogger("kevlaya.bench")

CONNECT_TIMEOUT_S = 60.0  # for every client's first event
SETTLE_S = 0.2  # then, for the clients' followers to join the API's stream reader
CLIENT_END_S = 30.0  # for the clients' `done` once every row is stored
PAUSE_TRIES = 100

FIRST_DELTA_METHOD = (
    "per streamed job: the client's time.time() when its first `delta` event was parsed, minus the worker's "
    "wall-clock time of the job's first token (the decoder's perf_counter instant of it, set once the token is "
    "chosen on the host after the prefill, put on the wall clock by the token publisher and stored beside the "
    "first delta's data in Redis); same host, same clock. It holds the publisher's wait and its write, Redis, the "
    "API's reader and its SSE write, and the client's read and parse; a first token that makes no whole character "
    "counts until one does")


def stream_pairs(service: Service, kev_jobs: list[BenchJob], rounds: int = 2,
                 output: str = "decision") -> dict[str, Any]:
    """`kev_jobs` run `rounds` times with no client and `rounds` times with a client per job, alternately (so a
    warm-up or a drift favours neither), each run stored while the worker is paused and timed from when it goes on.
    The jobs are under the decision grammar by default: random weights' free text on a real shape's vocabulary is
    mostly tokens the byte tokenizer has no bytes for, so its streams would carry almost nothing; the grammar
    allows only real bytes, so every step writes text, as a trained model's would."""
    bodies = [job.body(output) for job in kev_jobs]
    runs: dict[str, list[dict[str, Any]]] = {"free": [], "streamed": []}
    for _ in range(rounds):
        runs["free"].append(_measured(service, lambda: service.submit(bodies)))
        runs["streamed"].append(_streamed_run(service, bodies))
        log.info("streaming: %s", {mode: {key: done[-1][key] for key in ("jobs_per_s", "step_ms")}
                                   for mode, done in runs.items()})
    mean = {mode: {key: statistics.fmean(run[key] for run in done) for key in ("jobs_per_s", "step_ms")}
            for mode, done in runs.items()}
    delays = [ms for run in runs["streamed"] for ms in run["first_delta_ms"]]
    present = [ms for ms in delays if ms is not None]
    # The stream's own delay: first deltas that carry the first token alone. The others waited for a token that
    # made a whole character, i.e. for more steps (and a row's second token may wait behind the prefills of the
    # rest of its claim group), which is not the stream's time.
    alone = [ms for run in runs["streamed"] for ms, tokens in zip(run["first_delta_ms"], run["first_delta_tokens"])
             if ms is not None and tokens == 1]
    problems: Counter[str] = Counter()
    for run in runs["streamed"]:
        problems.update(run["problems"])
    return {
        "jobs": len(kev_jobs), "output": output, "rounds": rounds, "free": mean["free"],
        "streamed": mean["streamed"],
        "jobs_per_s_vs_free": mean["streamed"]["jobs_per_s"] / mean["free"]["jobs_per_s"],
        "step_ms_vs_free": mean["streamed"]["step_ms"] / mean["free"]["step_ms"],
        "first_delta_ms": {"p50": percentile(present, 50), "p95": percentile(present, 95),
                           "max": max(present, default=None), "samples": len(present),
                           "missing": len(delays) - len(present)},
        "first_delta_ms_first_token_alone": {"p50": percentile(alone, 50), "p95": percentile(alone, 95),
                                             "max": max(alone, default=None), "samples": len(alone)},
        "mismatches": sum(run["mismatches"] for run in runs["streamed"]), "problems": dict(problems),
        "first_delta_method": FIRST_DELTA_METHOD, "runs": runs,
    }


def _measured(service: Service, start: Callable[[], list[str]]) -> dict[str, float]:
    """The jobs `start` submits (with the worker paused), run: jobs/s from the moment the worker goes on to the
    last finish (the rows' finish times), and the worker's mean decode step meanwhile."""
    from modellab.bench.run import engine_phases  # run.py imports this module

    before = service.engine_phases()  # read while the worker runs: a paused one answers no /metrics
    with worker_paused(service):
        ids = start()
    resumed = time.time()
    rows = service.wait(ids)
    step_ms = engine_phases(before, service.engine_phases())["step"]["mean_ms"]
    return {"jobs_per_s": len(rows) / (max(_epoch(r.finished_at) for r in rows) - resumed), "step_ms": step_ms}


def _streamed_run(service: Service, bodies: list[dict[str, Any]]) -> dict[str, Any]:
    followed: list[tuple[ClientRun, threading.Thread]] = []

    def start() -> list[str]:
        ids = service.submit(bodies)
        followed.extend(_connect(http, ids))
        return ids

    with httpx.Client(base_url=service.client.base_url, headers=service.client.headers,
                      timeout=httpx.Timeout(120, connect=10), limits=httpx.Limits(max_connections=len(bodies))) as http:
        figures = _measured(service, start)
        deadline = time.monotonic() + CLIENT_END_S
        for _seen, thread in followed:
            thread.join(max(0.0, deadline - time.monotonic()))
    return {**figures, **_client_figures(service, [seen for seen, _thread in followed])}


def _connect(http: httpx.Client, ids: list[str]) -> list[tuple[ClientRun, threading.Thread]]:
    """A client per job, each answered (its first event) and given SETTLE_S to join before this returns."""
    clients = []
    for job_id in ids:
        seen, answered = ClientRun(job_id), threading.Event()
        thread = threading.Thread(target=_follow, args=(http, seen, answered), name="sse-client", daemon=True)
        thread.start()
        clients.append((seen, thread, answered))
    deadline = time.monotonic() + CONNECT_TIMEOUT_S
    for seen, _thread, answered in clients:
        if not answered.wait(max(0.0, deadline - time.monotonic())):
            raise RuntimeError(f"the client of job {seen.job_id} had no event after {CONNECT_TIMEOUT_S:.0f} s")
    time.sleep(SETTLE_S)
    return [(seen, thread) for seen, thread, _answered in clients]


def _follow(http: httpx.Client, seen: ClientRun, answered: threading.Event) -> None:
    """One client: the job's events until `done`. `answered` is set at its first event, or when it fails."""
    try:
        with http.stream("GET", f"/v1/jobs/{seen.job_id}/events") as response:
            if response.status_code != 200:
                seen.error = f"HTTP {response.status_code}"
                return
            parser = SseParser()
            for line in response.iter_lines():
                if (event := parser.feed(line)) is not None:
                    answered.set()
                    if seen.add(event):
                        return
    except Exception as exc:  # reported per client, never lost
        seen.error = f"{exc.__class__.__name__}: {exc}"
    finally:
        answered.set()


def _client_figures(service: Service, seen: list[ClientRun]) -> dict[str, Any]:
    """What the clients saw against the stored jobs: their problems (a text that is not the stored one among
    them), and each one's first-delta delay."""
    problems: Counter[str] = Counter()
    mismatches = 0
    for client in seen:
        found = client.problems(service.client.get(f"/v1/jobs/{client.job_id}").json())
        if not client.events or client.events[0].get("data", {}).get("status") != "queued":
            found.append("connected after its job was claimed")
        problems.update(found)
        mismatches += bool(found)
    store = redis.Redis.from_url(service.processes.redis_url)
    try:
        delays = [_first_delta_ms(store, client) for client in seen]
    finally:
        store.close()
    return {"first_delta_ms": delays, "mismatches": mismatches, "problems": dict(problems),
            "first_delta_tokens": [next((e["data"]["tokens"] for e in c.events if e["event"] == "delta"), None)
                                   for c in seen]}


def _first_delta_ms(store: redis.Redis, client: ClientRun) -> float | None:
    """FIRST_DELTA_METHOD for one client; None without a delta, or without the worker's instant in its entry."""
    first = next((e for e in client.events if e["event"] == "delta"), None)
    if first is None or client.first_delta_at is None:
        return None
    entries = store.xrange(stream_key(client.job_id), min=first["id"], max=first["id"])
    made = entries[0][1].get(FIRST_TOKEN_AT.encode()) if entries else None
    return None if made is None else (client.first_delta_at - float(made)) * 1000


@contextmanager
def worker_paused(service: Service) -> Iterator[None]:
    """The worker's processes stopped (SIGSTOP, as `kevlaya stream-load` does), so no job is claimed before its
    client follows it. Stopped only where they hold no write lock on the database: a stopped writer would hold
    every submit."""
    group = service.processes.running["worker"].pid
    for _ in range(PAUSE_TRIES):
        os.killpg(group, signal.SIGSTOP)
        time.sleep(0.01)  # every thread of it stopped before the lock is looked at
        if _can_write(service.engine.url.database):
            break
        os.killpg(group, signal.SIGCONT)
        time.sleep(0.05)
    else:
        raise RuntimeError(f"the worker held the database's write lock at each of {PAUSE_TRIES} tries")
    try:
        yield
    finally:
        os.killpg(group, signal.SIGCONT)


def _can_write(database: str) -> bool:
    connection = sqlite3.connect(database, timeout=0.05, isolation_level=None)
    try:
        connection.execute("BEGIN IMMEDIATE")
        connection.execute("ROLLBACK")
        return True
    except sqlite3.OperationalError:  # locked
        return False
    finally:
        connection.close()


def _epoch(moment: datetime) -> float:
    """A row's time (SQLite gives it back without its zone, UTC) as time.time() counts."""
    return (moment if moment.tzinfo else moment.replace(tzinfo=timezone.utc)).timestamp()
