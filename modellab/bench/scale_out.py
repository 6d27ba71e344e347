"""`kevlaya scale-out`: what more workers add to the service, and what the death of one costs.

It starts Redis, a database (a SQLite file in `--workdir`, or the PostgreSQL at `--database-url`, migrated) and one
`kevlaya api`, builds a random-weight model of `--shape` as the benchmark does, and runs the benchmark's workload
(`modellab/bench/workload.py`: kev and laya interleaved, exact lengths with end-of-sequence ignored) three times:

1. one `kevlaya worker` alone: jobs/s;
2. N workers (`--gpus` × `--workers-per-gpu`; on CUDA each pinned to its GPU with CUDA_VISIBLE_DEVICES and capped
   to KEVLAYA_ENGINE__VRAM_BUDGET_GB; on the CPU each with torch on one thread): jobs/s, and the speedup over phase 1;
3. the same N workers, one of them SIGKILLed (its whole process group) as soon as it holds claimed jobs: every
   job must still end once, the killed worker's on the survivors once their lease expires (docs/architecture.md
   §3, Lease and Sweep).

Each phase is checked over the stored rows with `kevlaya load`'s exactly-once check (`drain_problems`). The kill
phase allows only what the kill explains: the jobs the killed worker held ran a second time (attempts 2) and finished
on a survivor, and its claim groups never finished (the jobs it stored before it died stay in them).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx
import typer
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from modellab.bench.load import Announcements, drain_problems, make_kind
from modellab.bench.service import Service, free_port
from shared.models import ClaimGroup, Job, JobStatus

log = logging.getLogger("kevlaya.scale_out")

WAKE_AND_CLAIM_S = 1.0  # a re-queued job's wake-up reaching an idle worker and its claim
PHASES = {"one_worker": "1 worker", "all_workers": "{n} workers", "kill": "{n} workers, 1 killed"}


@dataclass
class ScaleOutConfig:
    workdir: Path
    device: str = "cpu"  # cuda or cpu (resolved by the caller)
    gpus: int = 2
    workers_per_gpu: int = 1
    shape: str = "tiny"
    jobs: int = 256
    prompt_tokens: tuple[int, int] = (200, 256)
    new_tokens: dict[str, int] = field(default_factory=lambda: {"kev": 128, "laya": 32})
    max_batch: int = 16
    vram_budget_gb: float = 5.5
    lease_seconds: float | None = None  # KEVLAYA_RELIABILITY__LEASE_SECONDS for the service; None: its setting
    sweep_interval_s: float | None = None  # KEVLAYA_RELIABILITY__SWEEP_INTERVAL_S; None: its setting
    kill: bool = True
    timeout_s: float = 1800.0  # per phase
    seed: int = 0
    database_url: str | None = None  # default: a SQLite file in workdir
    redis_url: str | None = None  # default: a private server

    @property
    def workers(self) -> int:
        return self.gpus * self.workers_per_gpu


def visible_gpus() -> list[str]:
    """The GPUs this process may hand out, as CUDA_VISIBLE_DEVICES names them (its own list when it is set)."""
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [d.strip() for d in listed.split(",") if d.strip()][:count]
    return [str(i) for i in range(count)]


def ledger_timing(config: ScaleOutConfig) -> dict[str, float]:
    """The lease and the sweep the workers run with: shared/settings.py read with the environment they inherit, and
    the options that override it. A dead worker's jobs expire at most one lease after its last renewal (leases are
    renewed every third of it) and go back to the queue at the next sweep."""
    from shared.settings import Settings

    given = {"lease_seconds": config.lease_seconds, "sweep_interval_s": config.sweep_interval_s}
    reliability = Settings(reliability={k: v for k, v in given.items() if v is not None}).reliability
    return {"lease_s": reliability.lease_seconds, "renew_every_s": round(reliability.lease_seconds / 3, 3),
            "sweep_every_s": min(reliability.sweep_interval_s, reliability.heartbeat_ttl_s / 3),
            "max_attempts": reliability.max_attempts}


def service_settings(config: ScaleOutConfig, paths: dict[str, Path]) -> dict[str, str]:
    """KEVLAYA_* for every process, as the benchmark serves its random model."""
    env = {"KEVLAYA_MODEL__BASE": str(paths["base"]), "KEVLAYA_KEV__PATH": str(paths["kev"]),
           "KEVLAYA_LAYA__PATH": str(paths["laya"]), "KEVLAYA_MODEL__DEVICE": config.device,
           "KEVLAYA_ENGINE__VRAM_BUDGET_GB": str(config.vram_budget_gb), "KEVLAYA_ENGINE__IGNORE_EOS": "true",
           "KEVLAYA_ENGINE__MAX_BATCH": str(config.max_batch),
           # random weights from this run: hashing them again would only slow each worker's start
           "KEVLAYA_MODEL__VERIFY_MANIFESTS": "false"}
    if config.lease_seconds is not None:
        env["KEVLAYA_RELIABILITY__LEASE_SECONDS"] = str(config.lease_seconds)
    if config.sweep_interval_s is not None:
        env["KEVLAYA_RELIABILITY__SWEEP_INTERVAL_S"] = str(config.sweep_interval_s)
    if config.device == "cpu":
        env["OMP_NUM_THREADS"] = "1"  # each CPU worker's torch on one thread: N of them share this machine's cores
    return env


def pool_child(pid: int) -> int | None:
    """The Celery pool child of a worker's main process: the process that holds the model and writes leases."""
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return None
    return int(children[0]) if children else None


def gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state in ("Z", "X")


# -- the service --------------------------------------------------------------------------------------------

class Fleet(Service):
    """Redis, the database and the API, with workers started one by one (`worker-<i>`, each logging to
    `workdir/worker-<i>.log`) and killed: `Service` starts exactly one worker and waits for it."""

    def __init__(self, workdir: Path, settings: dict[str, str], redis_url: str | None, database_url: str):
        super().__init__(workdir, settings, redis_url, database_url)
        self.names: dict[int, str] = {}  # worker index -> its name in leases and claim groups (host:pid)
        self.killed: set[int] = set()

    def __enter__(self) -> Fleet:
        try:
            self.processes.prepare()
            self.processes.start("api")
            self._wait_api(timeout=120)
        except BaseException:
            self.__exit__()  # what did start (Redis, the API) stops
            raise
        return self

    def _wait_api(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.processes.check_alive("api")
            try:
                if self.client.get("/healthz").status_code == 200:
                    return
            except httpx.TransportError:
                pass  # not listening yet
            time.sleep(0.2)
        raise RuntimeError(f"the API did not answer /healthz after {timeout:.0f} s:\n{self.processes.log_tail('api')}")

    def __exit__(self, *exc: object) -> None:
        for index in sorted(self.started()):
            self._stop(index)
        super().__exit__(*exc)

    def started(self) -> list[int]:
        return [int(kind.split("-")[1]) for kind in self.processes.running if kind.startswith("worker-")]

    def start_worker(self, index: int, extra: dict[str, str]) -> None:
        kind = f"worker-{index}"
        with open(self.processes.workdir / f"{kind}.log", "wb") as log_file:
            self.processes.running[kind] = subprocess.Popen(
                [sys.executable, "-m", "cli", "worker"], env={**self.processes.env, **extra}, stdout=log_file,
                stderr=subprocess.STDOUT, start_new_session=True)
        log.info("%s started (pid %d%s)", kind, self.processes.running[kind].pid,
                 f", CUDA_VISIBLE_DEVICES={extra['CUDA_VISIBLE_DEVICES']}" if "CUDA_VISIBLE_DEVICES" in extra else "")

    def wait_loaded(self, indices: list[int], timeout: float = 900) -> None:
        """Until each worker's pool child beats with its model loaded; its name is then known."""
        waiting, deadline = set(indices), time.monotonic() + timeout
        while waiting and time.monotonic() < deadline:
            beats = self.client.get("/v1/stats/live").json().get("workers") or {}
            for index in sorted(waiting):
                kind = f"worker-{index}"
                self.processes.check_alive(kind)
                if "model load failed" in self.processes.log_tail(kind, 100_000):  # it would wait for a fix in vain
                    raise RuntimeError(f"{kind} could not load the model:\n{self.processes.log_tail(kind)}")
                child = pool_child(self.processes.running[kind].pid)
                name = f"{socket.gethostname()}:{child}"
                if child and beats.get(name, {}).get("model_loaded"):
                    self.names[index] = name
                    waiting.discard(index)
                    log.info("%s has its model loaded (%s, %s slots)", kind, name, beats[name].get("slots", "?"))
            time.sleep(0.5)
        if waiting:
            raise RuntimeError(f"worker(s) {sorted(waiting)} not loaded after {timeout:.0f} s")

    def check_alive(self) -> None:
        self.processes.check_alive("api")
        for index in self.started():
            if index not in self.killed:
                self.processes.check_alive(f"worker-{index}")

    def kill(self, index: int) -> datetime:
        """SIGKILL the worker's process group (Celery's parent and its pool child) and wait until both are gone, so
        that the rows read afterwards are final for it."""
        process = self.processes.running[f"worker-{index}"]
        child = pool_child(process.pid)
        os.killpg(process.pid, signal.SIGKILL)
        killed_at = datetime.now(timezone.utc)
        self.killed.add(index)
        process.wait(30)
        deadline = time.monotonic() + 30
        while child and not gone(child) and time.monotonic() < deadline:
            time.sleep(0.02)
        return killed_at

    def _stop(self, index: int) -> None:
        process = self.processes.running[f"worker-{index}"]
        if process.poll() is not None:
            return
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(30)

    # -- the rows ---------------------------------------------------------------------------------------------

    def unfinished(self) -> int:
        with Session(self.engine) as session:
            return session.scalar(select(func.count()).select_from(Job).where(Job.status.not_in(JobStatus.FINISHED)))

    def holding(self, name: str) -> dict[str, datetime | None]:
        """The jobs a worker holds now (running under its lease): id -> when the lease expires."""
        with Session(self.engine) as session:
            return {str(i): expires for i, expires in session.execute(
                select(Job.id, Job.lease_expires_at).where(Job.status == JobStatus.RUNNING, Job.lease_owner == name))}

    def rows(self, ids: list[str]) -> list[Any]:
        found: list[Any] = []
        with Session(self.engine) as session:
            for start in range(0, len(ids), 500):
                wanted = [uuid.UUID(i) for i in ids[start:start + 500]]
                found += session.execute(select(
                    Job.id, Job.status, Job.error_code, Job.attempts, Job.batch_id, Job.parent_job_id, Job.adapter,
                    Job.created_at, Job.started_at, Job.finished_at).where(Job.id.in_(wanted))).all()
        return found

    def groups(self, since: datetime, rows: list[Any]) -> dict[Any, ClaimGroup]:
        """The claim groups started since `since`, and any a row points at: every run of the phase's jobs."""
        referenced = {r.batch_id for r in rows if r.batch_id is not None}
        with Session(self.engine) as session:
            groups = {g.id: g for g in session.scalars(select(ClaimGroup).where(ClaimGroup.started_at >= since))}
            missing = list(referenced - set(groups))
            groups.update({g.id: g for g in session.scalars(select(ClaimGroup).where(ClaimGroup.id.in_(missing)))})
        return groups


# -- one phase ----------------------------------------------------------------------------------------------

@dataclass
class Kill:
    """The kill phase's victim, and what it held when it died."""

    index: int
    name: str
    at: datetime | None = None
    held: dict[str, datetime | None] = field(default_factory=dict)  # job id -> its lease's expiry at the kill


@contextmanager
def progress(label: str, total: int) -> Iterator[Callable[[int], None]]:
    """`done` of `total` on a long wait: a bar on a terminal (stderr), a log line every 10 s otherwise."""
    if sys.stderr.isatty():
        with typer.progressbar(length=total, label=label, file=sys.stderr) as bar:
            shown = 0

            def advance(done: int) -> None:
                nonlocal shown
                bar.update(max(0, done - shown))
                shown = max(shown, done)

            yield advance
        return
    last = time.monotonic()

    def report(done: int) -> None:
        nonlocal last
        if time.monotonic() - last >= 10:
            log.info("%s: %d/%d finished", label, done, total)
            last = time.monotonic()

    yield report


def wait_finished(fleet: Fleet, label: str, total: int, timeout_s: float, announcements: Announcements | None = None,
                  kill: Kill | None = None) -> int:
    """Until no job is unfinished (the phase's are the only ones left), killing `kill`'s worker once it holds jobs;
    returns how many were still unfinished at the timeout (0: all done)."""
    deadline = time.monotonic() + timeout_s
    pending = total
    with progress(label, total) as advance:
        while time.monotonic() < deadline:
            if announcements is not None:
                announcements.collect()
            pending = fleet.unfinished()
            advance(total - pending)
            if pending == 0:
                return 0
            fleet.check_alive()
            if kill is not None and kill.at is None and fleet.holding(kill.name):
                kill.at = fleet.kill(kill.index)
                kill.held = fleet.holding(kill.name)
                log.info("worker-%d SIGKILLed holding %d job(s); %d job(s) of the phase unfinished", kill.index,
                         len(kill.held), pending)
            time.sleep(0.05 if kill is not None and kill.at is None else 0.2)
    log.error("%s: %d job(s) unfinished after %.0f s", label, pending, timeout_s)
    return pending


def warm_up(fleet: Fleet, bodies: list[dict[str, Any]], timeout_s: float) -> None:
    """A few jobs before a phase, as the benchmark warms its worker up; left out of every figure."""
    fleet.submit(bodies)
    if wait_finished(fleet, "warm-up", len(bodies), timeout_s):
        raise RuntimeError("the warm-up jobs did not finish")


def _s(later: datetime, earlier: datetime) -> float:
    return round((later - earlier).total_seconds(), 3)


def run_phase(fleet: Fleet, label: str, workers_running: int, bodies: list[dict[str, Any]], timeout_s: float,
              kill: Kill | None = None) -> dict[str, Any]:
    """Submit the workload, wait for it, and check it over the rows: jobs/s from the first job stored to the last
    finished (as the benchmark counts), where each job ended, and exactly once."""
    announcements = Announcements(fleet.processes.redis_url)  # subscribed before the first job can finish
    try:
        since = datetime.now(timezone.utc)
        started = time.perf_counter()
        ids = fleet.submit(bodies)
        log.info("%s: %d jobs submitted", label, len(ids))
        pending = wait_finished(fleet, label, len(ids), timeout_s, announcements, kill)
        wall_s = time.perf_counter() - started
        time.sleep(0.5)  # the last notices
        announcements.collect()
        rows = fleet.rows(ids)
        groups = fleet.groups(since, rows)
    finally:
        announcements.close()
    workers = {name: f"worker-{index}" for index, name in fleet.names.items()}
    finished = [r for r in rows if r.finished_at is not None]
    seconds = _s(max(r.finished_at for r in finished), min(r.created_at for r in rows)) if finished else None
    by_worker = Counter(workers.get(groups[r.batch_id].worker, groups[r.batch_id].worker) for r in finished
                        if r.batch_id in groups)
    if kill is None:
        check = drain_problems(rows, groups, ids, announcements.counts)
    else:
        check = kill_problems(rows, groups, ids, announcements.counts, kill)
    problems = check["problems"]
    figures = {"workers": workers_running, "jobs": len(ids), "pending": pending, "seconds": seconds, "wall_s": round(wall_s, 2),
               "jobs_per_s": round(len(finished) / seconds, 3) if seconds else None,
               "jobs_by_worker": dict(sorted(by_worker.items())), "claim_groups": len(groups),
               "failed": sum(r.status != JobStatus.SUCCEEDED for r in rows),
               "lost": len(set(ids)) - sum(r.status == JobStatus.SUCCEEDED for r in rows),
               "duplicated": max(sum(1 for n in announcements.counts.values() if n > 1),
                                 max(0, problems["runs_minus_jobs"])),
               **check}
    if kill is not None:
        figures["kill"] = kill_figures(rows, groups, since, kill, workers)
    log.info("%s: %s jobs/s, exactly once: %s", label, figures["jobs_per_s"], "yes" if check["exactly_once"] else "NO")
    return figures


def kill_problems(rows: list[Any], groups: dict[Any, Any], accepted: list[str], announced: Counter[str],
                  kill: Kill) -> dict[str, Any]:
    """`drain_problems`, less what the kill explains and no more: a job the killed worker held ran again (attempts
    2, every other job 1) and finished in a survivor's claim group; the killed worker's unfinished groups hold only
    jobs it stored before it died, and count those runs."""
    checked = drain_problems(rows, groups, accepted, announced)
    problems = dict(checked["problems"])
    held = set(kill.held)

    def final_group(row: Any) -> Any:
        return groups.get(row.batch_id)

    stored_before = [r for r in rows if str(r.id) not in held and (g := final_group(r)) is not None
                     and g.finished_at is None and g.worker == kill.name]
    problems.pop("attempts_not_1")
    problems["attempts_not_expected"] = sum(1 for r in rows if r.attempts != (2 if str(r.id) in held else 1))
    problems["in_no_finished_batch"] -= len(stored_before)
    problems["runs_minus_jobs"] += len(stored_before)
    problems["held_not_finished_by_a_survivor"] = sum(
        1 for r in rows if str(r.id) in held and ((g := final_group(r)) is None or g.finished_at is None
                                                  or g.worker == kill.name or r.status != JobStatus.SUCCEEDED))
    problems["unfinished_groups_of_survivors"] = sum(1 for g in groups.values()
                                                     if g.finished_at is None and g.worker != kill.name)
    problems["kill_held_nothing"] = int(not held)
    pending = sum(1 for r in rows if r.status not in JobStatus.FINISHED)
    return {**checked, "stored_by_the_killed_worker_before": len(stored_before), "problems": problems,
            "exactly_once": pending == 0 and not any(problems.values())}


def kill_figures(rows: list[Any], groups: dict[Any, Any], since: datetime, kill: Kill,
                 workers: dict[str, str]) -> dict[str, Any]:
    """When the killed worker's jobs came back: its leases' expiry, their second claim and their last finish, in
    seconds after the kill, and the finish times of the whole phase per worker for the plot. A kill as soon as the
    worker holds jobs finds their leases nearly fresh, so they expire close to one whole lease after it."""
    first = min(r.created_at for r in rows)
    figures: dict[str, Any] = {"worker": f"worker-{kill.index}", "owner": kill.name, "held_jobs": len(kill.held),
                               "after_s": _s(kill.at, first) if kill.at else None}
    held = [r for r in rows if str(r.id) in kill.held]
    expiries = [e for e in kill.held.values() if e is not None]
    if kill.at and expiries:
        figures["lease_expired_s"] = _s(max(expiries), kill.at)
    if kill.at and held and all(r.started_at for r in held):
        figures["claimed_again_s"] = _s(max(r.started_at for r in held), kill.at)
    if kill.at and held and all(r.finished_at for r in held):
        figures["recovery_s"] = _s(max(r.finished_at for r in held), kill.at)
        if "lease_expired_s" in figures:  # the sweep, the wait for a free slot and the run again
            figures["after_expiry_s"] = round(figures["recovery_s"] - figures["lease_expired_s"], 3)
    figures["held_finished_by"] = dict(Counter(workers.get(g.worker, g.worker) for r in held
                                               if (g := groups.get(r.batch_id)) is not None))
    timeline: dict[str, list[float]] = {}
    for r in rows:
        if r.finished_at is not None and (g := groups.get(r.batch_id)) is not None:
            timeline.setdefault(workers.get(g.worker, g.worker), []).append(_s(r.finished_at, first))
    figures["finished_s_by_worker"] = {k: sorted(v) for k, v in sorted(timeline.items())}
    figures["held_finished_s"] = sorted(_s(r.finished_at, first) for r in held if r.finished_at)
    return figures


# -- the run ------------------------------------------------------------------------------------------------

def prepare_model(config: ScaleOutConfig) -> tuple[dict[str, Path], list[Any]]:
    """The random-weight model and the workload, as the benchmark makes them (`run_bench`)."""
    import gc

    import torch
    from transformers import AutoTokenizer

    from modellab.bench.workload import make_jobs
    from modellab.model_factory import build_random_model
    from modellab.presets import ALL_LINEAR
    from shared.settings import Settings

    started = time.perf_counter()
    paths = build_random_model(config.workdir / "model", config.shape, seed=config.seed,
                               dtype=torch.float16 if config.device == "cuda" else torch.float32,
                               device=config.device, target_modules=ALL_LINEAR)
    gc.collect()
    if config.device == "cuda":
        torch.cuda.empty_cache()
    log.info("built a random-weight %s model in %.1f s", config.shape, time.perf_counter() - started)
    settings = Settings(_env_file=None, model={"base": str(paths["base"]), "device": config.device},
                        engine={"ignore_eos": True}, kev={"path": str(paths["kev"])}, laya={"path": str(paths["laya"])})
    jobs = make_jobs(AutoTokenizer.from_pretrained(paths["base"]), settings, count=config.jobs, seed=config.seed,
                     prompt_tokens=config.prompt_tokens, new_tokens=config.new_tokens)
    return paths, jobs


def gpu_names(config: ScaleOutConfig, gpus: list[str]) -> list[str]:
    if config.device != "cuda":
        return []
    import torch

    return [torch.cuda.get_device_name(i) for i in range(min(config.gpus, len(gpus)))]


def run_scale_out(config: ScaleOutConfig, save: Callable[[dict[str, Any]], None] = lambda _result: None,
                  ) -> dict[str, Any]:
    """The three phases; `save` gets the result so far after each (`complete` is False until the end)."""
    started = time.perf_counter()
    gpus = visible_gpus() if config.device == "cuda" else []
    paths, jobs = prepare_model(config)
    settings = service_settings(config, paths)
    database_url = config.database_url or f"sqlite:///{config.workdir / 'service' / 'scale-out.db'}"
    bodies = [job.body() for job in jobs]
    n = config.workers
    result: dict[str, Any] = {
        "complete": False, "device": config.device, "gpus": config.gpus, "workers_per_gpu": config.workers_per_gpu,
        "workers": n, "gpu_names": gpu_names(config, gpus), "shape": config.shape,
        "vram_budget_gb": config.vram_budget_gb if config.device == "cuda" else None,
        "database": make_kind(database_url),
        "workload": {"jobs": config.jobs, "adapters": ["kev", "laya"], "interleaved": True,
                     "prompt_tokens": list(config.prompt_tokens), "new_tokens": config.new_tokens,
                     "greedy": True, "exact_lengths": True, "seed": config.seed, "max_batch": config.max_batch,
                     "prompt_tokens_seen": [min(j.prompt_tokens for j in jobs), max(j.prompt_tokens for j in jobs)]},
        "ledger": ledger_timing(config),
        "service_settings": settings,
        "environment": {k: v for k, v in sorted(os.environ.items()) if k.startswith("KEVLAYA_")
                        and not any(secret in k for secret in ("KEY", "AUTH", "PASSWORD", "URL"))},
        "phases": {}, "load_average": {"start": os.getloadavg()},
    }
    phases = result["phases"]

    def worker_env(index: int) -> dict[str, str]:
        env = {"KEVLAYA_MONITORING__METRICS_PORT": str(free_port())}
        if config.device == "cuda":
            env["CUDA_VISIBLE_DEVICES"] = gpus[index // config.workers_per_gpu]
        return env

    def checkpoint() -> None:
        one, all_ = (phases.get(k, {}).get("jobs_per_s") for k in ("one_worker", "all_workers"))
        result["speedup"] = round(all_ / one, 3) if one and all_ else None
        result["scaling_efficiency"] = round(result["speedup"] / n, 3) if result["speedup"] else None
        result["checks"] = {f"{name}_exactly_once": figures["exactly_once"] for name, figures in phases.items()}
        if "within_lease" in (kill := (phases.get("kill") or {}).get("kill") or {}):
            result["checks"]["kill_claimed_again_within_lease"] = kill["within_lease"]
        result["ok"] = bool(result["checks"]) and all(result["checks"].values())
        result["wall_s"] = round(time.perf_counter() - started, 1)
        save(result)

    with Fleet(config.workdir / "service", settings, config.redis_url, database_url) as fleet:
        log.info("API at %s on %s; %d worker(s) on %s", fleet.client.base_url, result["database"], n,
                 f"GPUs {', '.join(gpus[:config.gpus])}" if config.device == "cuda" else "the CPU")
        fleet.start_worker(0, worker_env(0))
        fleet.wait_loaded([0])
        warm_up(fleet, bodies[:2], config.timeout_s)
        phases["one_worker"] = run_phase(fleet, "phase 1: 1 worker", 1, bodies, config.timeout_s)
        checkpoint()

        for index in range(1, n):
            fleet.start_worker(index, worker_env(index))
        fleet.wait_loaded(list(range(1, n)))
        warm_up(fleet, bodies[:2 * n], config.timeout_s)  # two per worker; which worker takes them is the queue's
        phases["all_workers"] = run_phase(fleet, f"phase 2: {n} workers", n, bodies, config.timeout_s)
        checkpoint()

        if config.kill:
            victim = n - 1
            kill = Kill(victim, fleet.names[victim])
            phases["kill"] = run_phase(fleet, f"phase 3: {n} workers, worker-{victim} killed", n, bodies,
                                       config.timeout_s, kill)
            figures = phases["kill"]["kill"]
            # A lease taken just before the kill expires a whole lease after it, the next sweep puts its job back
            # and wakes a worker, which claims it: "within one lease" is the second claim within a lease, a sweep
            # and a wake-up of the kill.
            bound = result["ledger"]["lease_s"] + result["ledger"]["sweep_every_s"] + WAKE_AND_CLAIM_S
            if "claimed_again_s" in figures:
                figures["lease_and_sweep_s"] = bound
                figures["within_lease"] = figures["claimed_again_s"] <= bound
            checkpoint()
    result["load_average"]["end"] = os.getloadavg()
    result["complete"] = True
    checkpoint()
    return result


# -- the report ---------------------------------------------------------------------------------------------

def _label(name: str, n: int) -> str:
    return PHASES[name].format(n=n)


def table(result: dict[str, Any]) -> str:
    n, phases = result["workers"], result["phases"]
    where = (f"{result['gpus']} GPU(s) × {result['workers_per_gpu']} worker(s) "
             f"({', '.join(result['gpu_names'])}; cap {result['vram_budget_gb']} GiB each)"
             if result["device"] == "cuda" else f"{n} CPU worker(s), torch on one thread each")
    workload = result["workload"]
    lines = [f"scale-out: {result['shape']} on {where}, {result['database']}; {workload['jobs']} jobs a phase (kev "
             f"{workload['new_tokens']['kev']} / laya {workload['new_tokens']['laya']} new tokens, prompts "
             f"{workload['prompt_tokens'][0]}–{workload['prompt_tokens'][1]})",
             f"{'phase':<22}{'jobs/s':>9}{'seconds':>9}{'failed':>8}  {'exactly once':<13}jobs by worker"]
    for name, f in phases.items():
        by_worker = ", ".join(f"{w} {c}" for w, c in f["jobs_by_worker"].items())
        lines.append(f"{_label(name, n):<22}{f['jobs_per_s'] or 0:>9.3f}{f['seconds'] or 0:>9.2f}{f['failed']:>8}  "
                     f"{'yes' if f['exactly_once'] else 'NO':<13}{by_worker}")
        if not f["exactly_once"]:
            lines.append(f"  problems: {', '.join(f'{k} {v}' for k, v in f['problems'].items() if v)}"
                         + (f"; {f['pending']} unfinished" if f["pending"] else ""))
    if result.get("speedup") is not None:
        lines.append(f"speedup, {n} workers over 1: {result['speedup']:.2f}× "
                     f"({result['scaling_efficiency']:.0%} of {n}×)")
    kill = (phases.get("kill") or {}).get("kill")
    if kill and kill["after_s"] is None:
        lines.append(f"kill: {kill['worker']} held no job while the workload ran, so it was not killed")
    elif kill:
        lease = result["ledger"]["lease_s"]
        timing = ", ".join(f"{what} +{kill[key]:.1f} s" for key, what in (
            ("lease_expired_s", "lease expired"), ("claimed_again_s", "claimed again"),
            ("recovery_s", "last finished")) if key in kill)
        verdict = f"yes ({kill['claimed_again_s']:.1f} s)" if kill.get("within_lease") else (
            f"no ({kill['claimed_again_s']:.1f} s)" if "claimed_again_s" in kill else "—")
        lines.append(f"kill: {kill['worker']} SIGKILLed {kill['after_s']:.1f} s into the phase holding "
                     f"{kill['held_jobs']} job(s); {timing or 'none came back'}; finished by "
                     f"{', '.join(f'{w} {c}' for w, c in kill['held_finished_by'].items()) or '—'}")
        after = f", {kill['after_expiry_s']:.1f} s after the lease expired" if "after_expiry_s" in kill else ""
        lines.append(f"kill: the killed worker's jobs claimed again within one lease ({lease:g} s), a sweep and a wake-up of "
                     "the kill: "
                     f"{verdict}{after}; lost {phases['kill']['lost']}, duplicated {phases['kill']['duplicated']}")
    failed = [name for name, ok in result["checks"].items() if not ok]
    lines.append("checks: all passed" if result["ok"] else f"checks FAILED: {', '.join(failed) or 'no phase ran'}")
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    """jobs/s per phase (red: a phase that failed its exactly-once check), and the kill phase's finished jobs over
    time per worker with the kill, one lease after it, and the killed worker's jobs where they finished."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n, phases = result["workers"], result["phases"]
    kill = (phases.get("kill") or {}).get("kill")
    fig, axes = plt.subplots(1, 2 if kill else 1, figsize=(12 if kill else 6, 4.6), squeeze=False)
    bars = axes[0][0]
    names = list(phases)
    bars.bar([_label(p, n) for p in names], [phases[p]["jobs_per_s"] or 0 for p in names],
             color=["#3366cc" if phases[p]["exactly_once"] else "#cc3333" for p in names])
    for x, p in enumerate(names):
        bars.annotate(f"{phases[p]['jobs_per_s'] or 0:.2f}", (x, phases[p]["jobs_per_s"] or 0), ha="center",
                      va="bottom", fontsize="small")
    speedup = f", speedup {result['speedup']:.2f}×" if result.get("speedup") else ""
    bars.set_title(f"{result['shape']}, {result['workload']['jobs']} jobs a phase{speedup}", fontsize="small", loc="left")
    bars.set_ylabel("jobs/s")
    bars.grid(axis="y", alpha=0.3)
    if kill:
        timeline = axes[0][1]
        for worker, times in kill["finished_s_by_worker"].items():
            timeline.step(times, range(1, len(times) + 1), where="post", label=worker)
        if kill.get("after_s") is not None:
            lease = result["ledger"]["lease_s"]
            timeline.axvline(kill["after_s"], color="#cc3333", label=f"{kill['worker']} killed")
            timeline.axvspan(kill["after_s"], kill["after_s"] + lease, color="#cc3333", alpha=0.08,
                             label=f"one lease ({lease:g} s)")
        for t in kill["held_finished_s"]:
            timeline.axvline(t, color="#888888", linestyle=":", linewidth=0.8)
        timeline.set_title(f"{_label('kill', n)}: jobs finished per worker (dotted: the killed worker's "
                           f"{kill['held_jobs']} job(s))", fontsize="small", loc="left")
        timeline.set_xlabel("seconds since the phase's first job")
        timeline.set_ylabel("jobs finished")
        timeline.legend(fontsize="small")
        timeline.grid(alpha=0.3)
    fig.suptitle(f"kevlaya scale-out on {result['device']}: {n} workers, checks "
                 f"{'passed' if result['ok'] else 'FAILED'}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
