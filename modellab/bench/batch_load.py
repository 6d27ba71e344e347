"""`kevlaya batch-load`: the Batch API (`/v1/files`, `/v1/batches`) at OpenAI's sizes on one API process.

Two phases, each on a service of its own (Redis, the API, SQLite in a scratch directory):

- **upload**: a batch input file of `--lines` requests (50,000, OpenAI's limit) is written to disk, streamed to
  `POST /v1/files` by httpx (after a 100-line batch, apart from the figures), then `POST /v1/batches` is timed
  until the batch leaves `validating` (polled every 0.1 s), which is the API's batch keeper checking the file
  and storing every line as a job. No worker runs:
  `Service` always starts one and waits for its model, so this phase starts the API alone (`ApiOnly`); a worker
  would begin on the lines while they are still being stored. A thread samples the API process's VmRSS and
  VmHWM every 0.1 s meanwhile, against its memory before the upload: the file is streamed, never held.
- **drain**: the service with a CPU worker on the shipped demo model (end-of-sequence ignored, so each job
  writes exactly its tokens; the worker's torch on one thread, as `stream-load` runs it, since the benchmark's
  own process and the API need the other core). Interactive Laya latency (`POST /v1/chat/completions`, timed end
  to end, one at a time) is measured idle, then again while a `--drain-lines` batch drains, from when it is
  `in_progress` until it is `completed`; then the output and error files are downloaded and every custom_id
  must be in them exactly once, with `completed + failed == total == lines`.
"""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from modellab.bench.load import percentile
from modellab.bench.service import Service
from modellab.bench.stream_load import cpu_seconds
from shared.models import ClaimGroup, FileBatch, Job
from shared.settings import DEMO_MODEL_DIR

log = logging.getLogger("kevlaya.bench")

ENDPOINT = "/v1/chat/completions"
UPLOAD_TARGET_S = 30.0  # upload + validation of a 50,000-line file
DRAIN_P95_TARGET = 2.0  # interactive Laya p95 during a drain, as a multiple of the idle p95
POLL_S = 0.1
WARMUP_LINES = 100  # a batch uploaded and validated before the upload phase's figures
SAMPLE_S = 0.1

OBJECTIVES = ("lowest cost", "lowest risk", "fastest delivery", "highest quality", "best quality per cost",
              "lowest cost with risk at most medium", "fewest days within a budget of 60")
RISKS = ("low", "medium", "high")
SYSTEM = "You pick one option and say why in one sentence."


# -- the workload ---------------------------------------------------------------------------------------------

def decision_prompt(rng: random.Random) -> str:
    """`Options: A cost 10 risk low days 3 quality 4; B cost 20 ... Objective: ...`, 2 to 5 options."""
    options = "; ".join(
        f"{chr(65 + i)} cost {rng.randint(5, 120)} risk {rng.choice(RISKS)} days {rng.randint(1, 30)} "
        f"quality {rng.randint(1, 5)}" for i in range(rng.randint(2, 5)))
    prompt = f"Options: {options}. Objective: {rng.choice(OBJECTIVES)}."
    if rng.random() < 0.3:
        prompt += f" Constraint: days <= {rng.randint(3, 20)}."
    return prompt


def chat_body(rng: random.Random, model: str, max_tokens: int) -> dict[str, Any]:
    messages = [{"role": "user", "content": decision_prompt(rng)}]
    if rng.random() < 0.2:
        messages.insert(0, {"role": "system", "content": SYSTEM})
    return {"model": model, "messages": messages, "max_tokens": max_tokens}


def write_batch_file(path: Path, lines: int, models: tuple[str, ...], max_tokens: tuple[int, ...], seed: int,
                     ) -> list[str]:
    """A JSONL batch input file of `lines` requests; returns the custom_ids in order."""
    rng = random.Random(seed)
    custom_ids = []
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as out:
        for n in range(1, lines + 1):
            custom_id = f"req-{n:06d}"
            line = {"custom_id": custom_id, "method": "POST", "url": ENDPOINT,
                    "body": chat_body(rng, rng.choice(models), rng.choice(max_tokens))}
            out.write(json.dumps(line, separators=(",", ":")) + "\n")
            custom_ids.append(custom_id)
    return custom_ids


# -- the service ----------------------------------------------------------------------------------------------

