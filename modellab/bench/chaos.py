"""`kevlaya soak --chaos`: the soak's steady load while faults arrive at random.

A seeded schedule deals a fault every `--fault-every` seconds (30 to 90 by default) from a shuffled deck of: the
worker's main
process SIGKILLed (its pool child dies with it) and started again, the pool child alone SIGKILLed (Celery forks
another, which loads the model again), Redis restarted with its data and without it, the database unreachable for
5 to 20 s, the API (and its job writer) SIGKILLed and started again, the API SIGKILLed halfway through a Batch API
file's upload (after its restart no file may have come of the cut upload), and two of these at once. Each fault is logged
with its start and end. Meanwhile clients do what a client of a service that can fail does: a submit that got no
answer is sent again with the same idempotency keys, and a stream that broke is resumed from its last event id.
A sample of the jobs is followed by such stream clients, each checking that it saw no delta twice and none
missing unless told `resync`.

The verdict (docs/RELIABILITY.md): every accepted job stored once and finished with one result; a job run twice
only where a fault took its worker or database while it ran; every stream client's text the stored one; and, for
each fault, how long until the service finished jobs again.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import random
import shutil
import signal
import sqlite3
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import aiohttp
import httpx
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from modellab.bench.service import Processes
from shared.redis_server import start_redis_server

log = logging.getLogger("kevlaya.chaos")

SINGLE_FAULTS = ("worker_kill", "child_kill", "redis_restart", "redis_restart_empty", "database_outage", "api_kill",
                 "api_kill_mid_upload")
FAULTS = (*SINGLE_FAULTS, "two_at_once")
# Faults after which a running job may rightly run again: its worker died, or could not write its end.
RERUN_FAULTS = {"worker_kill", "child_kill", "database_outage"}
OUTAGE_S = (5.0, 20.0)
FOLLOW_EVERY = 20  # one accepted single job in this many is followed by a stream client
FOLLOWERS = 8  # stream clients at once at most
FOLLOWED_NEW_TOKENS = 48  # a followed job writes this many tokens, so streams are open when faults come
BATCH_FILE_EVERY_S = 45.0  # a Batch API file uploaded and its batch created this often
BATCH_FILE_LINES = 20
CUT_UPLOAD_LINES = 2000  # a Batch API file the API is killed halfway through (about 0.5 MB)


class DatabaseOutage:
    """The database unreachable for a while. PostgreSQL: new connections refused and open ones terminated, as
    when the server restarts or fails over. SQLite has no server to lose; its real counterpart is another
    process holding the write lock (a backup, a long migration, `sqlite3` at a prompt): writers wait on it."""

    def __init__(self, database_url: str, admin_url: str | None):
        self.url = make_url(database_url)
        self.admin = create_engine(admin_url, isolation_level="AUTOCOMMIT") if admin_url else None
        self.holder: sqlite3.Connection | None = None

    def begin(self) -> None:
        if self.admin is None:
            self.holder = sqlite3.connect(self.url.database, isolation_level=None, timeout=30)
            self.holder.execute("BEGIN EXCLUSIVE")
            return
        name = self.url.database
        with self.admin.connect() as connection:
            connection.execute(text(f'ALTER DATABASE "{name}" WITH ALLOW_CONNECTIONS false'))
            connection.execute(text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                                    "WHERE datname = :name AND pid <> pg_backend_pid()"), {"name": name})

    def end(self) -> None:
        if self.admin is None:
            self.holder.execute("ROLLBACK")
            self.holder.close()
            return
        with self.admin.connect() as connection:
            connection.execute(text(f'ALTER DATABASE "{self.url.database}" WITH ALLOW_CONNECTIONS true'))
        self.admin.dispose()


def admin_url(database_url: str) -> str | None:
    """The same PostgreSQL server's `postgres` database, from which the soak's own can be closed; None on SQLite."""
    url = make_url(database_url)
    return None if url.get_backend_name() == "sqlite" else url.set(database="postgres").render_as_string(False)


@dataclass
class Fault:
    kind: str
    start_s: float  # seconds since the soak's first submit
    at: str  # the wall clock at its start (UTC), to compare with the rows' times
    end_s: float | None = None
    detail: str = ""
    error: str | None = None


class Chaos:
    """A thread that applies faults to the soak's processes on a seeded schedule. `roots` (kind -> pid) is the
    sampler's: a restarted process is sampled under its new pid."""

    def __init__(self, processes: Processes, roots: dict[str, int], seed: int, every_s: tuple[float, float],
                 started: float, own_redis: bool, api: httpx.Client):
        self.processes, self.roots, self.every_s, self.started = processes, roots, every_s, started
        self.api = api  # the service's address and key, for the cut upload
        self.cut_uploads_stored: list[str] = []  # cut uploads that became a file anyway: none may
        self.rng = random.Random(seed)
        self.kinds = [k for k in SINGLE_FAULTS if own_redis or not k.startswith("redis")]
        self.faults: list[Fault] = []
        self._lock = threading.Lock()  # two faults at once touch `processes.running`
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-chaos", daemon=True)

    def start(self) -> Chaos:
        self._thread.start()
        return self

    def stop(self) -> list[Fault]:
        self._stop.set()
        self._thread.join(120)
        self.api.close()
        return self.faults

    def _run(self) -> None:
        deck: list[str] = []
        while not self._stop.wait(self.rng.uniform(*self.every_s)):
            if not deck:  # dealt from a shuffled deck: every kind comes once before any comes again
                deck = self.rng.sample([*self.kinds, "two_at_once"], len(self.kinds) + 1)
            kind = deck.pop()
            if kind == "two_at_once":
                # the cut upload kills the API itself: not beside another kill of it
                pair = self.rng.sample([k for k in self.kinds if k != "api_kill_mid_upload"], 2)
                threads = [threading.Thread(target=self.apply, args=(k, "one of two at once")) for k in pair]
                for thread in threads:
                    thread.start()
                for thread in threads:
                    thread.join()
            else:
                self.apply(kind)

    def apply(self, kind: str, detail: str = "") -> None:
        fault = Fault(kind, round(time.perf_counter() - self.started, 2), datetime.now(timezone.utc).isoformat(),
                      detail=detail)
        with self._lock:
            self.faults.append(fault)
        log.warning("fault at %.1f s: %s %s", fault.start_s, kind, detail)
        try:
            done = getattr(self, kind)()
            fault.detail = "; ".join(x for x in (detail, done) if x)
        except Exception as exc:  # noqa: BLE001 - a fault that could not be applied is reported, not fatal
            fault.error = f"{exc.__class__.__name__}: {exc}"
            log.exception("fault %s could not be applied", kind)
        fault.end_s = round(time.perf_counter() - self.started, 2)
        log.warning("fault %s over at %.1f s", kind, fault.end_s)

    # -- the faults ---------------------------------------------------------------------------------------------

    def _restart(self, kind: str) -> None:
        with self._lock:
            self.processes.start(kind)
            self.roots[kind] = self.processes.running[kind].pid

    def worker_kill(self) -> str:
        worker = self.processes.running["worker"]
        os.kill(worker.pid, signal.SIGKILL)  # the main process only: its pool child dies with it (pdeathsig)
        worker.wait(30)
        self._restart("worker")
        return f"pid {worker.pid}"

    def child_kill(self) -> str:
        main = self.processes.running["worker"].pid
        children = Path(f"/proc/{main}/task/{main}/children").read_text().split()
        if not children:
            return "no pool child at that moment"
        os.kill(int(children[0]), signal.SIGKILL)
        return f"pid {children[0]}"

    def api_kill(self) -> str:
        api = self.processes.running["api"]
        os.killpg(api.pid, signal.SIGKILL)  # the API and its job writer
        api.wait(30)
        self._restart("api")
        return f"pid {api.pid}"

    def api_kill_mid_upload(self) -> str:
        """The API SIGKILLed while a Batch API file's upload is half received. Uploads are written under the files
        directory's tmp/ and the row committed only once the file is whole (api/files/store.py), so no file may come
        of it: after the restart none is listed under the cut upload's name."""
        from modellab.bench.batch_load import write_batch_file

        name = f"cut-upload-{len(self.faults)}.jsonl"
        path = self.processes.workdir / name
        write_batch_file(path, CUT_UPLOAD_LINES, ("laya", "kev"), (4, 8), len(self.faults))
        content = path.read_bytes()
        boundary = "kevlaya-chaos-cut-upload"
        head = (f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n--{boundary}\r\n'
                f'Content-Disposition: form-data; name="file"; filename="{name}"\r\n'
                "Content-Type: application/jsonl\r\n\r\n").encode()
        halfway, killed = threading.Event(), threading.Event()

        def body() -> Iterator[bytes]:
            yield head + content[:len(content) // 2]
            halfway.set()
            killed.wait(60)  # the rest is never sent to the API that read the first half
            yield content[len(content) // 2:] + f"\r\n--{boundary}--\r\n".encode()

        def send() -> None:
            with contextlib.suppress(httpx.HTTPError):
                self.api.post("/v1/files", content=body(), timeout=90,
                              headers={"Content-Type": f"multipart/form-data; boundary={boundary}"})

        sender = threading.Thread(target=send, name="cut-upload", daemon=True)
        sender.start()
        if not halfway.wait(30):
            killed.set()
            return "the upload did not start"
        time.sleep(0.5)  # the API reads the first half
        try:
            detail = self.api_kill()
        finally:
            killed.set()
        sender.join(30)
        listed = None
        for _ in range(120):  # the restarted API answers within a minute
            with contextlib.suppress(httpx.HTTPError, ValueError):
                answer = self.api.get("/v1/files", params={"purpose": "batch"}, timeout=10)
                if answer.status_code == 200:
                    listed = answer.json()["data"]
                    break
            time.sleep(0.5)
        if listed is None:
            raise RuntimeError("the API did not list its files after its restart")
        if any(f["filename"] == name for f in listed):
            self.cut_uploads_stored.append(name)
            return f"{detail}; the cut upload became a file"
        return f"{detail}; the cut upload left no file"

    def _redis(self, keep_data: bool) -> str:
        server = self.processes.running["redis"]
        data_dir = self.processes.workdir / "redis"
        if keep_data:
            server.terminate()  # SHUTDOWN: the append-only file is flushed
        else:
            server.kill()
        server.wait(30)
        if not keep_data:
            shutil.rmtree(data_dir, ignore_errors=True)
        down_s = self.rng.uniform(1.0, 5.0)
        time.sleep(down_s)
        port = int(self.processes.redis_url.rsplit(":", 1)[1].split("/")[0])
        with self._lock:
            self.processes.running["redis"] = start_redis_server(port, data_dir, persistent=True)
        return f"down {down_s:.1f} s"

    def redis_restart(self) -> str:
        return self._redis(keep_data=True)

    def redis_restart_empty(self) -> str:
        return self._redis(keep_data=False)

    def database_outage(self) -> str:
        outage = DatabaseOutage(self.processes.database_url, admin_url(self.processes.database_url))
        seconds = self.rng.uniform(*OUTAGE_S)
        outage.begin()
        try:
            time.sleep(seconds)
        finally:
            outage.end()
        return f"{seconds:.1f} s"


# -- stream clients -------------------------------------------------------------------------------------------

@dataclass
class StreamWatch:
    """What the stream clients saw: each followed job's stream checked against its stored text."""

    followed: int = 0
    matched: int = 0  # the text built from the events is the stored one
    resynced: int = 0  # told `resync` at least once (their text then set from the job)
    reconnects: int = 0
    repeated: int = 0  # an event id seen twice
    missing: int = 0  # the text built is not the stored one, and no `resync` said so
    unfinished: int = 0  # no `done` within the time given
    _slots: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(FOLLOWERS))

    def figures(self) -> dict[str, int]:
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}


