"""`kevlaya stream-load`: many clients following running jobs' event streams on one API process.

It starts Redis, the API and a CPU worker with the shipped demo model (end-of-sequence ignored, so every job
writes all its tokens), submits Kev jobs, connects the clients (spread evenly over the jobs) before the jobs
start, and checks what each client saw: every event once, in order, and a text that is the stored one. Meanwhile
a thread times `GET /healthz`, and the API process's resident memory is read with no client and with all of
them connected.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import httpx

from modellab.bench.load import percentile
from modellab.bench.service import API_KEY, Service
from modellab.bench.sse import SseParser, streamed_text
from shared.job_stream import entry_order
from shared.settings import DEMO_MODEL_DIR

PROMPT = "Options: A cost 10 risk low days 3 quality 4; B cost 20 risk low days 2 quality 5. Objective: lowest cost."


@dataclass
class ClientRun:
    """What one client saw."""

    job_id: str
    events: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None
    first_delta_at: float | None = None  # time.time() when the first `delta` arrived

    def add(self, event: dict[str, Any]) -> bool:
        """An event as it arrives; True for the last one (`done`)."""
        self.events.append(event)
        if event["event"] == "delta" and self.first_delta_at is None:
            self.first_delta_at = time.time()
        return event["event"] == "done"

    def problems(self, stored: dict[str, Any]) -> list[str]:
        out = []
        if self.error:
            return [self.error]
        ids = [e["id"] for e in self.events if "id" in e]
        if len(ids) != len(set(ids)):
            out.append("an event came twice")
        if [entry_order(i) for i in ids] != sorted(entry_order(i) for i in ids):
            out.append("events out of order")
        if not self.events or self.events[-1]["event"] != "done":
            return out + ["no done event"]
        if self.events[-1]["data"] != stored:
            out.append("done is not the stored job")
        if streamed_text(self.events) != (stored["result"] or {}).get("text"):
            out.append("the streamed text is not the stored one")
        return out


async def follow(session: aiohttp.ClientSession, base_url: str, run: ClientRun, connected: asyncio.Event,
                 counter: list[int], total: int) -> None:
    try:
        async with session.get(f"{base_url}/v1/jobs/{run.job_id}/events") as response:
            if response.status != 200:
                run.error = f"HTTP {response.status}"
                return
            counter[0] += 1
            if counter[0] == total:
                connected.set()
            parser = SseParser()
            async for raw in response.content:
                event = parser.feed(raw.decode().rstrip("\n"))
                if event is not None and run.add(event):
                    return
    except Exception as exc:  # reported per client, never lost
        run.error = f"{exc.__class__.__name__}: {exc}"


def probe_health(base_url: str, interval_s: float, stop: Any, results: Any) -> None:
    """Times GET /healthz every `interval_s` until `stop` is set; in a process of its own, so the clients' work
    does not hold its clock."""
    latencies, failures = [], 0
    with httpx.Client(base_url=base_url, timeout=10) as client:
        while not stop.wait(interval_s):
            started = time.perf_counter()
            try:
                ok = client.get("/healthz").status_code == 200
            except httpx.TransportError:
                ok = False
            latencies.append((time.perf_counter() - started) * 1000)
            failures += not ok
    results.put((latencies, failures))


class HealthProbe:
    def __init__(self, base_url: str, interval_s: float = 0.05):
        context = multiprocessing.get_context("spawn")
        self.stop, self.results = context.Event(), context.Queue()
        self.process = context.Process(target=probe_health, args=(base_url, interval_s, self.stop, self.results),
                                       daemon=True)
        self.latencies_ms: list[float] = []
        self.failures = 0

    def start(self) -> None:
        self.process.start()

    def finish(self) -> None:
        self.stop.set()
        self.latencies_ms, self.failures = self.results.get(timeout=60)
        self.process.join(10)


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def resident_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


async def run_clients(base_url: str, job_ids: list[str], clients: int, timeout_s: float,
                      on_connected: Any) -> list[ClientRun]:
    runs = [ClientRun(job_ids[i % len(job_ids)]) for i in range(clients)]
    connected, counter = asyncio.Event(), [0]
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(base_url=None, connector=connector,
                                     headers={"Authorization": f"Bearer {API_KEY}"},
                                     timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        tasks = [asyncio.create_task(follow(session, base_url, run, connected, counter, clients)) for run in runs]
        await asyncio.wait_for(connected.wait(), 120)
        await asyncio.get_running_loop().run_in_executor(None, on_connected)
        await asyncio.gather(*tasks)
    return runs


def run_stream_load(workdir: Path, clients: int, jobs: int, new_tokens: int, timeout_s: float) -> dict[str, Any]:
    settings = {"KEVLAYA_MODEL__BASE": str(DEMO_MODEL_DIR / "base"), "KEVLAYA_KEV__PATH": str(DEMO_MODEL_DIR / "kev"),
                "KEVLAYA_LAYA__PATH": str(DEMO_MODEL_DIR / "laya"), "KEVLAYA_MODEL__DEVICE": "cpu",
                "KEVLAYA_ENGINE__IGNORE_EOS": "true", "KEVLAYA_ENGINE__MAX_BATCH": str(max(jobs, 1)),
                # the CPU worker's torch on one thread: the clients' own process needs a core of this machine too
                "OMP_NUM_THREADS": "1"}
    with Service(workdir, settings) as service:
        api_pid = service.processes.running["api"].pid
        idle = resident_bytes(api_pid)
        probe = HealthProbe(service.client.base_url.__str__().rstrip("/"))
        probe.start()
        # The jobs are stored while the worker is paused from claiming them: every client connects before a token.
        worker = service.processes.running["worker"].pid
        os.killpg(worker, signal.SIGSTOP)
        job_ids = service.submit([{"adapter": "kev", "input": PROMPT,
                                   "params": {"output": "text", "max_new_tokens": new_tokens}} for _ in range(jobs)])
        figures: dict[str, Any] = {}

        def connected() -> None:
            time.sleep(1.0)
            figures["rss_connected"] = resident_bytes(api_pid)
            figures["started_at"] = time.time()
            os.killpg(worker, signal.SIGCONT)

        started, api_cpu = time.perf_counter(), cpu_seconds(api_pid)
        runs = asyncio.run(run_clients(str(service.client.base_url).rstrip("/"), job_ids, clients, timeout_s,
                                       connected))
        wall_s, api_cpu = time.perf_counter() - started, cpu_seconds(api_pid) - api_cpu
        probe.finish()
        stored = {job_id: service.client.get(f"/v1/jobs/{job_id}").json() for job_id in job_ids}
    problems: dict[str, int] = {}
    for run in runs:
        for problem in run.problems(stored[run.job_id]):
            problems[problem] = problems.get(problem, 0) + 1
    events = sum(len(r.events) for r in runs)
    return {
        "clients": clients, "jobs": jobs, "new_tokens": new_tokens, "wall_s": round(wall_s, 2),
        "clients_with_every_event_once": sum(not r.problems(stored[r.job_id]) for r in runs),
        "problems": problems, "events_received": events,
        "deltas_per_client_mean": round(sum(sum(e["event"] == "delta" for e in r.events) for r in runs) / clients, 1),
        "healthz": {"probes": len(probe.latencies_ms), "failures": probe.failures,
                    "p50_ms": percentile(probe.latencies_ms, 50), "p99_ms": percentile(probe.latencies_ms, 99),
                    "max_ms": max(probe.latencies_ms, default=None)},
        "api_rss_bytes": {"no_client": idle, "all_connected": figures.get("rss_connected"),
                          "per_client": (figures["rss_connected"] - idle) / clients
                          if "rss_connected" in figures else None},
        "jobs_succeeded": sum(s["status"] == "succeeded" for s in stored.values()),
        "api_cpu_share": round(api_cpu / wall_s, 3),  # of one core, over the run
    }


def table(result: dict[str, Any]) -> str:
    health, rss = result["healthz"], result["api_rss_bytes"]
    return "\n".join([
        f"clients {result['clients']} on {result['jobs']} job(s) of {result['new_tokens']} tokens, "
        f"{result['wall_s']} s",
        f"every event exactly once, text = stored: {result['clients_with_every_event_once']} of {result['clients']}"
        + (f" (problems: {result['problems']})" if result["problems"] else ""),
        f"mean deltas per client: {result['deltas_per_client_mean']}; the API process used "
        f"{result['api_cpu_share']:.0%} of a core",
        f"/healthz meanwhile: p50 {health['p50_ms']:.1f} ms, p99 {health['p99_ms']:.1f} ms, "
        f"max {health['max_ms']:.1f} ms, {health['failures']} failed of {health['probes']}",
        f"API memory: {rss['no_client'] / 2**20:.1f} MiB with no client, "
        f"{(rss['all_connected'] or 0) / 2**20:.1f} MiB with all connected: "
        f"{(rss['per_client'] or 0) / 1024:.1f} KiB per client",
    ])
