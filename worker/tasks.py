"""Celery glue: the model is loaded once in the worker child; each wake-up message drains the queue.

The message only says "there is work"; what runs is decided by the scheduler from the database."""

from __future__ import annotations

import logging
import threading
import time

from celery.exceptions import Reject
from celery.signals import setup_logging, worker_process_init, worker_process_shutdown

from shared import lifecycle
from shared.adapter_assignments import desired
from shared.adapter_identity import AdapterIdentity
from shared.adapter_versions import record_loaded
from shared.db import reset_engine, write_scope
from shared.heartbeat import beat
from shared.logs import configure_logging
from shared.queue import RUN_TASK, celery_app, publish_wakeup
from shared.settings import ADAPTERS, Settings, get_settings
from worker.engine.loop import Engine
from worker.ledger.claims import dead_owners_here, stale_queued_adapters, worker_name
from worker.metrics import METRICS, serve_metrics

log = logging.getLogger("kevlaya.worker")
app = celery_app()

_engine: Engine | None = None
_load_error: str | None = None
_unrecorded: list[AdapterIdentity] = []  # versions loaded but not in `adapter_versions` yet (the database was down)
_stop = threading.Event()


@setup_logging.connect
def _configure_logging(loglevel: int | str | None = None, **_kwargs: object) -> None:
    """Our format (text or JSON, KEVLAYA_MONITORING__LOG_FORMAT) instead of Celery's; the child inherits it."""
    configure_logging(get_settings().monitoring.log_format, loglevel or logging.INFO)


@worker_process_init.connect
def _load_model(sender: str | None = None, **_kwargs: object) -> None:
    """Runs in the forked child: CUDA and database connections must be created here, never in the parent.

    Celery waits `worker_proc_alive_timeout` (KEVLAYA_RELIABILITY__MODEL_LOAD_TIMEOUT_S) for this to return."""
    global _engine, _load_error
    reset_engine()
    settings = get_settings()
    _requeue_predecessors(settings)
    threading.Thread(target=_background_loop, name="heartbeat-sweeper", daemon=True).start()
    try:
        from worker.model.loading import load_model  # torch is imported only in the worker child

        _engine = Engine(load_model(settings), settings)
        log.info("engine ready: %d slot(s) of %d tokens on %s", _engine.decoder.limit, _engine.decoder.window,
                 _engine.loaded.device)
        METRICS.model_loaded.set(1)
        METRICS.adapters_loaded(_engine.loaded.versions.values())
        _unrecorded.extend(_engine.loaded.versions.values())
        _record_versions()
    except Exception as exc:
        _load_error = f"{exc.__class__.__name__}: {exc}"
        log.exception("model load failed; this worker stops taking wake-ups, so workers that can serve get them")
    _beat(settings)  # readiness follows the load now, not a heartbeat interval later
    serve_metrics(settings)
    if sender:
        threading.Thread(target=_consume_jobs, args=(sender, _engine is not None), name="consumer-control",
                         daemon=True).start()


def _requeue_predecessors(settings: Settings) -> None:
    """A child that starts after a killed one (or a worker restarted after a crash) gives the jobs the dead
    process held back to the queue at once, instead of leaving them to wait out their leases."""
    try:
        with write_scope() as session:
            requeued = lifecycle.requeue_dead_owners(session, dead_owners_here(session),
                                                     settings.reliability.max_attempts)
    except Exception as exc:  # the database may be down: their leases lapse and the sweeper re-queues them
        log.warning("could not look for jobs of dead processes: %s", exc)
        return
    if requeued:
        log.warning("re-queued %d job(s) that a process of this host held when it died", len(requeued))
        for adapter in ADAPTERS:
            publish_wakeup(None, adapter)