def service_settings(workdir: Path) -> dict[str, str]:
    return {"KEVLAYA_MODEL__BASE": str(DEMO_MODEL_DIR / "base"), "KEVLAYA_KEV__PATH": str(DEMO_MODEL_DIR / "kev"),
            "KEVLAYA_LAYA__PATH": str(DEMO_MODEL_DIR / "laya"), "KEVLAYA_MODEL__DEVICE": "cpu",
            "KEVLAYA_ENGINE__IGNORE_EOS": "true", "KEVLAYA_BATCH__FILES_DIR": str(workdir / "files"),
            # the CPU worker's torch on one thread: this process and the API need a core of this machine too
            "OMP_NUM_THREADS": "1"}


class ApiOnly(Service):
    """Redis and the API, no worker: `Service` waits for /readyz, which needs a worker with its model loaded."""

    def __enter__(self) -> ApiOnly:
        self.processes.prepare()
        self.processes.start("api")
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            self.processes.check_alive("api")
            try:
                if self.client.get("/healthz").status_code == 200:
                    return self
            except httpx.TransportError:
                pass  # not listening yet
            time.sleep(0.2)
        raise RuntimeError(f"the API did not answer /healthz after 120 s:\n{self.processes.log_tail('api')}")


def memory_fields(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (the peak resident size so far) of a process, bytes."""
    found = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            found[name] = int(value.split()[0]) * 1024
    return found


class MemorySampler:
    """Samples a process's VmRSS and VmHWM every `interval_s` from a thread, from `start` to `stop`."""

    def __init__(self, pid: int, interval_s: float = SAMPLE_S):
        self.pid, self.interval_s = pid, interval_s
        self.before = memory_fields(pid)
        self.samples: list[tuple[float, int, int]] = []  # (seconds since start, VmRSS, VmHWM)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="memory-sampler", daemon=True)

    def start(self) -> MemorySampler:
        self._started = time.perf_counter()
        self._thread.start()
        return self

    def _run(self) -> None:
        while True:
            fields = memory_fields(self.pid)
            self.samples.append((time.perf_counter() - self._started, fields["VmRSS"], fields["VmHWM"]))
            if self._stop.wait(self.interval_s):
                return

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        self._thread.join(5)
        after = memory_fields(self.pid)
        peak = max([s[1] for s in self.samples] + [after["VmRSS"]])
        # memory that grows with the lines read keeps growing to the end; bounded memory has levelled off
        middle = self.samples[len(self.samples) // 2][1] if self.samples else self.before["VmRSS"]
        return {"rss_before_bytes": self.before["VmRSS"], "hwm_before_bytes": self.before["VmHWM"],
                "rss_peak_sampled_bytes": peak, "hwm_after_bytes": after["VmHWM"],
                "rss_after_bytes": after["VmRSS"], "growth_bytes": max(peak, after["VmHWM"]) - self.before["VmRSS"],
                "growth_second_half_bytes": after["VmRSS"] - middle,
                "samples": len(self.samples), "interval_s": self.interval_s,
                # a few points of the curve: (s, RSS MiB)
                "rss_mib_timeline": [(round(t, 1), round(rss / 2**20, 1)) for t, rss, _ in
                                     self.samples[::max(1, len(self.samples) // 40)]]}


class Profiler:
    """`py-spy record` on a process until stopped; then the share of the samples under `validate` per function."""

    def __init__(self, pid: int, output: Path, rate: int = 50):
        self.output = output
        py_spy = Path(sys.executable).parent / "py-spy"
        self.process = subprocess.Popen([str(py_spy), "record", "--pid", str(pid), "--rate", str(rate), "--format",
                                         "raw", "--nonblocking", "--threads", "--output", str(output)],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def stop(self, within: str = "validate (api/batch/file_batches.py") -> dict[str, Any]:
        self.process.send_signal(signal.SIGINT)
        try:
            _, stderr = self.process.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return {"error": "py-spy did not stop"}
        if not self.output.is_file():
            return {"error": stderr.decode(errors="replace")[-500:]}
        inclusive: dict[str, int] = {}
        leaves: dict[str, int] = {}
        total = 0
        for line in self.output.read_text().splitlines():
            stack, _, count = line.rpartition(" ")
            if within not in stack:
                continue
            frames = [frame.rsplit(":", 1)[0] + ")" if ":" in frame else frame  # per function, not per line
                      for frame in stack.split(";")[1:]]
            frames = frames[next(i for i, f in enumerate(frames) if f.startswith(within.split(":")[0])):]
            total += int(count)
            for frame in set(frames):
                inclusive[frame] = inclusive.get(frame, 0) + int(count)
            leaves[frames[-1]] = leaves.get(frames[-1], 0) + int(count)

        def top(counts: dict[str, int], n: int) -> list[tuple[str, float]]:
            return [(frame, round(c / total, 3)) for frame, c in sorted(counts.items(), key=lambda x: -x[1])[:n]]

        return {"samples_in_validate": total, "inclusive_share": top(inclusive, 25) if total else [],
                "self_share": top(leaves, 15) if total else [], "raw": str(self.output)}


# -- the API calls --------------------------------------------------------------------------------------------

def upload_file(client: httpx.Client, path: Path) -> dict[str, Any]:
    """POST /v1/files, the file streamed from disk (httpx reads a file part in chunks)."""
    with path.open("rb") as source:
        response = client.post("/v1/files", data={"purpose": "batch"},
                               files={"file": (path.name, source, "application/jsonl")}, timeout=600)
    if response.status_code != 200:
        raise RuntimeError(f"POST /v1/files answered {response.status_code}: {response.text[:500]}")
    return response.json()


def create_batch(client: httpx.Client, file_id: str) -> dict[str, Any]:
    response = client.post("/v1/batches", json={"input_file_id": file_id, "endpoint": ENDPOINT,
                                                "completion_window": "24h"})
    if response.status_code != 200:
        raise RuntimeError(f"POST /v1/batches answered {response.status_code}: {response.text[:500]}")
    return response.json()


def get_batch(client: httpx.Client, batch_id: str) -> dict[str, Any]:
    response = client.get(f"/v1/batches/{batch_id}")
    response.raise_for_status()
    return response.json()


def wait_while(client: httpx.Client, batch_id: str, statuses: set[str], timeout_s: float,
               alive: Any = None) -> tuple[dict[str, Any], int]:
    """Poll every POLL_S until the batch's status is not in `statuses`; (the batch, polls)."""
    deadline, polls = time.monotonic() + timeout_s, 0
    while True:
        batch = get_batch(client, batch_id)
        polls += 1
        if batch["status"] not in statuses:
            return batch, polls
        if time.monotonic() > deadline:
            raise RuntimeError(f"batch {batch_id} still {batch['status']} after {timeout_s:.0f} s")
        if alive is not None:
            alive()
        time.sleep(POLL_S)


def file_lines(client: httpx.Client, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    response = client.get(f"/v1/files/{file_id}/content", timeout=600)
    response.raise_for_status()
    return [json.loads(line) for line in response.text.splitlines() if line.strip()]


def check_exactly_once(custom_ids: list[str], output: list[dict[str, Any]], errors: list[dict[str, Any]],
                       counts: dict[str, int]) -> dict[str, Any]:
    """Every custom_id of the input in the output and error files together exactly once, none other, and
    `completed + failed == total ==` the input's lines, as many output lines as completed."""
    seen: dict[str, int] = {}
    for line in output + errors:
        seen[line["custom_id"]] = seen.get(line["custom_id"], 0) + 1
    missing = sum(c not in seen for c in custom_ids)
    twice = sum(n > 1 for n in seen.values())
    unknown = len(set(seen) - set(custom_ids))
    add_up = counts["completed"] + counts["failed"] == counts["total"] == len(custom_ids)
    ok = (not missing and not twice and not unknown and add_up and len(output) == counts["completed"]
          and len(errors) == counts["failed"])
    return {"ok": ok, "output_lines": len(output), "error_lines": len(errors), "missing": missing,
            "more_than_once": twice, "unknown": unknown, "counts_add_up": add_up}


def stored_span(service: Service, batch_id: str) -> dict[str, Any]:
    """From the rows: when the batch was created, its first and last line stored, and it went in progress."""
    row_id = uuid.UUID(hex=batch_id.removeprefix("batch_"))
    with Session(service.engine) as session:
        batch = session.get(FileBatch, row_id)
        first, last, jobs = session.execute(select(func.min(Job.created_at), func.max(Job.created_at), func.count())
                                            .where(Job.file_batch_id == row_id)).one()
        started, finished = session.execute(select(func.min(Job.started_at), func.max(Job.finished_at))
                                            .where(Job.file_batch_id == row_id)).one()
        created, in_progress = batch.created_at, batch.in_progress_at

    def seconds(a: Any, b: Any) -> float | None:
        return None if a is None or b is None else round((b - a).total_seconds(), 3)

    return {"jobs_stored": jobs,
            # the keeper reads the whole file once (check_file) before it stores the first line
            "created_to_first_line_stored_s": seconds(created, first),
            "first_to_last_line_stored_s": seconds(first, last),
            "created_to_in_progress_s": seconds(created, in_progress),
            "first_line_started_to_last_finished_s": seconds(started, finished),
            "created_to_first_line_started_s": seconds(created, started)}


def where_time_goes(service: Service, batch_id: str, warmup: int, probes: int, drain_s: float) -> dict[str, Any]:
    """From the rows: each probe's job split into its wait to be claimed (queue), its prefill and its decode,
    idle and during the drain; and the worker's time in the prefills of the batch's claim groups, which an
    interactive job that arrives meanwhile waits out."""
    row_id = uuid.UUID(hex=batch_id.removeprefix("batch_"))
    with Session(service.engine) as session:
        jobs = session.execute(select(Job.queue_ms, Job.ttft_ms, Job.total_ms)
                               .where(Job.file_batch_id.is_(None), Job.parent_job_id.is_(None))
                               .order_by(Job.created_at)).all()
        groups = session.execute(select(ClaimGroup.size, ClaimGroup.prefill_ms, ClaimGroup.decode_ms).where(
            ClaimGroup.id.in_(select(Job.batch_id).where(Job.file_batch_id == row_id).distinct()))).all()

    def split(rows: list[Any]) -> dict[str, Any]:
        parts = {"queue": [r.queue_ms for r in rows], "prefill": [r.ttft_ms - r.queue_ms for r in rows],
                 "decode": [r.total_ms - r.ttft_ms for r in rows], "job_total": [r.total_ms for r in rows]}
        return {f"{name}_{q}_ms": _round(percentile([v for v in values if v is not None], q))
                for name, values in parts.items() for q in (50, 95)}

    timed = [r for r in jobs if None not in r]
    prefills = [g.prefill_ms for g in groups if g.prefill_ms is not None]
    return {"probe_jobs_idle": split(timed[warmup:warmup + probes]),
            "probe_jobs_during": split(timed[warmup + probes:]),
            "batch_claim_groups": len(groups), "batch_group_size_mean": _round(
                statistics.fmean(g.size for g in groups) if groups else None),
            "batch_group_prefill_p50_ms": _round(percentile(prefills, 50)),
            "batch_group_prefill_p95_ms": _round(percentile(prefills, 95)),
            "batch_group_decode_p50_ms": _round(percentile([g.decode_ms for g in groups if g.decode_ms], 50)),
            "batch_prefill_share_of_drain": round(sum(prefills) / 1000 / drain_s, 3) if drain_s else None}


# -- the phases -----------------------------------------------------------------------------------------------

def run_upload(workdir: Path, lines: int, seed: int, timeout_s: float, profile: bool) -> dict[str, Any]:
    path = workdir / f"batch-{lines}.jsonl"
    started = time.perf_counter()
    write_batch_file(path, lines, ("laya", "kev", "auto"), (4, 8, 12, 16), seed)
    generate_s = time.perf_counter() - started
    size = path.stat().st_size
    log.info("wrote %s: %d lines, %.1f MiB in %.1f s", path, lines, size / 2**20, generate_s)
    with ApiOnly(workdir / "service", service_settings(workdir / "service")) as service:
        api_pid = service.processes.running["api"].pid
        started_rss = memory_fields(api_pid)
        # A small batch first, apart from the figures: what the first upload and validation import and allocate
        # once is not counted against the file.
        warmup = workdir / "warmup.jsonl"
        write_batch_file(warmup, WARMUP_LINES, ("laya", "kev", "auto"), (4, 8), seed + 1)
        wait_while(service.client, create_batch(service.client, upload_file(service.client, warmup)["id"])["id"],
                   {"validating"}, 120)
        time.sleep(1.0)
        sampler = MemorySampler(api_pid).start()
        cpu_before = cpu_seconds(api_pid)
        started = time.perf_counter()
        uploaded = upload_file(service.client, path)
        upload_s = time.perf_counter() - started
        cpu_upload = cpu_seconds(api_pid) - cpu_before
        log.info("uploaded %s in %.2f s", uploaded["id"], upload_s)
        profiler = Profiler(api_pid, workdir / "validation-py-spy.txt") if profile else None
        cpu_before = cpu_seconds(api_pid)
        started = time.perf_counter()
        batch = create_batch(service.client, uploaded["id"])
        after, polls = wait_while(service.client, batch["id"], {"validating"}, timeout_s,
                                  lambda: service.processes.check_alive("api"))
        validation_s = time.perf_counter() - started
        cpu_validation = cpu_seconds(api_pid) - cpu_before
        memory = sampler.stop()
        keeper_profile = profiler.stop() if profiler else None
        log.info("batch %s %s after %.2f s", batch["id"], after["status"], validation_s)
        span = stored_span(service, batch["id"])
    total_s = upload_s + validation_s
    result = {
        "lines": lines, "file_bytes": size, "generate_s": round(generate_s, 2),
        "upload_s": round(upload_s, 3), "upload_mib_per_s": round(size / 2**20 / upload_s, 1),
        "uploaded_file": {k: uploaded[k] for k in ("id", "bytes", "filename", "purpose")},
        "validation_s": round(validation_s, 3), "validation_polls": polls, "poll_interval_s": POLL_S,
        "validation_lines_per_s": round(lines / validation_s, 1),
        "upload_plus_validation_s": round(total_s, 3),
        "status_after_validation": after["status"], "request_counts": after["request_counts"],
        "errors": after["errors"], "stored": span,
        "api_cpu_s": {"upload": round(cpu_upload, 2), "validation": round(cpu_validation, 2)},
        "api_memory": {**memory, "file_bytes": size, "warmup_lines": WARMUP_LINES,
                       "rss_at_start_bytes": started_rss["VmRSS"],
                       "growth_vs_file_size": round(memory["growth_bytes"] / size, 3)},
        "worker": "none (the API alone: ApiOnly)",
        "targets": {"upload_plus_validation_s": UPLOAD_TARGET_S,
                    "upload_plus_validation_met": total_s <= UPLOAD_TARGET_S,
                    # the file (every line) was never held: the API grew by less than the file's size
                    "memory_growth_below_file_size": memory["growth_bytes"] < size},
    }
    if keeper_profile is not None:
        result["validation_profile"] = keeper_profile
    return result


class StatusWatcher:
    """Polls a batch from a thread of its own: when it went in progress, finalizing and completed."""

    def __init__(self, base_url: str, headers: dict[str, str], batch_id: str, interval_s: float = 0.2):
        self.client = httpx.Client(base_url=base_url, headers=headers, timeout=60)
        self.batch_id, self.interval_s = batch_id, interval_s
        self.status = "validating"
        self.seen: dict[str, float] = {}  # status -> perf_counter when first seen
        self.last: dict[str, Any] = {}
        self.in_progress = threading.Event()
        self.done = threading.Event()
        self.error: str | None = None
        self.at_in_progress: dict[str, int] | None = None  # the request counts when first seen past validating
        self._thread = threading.Thread(target=self._run, name="batch-watcher", daemon=True)

    def start(self) -> StatusWatcher:
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            while True:
                batch = get_batch(self.client, self.batch_id)
                now = time.perf_counter()
                self.last, self.status = batch, batch["status"]
                self.seen.setdefault(self.status, now)
                if self.status != "validating" and not self.in_progress.is_set():
                    self.seen.setdefault("in_progress", now)  # even if it went past it between two polls
                    self.at_in_progress = batch["request_counts"]
                    self.in_progress.set()
                if self.status in ("completed", "failed", "expired", "cancelled"):
                    return
                time.sleep(self.interval_s)
        except Exception as exc:  # reported in the result
            self.error = f"{exc.__class__.__name__}: {exc}"
        finally:
            self.in_progress.set()
            self.done.set()
            self.client.close()


def probe(client: httpx.Client, body: dict[str, Any]) -> tuple[float, bool]:
    """One interactive Laya request, end to end: (ms, answered 200)."""
    started = time.perf_counter()
    try:
        ok = client.post(ENDPOINT, json=body).status_code == 200
    except httpx.TransportError:
        ok = False
    return (time.perf_counter() - started) * 1000, ok


def latency_figures(ms: list[float]) -> dict[str, Any]:
    return {"probes": len(ms), "p50_ms": _round(percentile(ms, 50)), "p95_ms": _round(percentile(ms, 95)),
            "mean_ms": _round(statistics.fmean(ms)) if ms else None, "max_ms": _round(max(ms, default=None))}


def _round(value: float | None, digits: int = 1) -> float | None:
    return None if value is None else round(value, digits)


def run_drain(workdir: Path, lines: int, probes: int, seed: int, timeout_s: float) -> dict[str, Any]:
    path = workdir / f"drain-{lines}.jsonl"
    custom_ids = write_batch_file(path, lines, ("laya", "kev"), (8,), seed)
    rng = random.Random(seed + 1)
    probe_bodies = [chat_body(rng, "laya", 8) for _ in range(probes)]
    warmup = 3
    with Service(workdir / "service", service_settings(workdir / "service")) as service:
        client = service.client
        for body in probe_bodies[:warmup]:  # the first requests of a fresh service, apart from the figures
            probe(client, body)
        idle = [probe(client, body) for body in probe_bodies]
        log.info("idle: %d probes, p95 %.1f ms", len(idle), percentile([ms for ms, _ in idle], 95))
        uploaded = upload_file(client, path)
        created = time.perf_counter()
        batch = create_batch(client, uploaded["id"])
        watcher = StatusWatcher(str(client.base_url), dict(client.headers), batch["id"]).start()
        watcher.in_progress.wait(timeout_s)
        during: list[tuple[float, bool, str]] = []  # (ms, ok, the batch's status when the probe was sent)
        deadline = time.monotonic() + timeout_s
        while not watcher.done.is_set() and time.monotonic() < deadline:
            status = watcher.status
            ms, ok = probe(client, probe_bodies[len(during) % probes])
            during.append((ms, ok, status))
            service.processes.check_alive("worker")
        watcher.done.wait(60)
        final = watcher.last
        if watcher.error or final.get("status") != "completed":
            raise RuntimeError(f"batch {batch['id']}: {watcher.error or final.get('status')} "
                               f"after {time.perf_counter() - created:.0f} s")
        output = file_lines(client, final["output_file_id"])
        errors = file_lines(client, final["error_file_id"])
        span = stored_span(service, batch["id"])
        in_progress_at, completed_at = watcher.seen["in_progress"], watcher.seen["completed"]
        drain_s = completed_at - in_progress_at
        breakdown = where_time_goes(service, batch["id"], warmup, probes, drain_s)
    counts = final["request_counts"]
    idle_ms = [ms for ms, _ in idle]
    during_ms = [ms for ms, _, _ in during]
    idle_fig, during_fig = latency_figures(idle_ms), latency_figures(during_ms)
    ratio = (during_fig["p95_ms"] / idle_fig["p95_ms"]) if during_fig["p95_ms"] and idle_fig["p95_ms"] else None
    by_status = {status: latency_figures([ms for ms, _, s in during if s == status])
                 for status in sorted({s for _, _, s in during})}
    return {
        "lines": lines, "probes": probes, "probe_warmup": warmup, "probe_max_tokens": 8,
        "idle": {**idle_fig, "failures": sum(not ok for _, ok in idle)},
        "during_drain": {**during_fig, "failures": sum(not ok for _, ok, _ in during), "by_batch_status": by_status},
        "p95_during_vs_idle": _round(ratio, 2), "p50_during_vs_idle": _round(
            during_fig["p50_ms"] / idle_fig["p50_ms"] if during_fig["p50_ms"] and idle_fig["p50_ms"] else None, 2),
        "validation_s": round(in_progress_at - created, 2),
        "request_counts_at_in_progress": watcher.at_in_progress,
        "drain_s": round(drain_s, 2), "lines_per_s": round(lines / drain_s, 1),
        "created_to_completed_s": round(completed_at - created, 2),
        "created_to_completed_lines_per_s": round(lines / (completed_at - created), 1),
        "status_poll_interval_s": watcher.interval_s,
        "statuses_seen_s": {s: round(t - created, 2) for s, t in watcher.seen.items()},
        "stored": span, "where_time_goes": breakdown,
        "request_counts": counts,
        "exactly_once": check_exactly_once(custom_ids, output, errors, counts),
        "targets": {"p95_during_vs_idle": DRAIN_P95_TARGET,
                    "p95_during_vs_idle_met": ratio is not None and ratio <= DRAIN_P95_TARGET},
    }


def run_batch_load(workdir: Path, phase: str, lines: int, drain_lines: int, probes: int, seed: int,
                   timeout_s: float, profile: bool) -> dict[str, Any]:
    result: dict[str, Any] = {"phase": phase, "seed": seed, "workdir": str(workdir),
                              "service_settings": {k: v for k, v in service_settings(workdir).items()
                                                   if k != "KEVLAYA_BATCH__FILES_DIR"}}
    # other work on this machine shares its cores with the service: the load averages before and after each phase
    result["load_average"] = {"start": os.getloadavg()}
    if phase in ("upload", "both"):
        result["upload"] = run_upload(workdir / "upload", lines, seed, timeout_s, profile)
        result["load_average"]["after_upload"] = os.getloadavg()
    if phase in ("drain", "both"):
        result["drain"] = run_drain(workdir / "drain", drain_lines, probes, seed, timeout_s)
        result["load_average"]["after_drain"] = os.getloadavg()
    return result


def table(result: dict[str, Any]) -> str:
    rows = []
    if up := result.get("upload"):
        memory, targets = up["api_memory"], up["targets"]
        rows += [
            f"upload: {up['lines']} lines, {up['file_bytes'] / 2**20:.1f} MiB in {up['upload_s']:.2f} s "
            f"({up['upload_mib_per_s']} MiB/s); validation {up['validation_s']:.2f} s "
            f"({up['validation_lines_per_s']:.0f} lines/s) -> {up['status_after_validation']}",
            f"upload + validation: {up['upload_plus_validation_s']:.2f} s (target <= {UPLOAD_TARGET_S:.0f} s: "
            f"{'met' if targets['upload_plus_validation_met'] else 'MISSED'})",
            f"API memory: {memory['rss_before_bytes'] / 2**20:.1f} MiB before, peak "
            f"{max(memory['rss_peak_sampled_bytes'], memory['hwm_after_bytes']) / 2**20:.1f} MiB, "
            f"+{memory['growth_bytes'] / 2**20:.1f} MiB = {memory['growth_vs_file_size']:.0%} of the file "
            f"({'below' if targets['memory_growth_below_file_size'] else 'NOT below'} the file size), "
            f"{memory['growth_second_half_bytes'] / 2**20:+.1f} MiB over the second half",
        ]
    if dr := result.get("drain"):
        once, tg = dr["exactly_once"], dr["where_time_goes"]
        rows += [
            f"drain: {dr['lines']} lines in {dr['drain_s']:.1f} s from in_progress ({dr['lines_per_s']} lines/s); "
            f"{dr['created_to_completed_s']:.1f} s from create",
            f"Laya p50/p95 idle {dr['idle']['p50_ms']:.0f}/{dr['idle']['p95_ms']:.0f} ms, during drain "
            f"{dr['during_drain']['p50_ms']:.0f}/{dr['during_drain']['p95_ms']:.0f} ms "
            f"({dr['during_drain']['probes']} probes): p95 x{dr['p95_during_vs_idle']} (target <= "
            f"x{DRAIN_P95_TARGET:.0f}: {'met' if dr['targets']['p95_during_vs_idle_met'] else 'MISSED'})",
            f"probe jobs during drain: queue p50 {tg['probe_jobs_during']['queue_50_ms']} ms, decode p50 "
            f"{tg['probe_jobs_during']['decode_50_ms']} ms (idle {tg['probe_jobs_idle']['queue_50_ms']} / "
            f"{tg['probe_jobs_idle']['decode_50_ms']}); batch-group prefills p50 {tg['batch_group_prefill_p50_ms']} "
            f"ms, {tg['batch_prefill_share_of_drain']:.0%} of the drain",
            f"exactly once: {'yes' if once['ok'] else 'NO'} ({once['output_lines']} output + {once['error_lines']} "
            f"error lines; counts {dr['request_counts']})",
        ]
    return "\n".join(rows)
