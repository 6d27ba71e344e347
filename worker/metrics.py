"""The worker's own Prometheus registry and its structured log lines, one per claim group and one per job.

The worker child serves the registry on `KEVLAYA_MONITORING__METRICS_PORT` once its model is loaded
(docs/operations.md: Monitoring). Nothing here imports torch at module level: the Celery parent imports this
module too."""

from __future__ import annotations

import logging
import sys
from datetime import datetime
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, start_http_server

from shared.logs import FIELDS
from shared.models import JobStatus
from shared.settings import ADAPTERS, Settings

if TYPE_CHECKING:
    from collections.abc import Iterable

    from shared.adapter_identity import AdapterIdentity
    from shared.lifecycle import JobOutcome
    from shared.models import ClaimGroup, Job
    from worker.generation import GenerationResult
    from worker.ledger.claims import GroupFigures

log = logging.getLogger("kevlaya.worker")
events = logging.getLogger("kevlaya.events")  # the structured lines: one per claim group, one per job

ERROR_CODES = ("out_of_memory", "numerical_error", "invalid_output", "length", "invalid_input", "adapter_unavailable",
               "internal")
_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
_PHASE = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
ENGINE_PHASES = ("claim", "prefill", "step", "wait", "store")
_PER_TOKEN = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.2)


class WorkerMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.queue_wait = Histogram("kevlaya_job_queue_wait_seconds", "From submission to the claim into a slot",
                                    ["adapter"], buckets=_SECONDS, registry=r)
        self.ttft = Histogram("kevlaya_job_time_to_first_token_seconds", "From submission to the job's first token",
                              ["adapter"], buckets=_SECONDS, registry=r)
        self.tpot = Histogram("kevlaya_job_time_per_output_token_seconds",
                              "Decode time per output token after the first", ["adapter"], buckets=_PER_TOKEN,
                              registry=r)
        self.end_to_end = Histogram("kevlaya_job_end_to_end_seconds", "From submission to the stored result",
                                    ["adapter"], buckets=_SECONDS, registry=r)
        self.jobs = Counter("kevlaya_jobs_finished", "Jobs run to a final status", ["adapter", "status"], registry=r)
        self.failures = Counter("kevlaya_job_failures", "Failed jobs by error code", ["adapter", "code"], registry=r)
        self.completion_tokens = Counter("kevlaya_completion_tokens", "Tokens generated", ["adapter"], registry=r)
        self.groups = Counter("kevlaya_claim_groups", "Claim groups (jobs claimed together into free slots), by "
                              "adapter", ["adapters"], registry=r)
        self.group_size = Histogram("kevlaya_claim_group_size", "Jobs per claim group", ["adapters"],
                                    buckets=(1, 2, 4, 8, 16, 32, 64, 128), registry=r)
        self.oom_give_backs = Counter("kevlaya_oom_give_backs", "Jobs given back to the queue unrun after an "
                                      "out-of-memory in a step or a prefill", registry=r)
        self.numerical = Counter("kevlaya_numerical_aborts", "Rows stopped for NaN/Inf logits", ["adapter"],
                                 registry=r)
        self.escalations = Counter("kevlaya_escalations", "auto jobs Laya was unsure of, sent to Kev", registry=r)
        self.engine_phase = Histogram(
            "kevlaya_engine_phase_seconds", "Continuous engine, time per phase: claim (look at the queue, claim, "
            "tokenise), prefill (one prompt group), step (one decode step), wait (of a step: the host waiting for the "
            "GPU's tokens; near none when the host, not the GPU, bounds the steps), store (one transaction of "
            "results, on the writer thread)", ["phase"], buckets=_PHASE, registry=r)
        self.steps = Counter("kevlaya_engine_steps", "Decode steps launched (each over every row in flight)",
                             registry=r)
        self.rows_in_flight = Gauge("kevlaya_rows_in_flight", "Jobs holding a slot now", registry=r)
        self.up = Gauge("kevlaya_worker_up", "1 while this worker process serves", registry=r)
        self.model_loaded = Gauge("kevlaya_worker_model_loaded", "1 when the model and adapters are loaded",
                                  registry=r)
        # The version as an info metric's labels, one series per adapter: as a label of the job metrics it would
        # multiply their series at every new version.
        self.adapter = Info("kevlaya_adapter", "The adapter version each adapter serves: its weights' sha256 and the "
                            "base it was checked against", ["adapter"], registry=r)
        self.memory = {
            kind: Gauge(f"kevlaya_gpu_memory_{kind}_bytes", help_, registry=r)
            for kind, help_ in (("allocated", "GPU memory held by tensors (0 on a CPU)"),
                                ("reserved", "GPU memory held by the allocator (0 on a CPU)"),
                                ("peak", "Most GPU memory allocated so far (0 on a CPU)"),
                                ("budget", "The VRAM budget this worker caps itself to "
                                           "(KEVLAYA_ENGINE__VRAM_BUDGET_GB)"))
        }
        # Known label values start at zero, so a rate() or a dashboard panel has a series before the first event.
        for adapter in ADAPTERS:
            for histogram in (self.queue_wait, self.ttft, self.tpot, self.end_to_end):
                histogram.labels(adapter)
            self.completion_tokens.labels(adapter)
            self.numerical.labels(adapter)
            for status in (JobStatus.SUCCEEDED, JobStatus.FAILED):
                self.jobs.labels(adapter, status)
            for code in ERROR_CODES:
                self.failures.labels(adapter, code)
            self.groups.labels(adapter)
            self.group_size.labels(adapter)
        for phase in ENGINE_PHASES:
            self.engine_phase.labels(phase)
        self.up.set(1)

    # -- memory ------------------------------------------------------------------------------------------------

    def memory_snapshot(self, budget_gb: float) -> dict[str, int]:
        """Current GPU memory of this process; zeros on a CPU. torch only where the worker child loaded it."""
        figures = {"allocated_bytes": 0, "reserved_bytes": 0, "peak_bytes": 0, "budget_bytes": int(budget_gb * 2**30)}
        torch = sys.modules.get("torch")
        try:
            if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
                figures.update(allocated_bytes=torch.cuda.memory_allocated(),
                               reserved_bytes=torch.cuda.memory_reserved(),
                               peak_bytes=torch.cuda.max_memory_allocated())
        except (AttributeError, RuntimeError):  # torch still importing in the loading thread: no figures yet
            pass
        for kind, value in figures.items():
            self.memory[kind.removesuffix("_bytes")].set(value)
        return figures

    def adapters_loaded(self, adapters: Iterable[AdapterIdentity]) -> None:
        for adapter in adapters:
            self.adapter.labels(adapter.name).info({"sha256": adapter.sha256, "base": adapter.base})

    # -- jobs and claim groups ----------------------------------------------------------------------------------

    def job_finished(self, job: Job, outcome: JobOutcome, result: GenerationResult | None, now: datetime) -> None:
        """A job stored with its outcome at `now` (the database's clock, as its timestamps); `result` is the
        generation behind it, None when it failed before it reached the model. An `auto` job sent on to Kev counts
        as its Laya stage, as /v1/stats counts it."""
        if result is None:
            self._job(job, outcome.status, outcome.error_code, None, None, None, None, now)
            return
        self._job(job, outcome.status, outcome.error_code, result.first_token_ms, result.decode_ms,
                  result.prompt_tokens, result.completion_tokens, now)

    def group_closed(self, group: ClaimGroup, size: int, figures: GroupFigures, *, escalated: int,
                     lost: int) -> None:
        """A claim group whose every job has been stored."""
        self.groups.labels(group.adapters).inc()
        self.group_size.labels(group.adapters).observe(size)
        self.escalations.inc(escalated)
        events.info("claim group finished", extra={FIELDS: {
            "event": "claim_group", "batch_id": str(group.id), "adapter": group.adapters, "size": size,
            "prefill_ms": round(figures.prefill_ms, 3), "decode_ms": round(figures.decode_ms, 3),
            "tokens": figures.tokens, "peak_vram_bytes": figures.peak_vram_bytes, "escalated": escalated,
            "lost_leases": lost, "worker": group.worker,
        }})
        if figures.peak_vram_bytes is not None:
            self.memory["peak"].set(figures.peak_vram_bytes)

    def _job(self, job: Job, status: str, error_code: str | None, first_token_ms: float | None,
             decode_ms: float | None, prompt_tokens: int | None, completion_tokens: int | None,
             now: datetime) -> None:
        adapter = job.adapter
        queue_s = (job.started_at - job.created_at).total_seconds() if job.started_at else None
        ttft_s = queue_s + first_token_ms / 1000 if queue_s is not None and first_token_ms is not None else None
        total_s = (now - job.created_at).total_seconds()
        if queue_s is not None:
            self.queue_wait.labels(adapter).observe(queue_s)
        if ttft_s is not None:
            self.ttft.labels(adapter).observe(ttft_s)
        if decode_ms is not None and completion_tokens and completion_tokens > 1:
            self.tpot.labels(adapter).observe(decode_ms / 1000 / (completion_tokens - 1))
        self.end_to_end.labels(adapter).observe(total_s)
        self.jobs.labels(adapter, status).inc()
        if completion_tokens:
            self.completion_tokens.labels(adapter).inc(completion_tokens)
        if error_code:
            self.failures.labels(adapter, error_code).inc()
            if error_code == "numerical_error":
                self.numerical.labels(adapter).inc()
        fields: dict[str, Any] = {
            "event": "job", "job_id": str(job.id), "batch_id": str(job.batch_id) if job.batch_id else None,
            "parent_job_id": str(job.parent_job_id) if job.parent_job_id else None, "adapter": adapter,
            "requested_adapter": job.requested_adapter, "status": status, "error_code": error_code,
            "attempts": job.attempts, "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "queue_ms": None if queue_s is None else round(queue_s * 1000, 3),
            "ttft_ms": None if ttft_s is None else round(ttft_s * 1000, 3),
            "decode_ms": None if decode_ms is None else round(decode_ms, 3),
            "total_ms": round(total_s * 1000, 3),
        }
        events.info("job finished", extra={FIELDS: fields})


METRICS = WorkerMetrics()


def serve_metrics(settings: Settings) -> None:
    """Start the worker's /metrics server (in the worker child, after the model loads); port 0 disables it."""
    if settings.monitoring.metrics_port == 0:
        return
    try:
        start_http_server(settings.monitoring.metrics_port, addr=settings.monitoring.metrics_host,
                          registry=METRICS.registry)
    except OSError as exc:  # jobs matter more than metrics: keep serving without them
        log.error("worker metrics not served on %s:%d: %s", settings.monitoring.metrics_host,
                  settings.monitoring.metrics_port, exc)
        return
    log.info("worker metrics on http://%s:%d/metrics", settings.monitoring.metrics_host,
             settings.monitoring.metrics_port)