async def sse_events(response: aiohttp.ClientResponse) -> AsyncIterator[dict[str, str]]:
    event: dict[str, str] = {}
    async for raw in response.content:
        line = raw.decode().rstrip("\r\n")
        if not line:
            if event:
                yield event
            event = {}
        elif not line.startswith(":"):
            name, _, value = line.partition(":")
            event[name] = value.removeprefix(" ")


async def follow(client: aiohttp.ClientSession, job_id: str, watch: StreamWatch, timeout_s: float = 900) -> None:
    """Follow one job's events as docs/api.md tells a client to: deltas appended, `running` restarting the text,
    `resync` setting it; a broken connection resumed with Last-Event-ID."""
    async with watch._slots:
        watch.followed += 1
        built, last_id, seen, resynced, repeated = "", None, set(), False, False
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            headers = {"Last-Event-ID": last_id} if last_id else {}
            # a stream that broke (the API killed, a socket dropped) or ended without `done`: resumed below
            with contextlib.suppress(aiohttp.ClientError, TimeoutError, ConnectionError):
                async with client.get(f"/v1/jobs/{job_id}/events", headers=headers,
                                      timeout=aiohttp.ClientTimeout(total=None, sock_read=120)) as response:
                    if response.status != 200:
                        raise aiohttp.ClientResponseError(response.request_info, (), status=response.status)
                    async for event in sse_events(response):
                        if "id" in event:
                            repeated = repeated or event["id"] in seen
                            seen.add(event["id"])
                            last_id = event["id"]
                        kind, data = event.get("event"), json.loads(event.get("data") or "null")
                        if kind == "status" and data.get("status") == "running":
                            built = ""
                        elif kind == "delta":
                            built += data["text"]
                        elif kind == "resync":
                            built, resynced = (data["job"].get("result") or {}).get("text") or "", True
                        elif kind == "done":
                            stored = (data.get("result") or {}).get("text") or ""
                            if last_id is None and not built:  # a new client of an ended job: `done` is all of it
                                built = stored
                            watch.matched += built == stored
                            watch.missing += built != stored and not resynced
                            watch.resynced += resynced
                            watch.repeated += repeated
                            return
            watch.reconnects += 1
            await asyncio.sleep(1.0)
        watch.unfinished += 1