def _consume_jobs(node: str, consume: bool) -> None:
    """Make this worker's main process consume the job queue only while its child has a model.

    Messages are fetched by the main process, so the child asks it by remote control; it retries until the
    main process answers, since its consumer may still be starting when a fast failure gets here."""
    queue = app.conf.task_default_queue
    while not _stop.is_set():
        try:
            if consume:
                replies = app.control.add_consumer(queue, destination=[node], reply=True, timeout=2)
            else:
                replies = app.control.cancel_consumer(queue, destination=[node], reply=True, timeout=2)
        except Exception as exc:  # the broker may be down; keep trying
            log.warning("could not reach this worker's consumer: %s", exc)
            replies = None
        if replies:
            log.info("%s: %s", node, "consuming %s" % queue if consume else "stopped consuming %s" % queue)
            return
        _stop.wait(1)


@worker_process_shutdown.connect
def _stop_background(**_kwargs: object) -> None:
    _stop.set()


def _record_versions() -> None:
    """Record the loaded adapter versions (docs/architecture.md §10); one the database refused is tried again at the
    next sweep. Jobs store their version meanwhile: `jobs.adapter_version` is a plain column."""
    if not _unrecorded:
        return
    try:
        with write_scope() as session:
            record_loaded(session, list(_unrecorded))
    except Exception as exc:  # the database may be down for a while; the sweep tries again
        log.warning("adapter versions not recorded yet: %s", exc)
        return
    _unrecorded.clear()


def sweep() -> None:
    """Repair the job ledger (expired leases, parents left waiting on a finished stage, running jobs without a
    lease) and re-publish wake-ups that were lost (e.g. Redis restarted)."""
    settings = get_settings()
    _record_versions()
    with write_scope() as session:
        repaired = lifecycle.repair(session, settings.reliability.max_attempts)
        stale = stale_queued_adapters(session, older_than_s=settings.reliability.sweep_interval_s)
        wanted = desired(session)
    if repaired.requeued:
        log.warning("re-queued %d job(s) whose lease expired or that held none", len(repaired.requeued))
    if _engine is not None and not _engine.draining.is_set():
        # an idle engine follows an adapter change at its next drain: one whose wake-up was lost gets one here
        following = dict(_engine.adapters.generations)
        changed = {role for role, state in wanted.items() if state.generation != following.get(role, 0)}
        held = _engine.adapters.held()
        for adapter in (set(stale) - held) | {a for a in ADAPTERS if repaired.requeued} | changed:
            publish_wakeup(None, adapter)


def _background_loop() -> None:
    """Heartbeat and sweep on a timer, beside the engine's loop (tasks run one at a time in this process)."""
    settings = get_settings()
    interval = min(settings.reliability.sweep_interval_s, settings.reliability.heartbeat_ttl_s / 3)
    while True:
        _beat(settings)
        try:
            sweep()
        except Exception as exc:  # the database may be down for a while; keep trying
            log.warning("sweep failed: %s", exc)
        if _stop.wait(interval):
            return


def _beat(settings: Settings) -> None:
    try:
        beat(worker_name(), _status(), settings.reliability.heartbeat_ttl_s)
    except Exception as exc:  # Redis may be down for a while; the next beat tries again
        log.warning("heartbeat failed: %s", exc)


def _status() -> dict[str, object]:
    memory = METRICS.memory_snapshot(get_settings().engine.vram_budget_gb)
    if _engine is None:
        return {"model_loaded": False, "error": _load_error, "memory": memory}
    return {
        "model_loaded": True,
        "memory": memory,
        "device": _engine.loaded.device,
        "unavailable_adapters": {**_engine.loaded.unavailable, **_engine.adapters.blocked},
        "unloaded_adapters": sorted(_engine.adapters.unloaded),
        "draining": _engine.draining.is_set(),
        "slots": _engine.decoder.limit,  # every adapter is served at once; what counts is the slots
        "window_tokens": _engine.decoder.window,
    }


@app.task(name=RUN_TASK, acks_late=True)
def run_queued(job_id: str | None, adapter: str) -> int:
    """Wake-up for job `job_id` on `adapter`: serve jobs (not only that job) until the queue is empty."""
    if _engine is None:
        # This worker has stopped consuming (or is about to): give the wake-up back for one that can serve it.
        # The pause keeps a message that comes straight back here from spinning before the cancel lands.
        time.sleep(1)
        raise Reject(f"model not loaded: {_load_error}", requeue=True)
    return _engine.drain(get_settings().reliability.drain_seconds)