# -- Batch API files -----------------------------------------------------------------------------------------

@dataclass
class BatchFiles:
    """Batch API files sent through the faults, as a careful client sends them: an upload that got no answer is
    sent again; a batch whose creation got no answer is looked for before it is created again (the Batch API has
    no idempotency key). At the end every batch's output is accounted for line by line."""

    workdir: Path
    uploads_resent: int = 0
    creates_resent: int = 0
    batches: dict[str, list[str]] = field(default_factory=dict)  # batch id -> the custom ids of its lines
    not_created: int = 0
    figures: dict[str, Any] = field(default_factory=dict)  # account()'s, once the run is over

    async def send(self, client: aiohttp.ClientSession, n: int, seed: int, deadline_s: float = 300) -> None:
        from modellab.bench.batch_load import write_batch_file

        path = self.workdir / f"batch-file-{n}.jsonl"
        custom_ids = write_batch_file(path, BATCH_FILE_LINES, ("laya", "kev"), (4, 8), seed + n)
        deadline = time.monotonic() + deadline_s
        file_id = None
        while file_id is None and time.monotonic() < deadline:
            form = aiohttp.FormData()
            form.add_field("purpose", "batch")
            form.add_field("file", path.read_bytes(), filename=path.name, content_type="application/jsonl")
            file_id = await _answer(client.post("/v1/files", data=form), "id")
            if file_id is None:
                self.uploads_resent += 1
                await asyncio.sleep(1.0)
        body = {"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
        while file_id is not None and time.monotonic() < deadline:
            if batch_id := await _answer(client.post("/v1/batches", json=body), "id"):
                self.batches[batch_id] = custom_ids
                return
            await asyncio.sleep(1.0)
            listed = await _answer(client.get("/v1/batches", params={"limit": "100"}), "data") or []
            if found := [b["id"] for b in listed if b["input_file_id"] == file_id]:
                self.batches[found[0]] = custom_ids
                return
            self.creates_resent += 1
        self.not_created += 1

    async def account(self, client: aiohttp.ClientSession, timeout_s: float = 600) -> dict[str, Any]:
        """Each batch completed, each of its lines in its output exactly once and answered."""
        figures = {"files": len(self.batches) + self.not_created, "not_created": self.not_created,
                   "uploads_resent": self.uploads_resent, "creates_resent": self.creates_resent,
                   "completed": 0, "lines": 0, "lines_once": 0, "missing": 0, "more_than_once": 0, "errors": 0}
        deadline = time.monotonic() + timeout_s
        for batch_id, custom_ids in self.batches.items():
            figures["lines"] += len(custom_ids)
            batch = None
            while time.monotonic() < deadline:
                batch = await _answer(client.get(f"/v1/batches/{batch_id}"), None)
                if batch and batch["status"] in ("completed", "failed", "expired", "cancelled"):
                    break
                await asyncio.sleep(1.0)
            if not batch or batch["status"] != "completed" or not batch.get("output_file_id"):
                figures["missing"] += len(custom_ids)
                continue
            figures["completed"] += 1
            async with client.get(f"/v1/files/{batch['output_file_id']}/content") as response:
                lines = [json.loads(line) for line in (await response.text()).splitlines() if line.strip()]
            seen = Counter(line["custom_id"] for line in lines)
            figures["lines_once"] += sum(seen[c] == 1 for c in custom_ids)
            figures["missing"] += sum(seen[c] == 0 for c in custom_ids)
            figures["more_than_once"] += sum(n > 1 for n in seen.values())
            figures["errors"] += sum(1 for line in lines if line.get("error") or
                                     (line.get("response") or {}).get("status_code") != 200)
            if batch.get("error_file_id"):
                async with client.get(f"/v1/files/{batch['error_file_id']}/content") as response:
                    figures["errors"] += sum(1 for line in (await response.text()).splitlines() if line.strip())
        return figures


async def _answer(request: Any, key: str | None) -> Any:
    """The JSON answer's `key` (or the whole answer) when the request got a 2xx; None when it got no answer."""
    try:
        async with request as response:
            if response.status >= 300:
                return None
            answer = await response.json()
    except (aiohttp.ClientError, TimeoutError, ConnectionError, json.JSONDecodeError):
        return None
    return answer if key is None else answer.get(key)


# -- figures --------------------------------------------------------------------------------------------------

def _at(value: str | datetime) -> float:
    moment = datetime.fromisoformat(value) if isinstance(value, str) else value
    return (moment if moment.tzinfo else moment.replace(tzinfo=timezone.utc)).timestamp()


def fault_figures(faults: list[Fault], rows: list[Any], lease_s: float, sweep_s: float) -> dict[str, Any]:
    """Per fault, the jobs in flight when it began and how long after its start the last of them finished; and the
    jobs run more than once, each matched to a fault that took its worker or database while it ran."""
    windows = [(f, _at(f.at), _at(f.at) + (f.end_s - f.start_s)) for f in faults]
    recovery = []
    for fault, start, end in windows:
        in_flight = [r for r in rows if r.started_at and _at(r.started_at) <= start
                     and (r.finished_at is None or _at(r.finished_at) >= start)]
        finished_after = [_at(r.finished_at) for r in rows if r.finished_at and _at(r.finished_at) > end]
        last = max((_at(r.finished_at) for r in in_flight if r.finished_at), default=None)
        recovery.append({"kind": fault.kind, "start_s": fault.start_s, "lasted_s": round(end - start, 2),
                         "in_flight": len(in_flight),
                         "in_flight_finished_within_s": round(last - start, 2) if last else None,
                         "first_finish_after_end_s": round(min(finished_after) - end, 2) if finished_after else None})
    reruns = [r for r in rows if r.attempts > 1]
    explained = sum(1 for r in reruns if any(
        f.kind in RERUN_FAULTS and _at(r.created_at) <= end and (r.finished_at is None or _at(r.finished_at) >= start)
        for f, start, end in windows))
    bound = lease_s + sweep_s
    late = [r for r in recovery if r["kind"] in RERUN_FAULTS and (r["in_flight_finished_within_s"] or 0)
            > bound + r["lasted_s"]]
    return {"faults": recovery, "run_more_than_once": len(reruns),
            "run_more_than_once_outside_a_fault": len(reruns) - explained,
            "lease_plus_sweep_s": bound, "faults_whose_jobs_finished_late": len(late)}
