"""The API's Prometheus metrics: its own requests, plus what it can read at scrape time (queue depth from the
database, workers from their heartbeats), and `GET /metrics` that serves them (no key, like /readyz: counts only, no
hosts or contents). Generation figures live in the worker's registry, never here.

Each app has its own registry, so building several apps in one process (tests) registers nothing twice."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from fastapi import APIRouter, Request, Response
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from shared.db import new_session
from shared.heartbeat import live_workers
from shared.stats import queue_depth

log = logging.getLogger("kevlaya.api")
router = APIRouter(tags=["health"])

UNMATCHED = "unmatched"  # any path no route serves: one label value, not one per path a scanner tries


class LiveStateCollector(Collector):
    """Read at every scrape: queued jobs per adapter, and the workers whose heartbeat is live."""

    def collect(self) -> Iterable[Metric]:
        depth = GaugeMetricFamily("kevlaya_queue_depth", "Jobs queued, per adapter (from the database)",
                                  labels=["adapter"])
        try:
            with new_session() as session:
                for adapter, count in queue_depth(session).items():
                    depth.add_metric([adapter], count)
        except Exception as exc:  # a scrape must answer even while the database is down
            log.warning("metrics: queue depth unavailable: %s", exc)
        yield depth

        up = GaugeMetricFamily("kevlaya_workers_up", "Workers with a live heartbeat")
        loaded = GaugeMetricFamily("kevlaya_workers_model_loaded", "Workers with a live heartbeat and the model loaded")
        try:
            workers = live_workers()
        except Exception as exc:
            log.warning("metrics: worker heartbeats unavailable: %s", exc)
            workers = {}
        up.add_metric([], len(workers))
        loaded.add_metric([], sum(1 for info in workers.values() if info.get("model_loaded")))
        yield up
        yield loaded


class ApiMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        self.requests = Counter("kevlaya_http_requests", "HTTP requests answered",
                                ["method", "route", "status"], registry=self.registry)
        self.latency = Histogram("kevlaya_http_request_duration_seconds", "Time to answer an HTTP request",
                                 ["method", "route"], registry=self.registry,
                                 buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120))
        # The job writer's units (api/jobs/writer.py): every submit of a unit waits for its one commit, so a
        # database that is slow to make a commit durable (a storage flush stall) shows here as well as in the
        # submit latency above.
        self.unit_submits = Histogram("kevlaya_submit_unit_submits", "Submits stored by one commit of the job writer",
                                      registry=self.registry, buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512))
        self.unit_write = Histogram("kevlaya_submit_write_seconds",
                                    "Time the database took to insert and commit one unit of submits",
                                    registry=self.registry,
                                    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5))
        self.registry.register(LiveStateCollector())

    def note_unit(self, submits: int, write_s: float) -> None:
        self.unit_submits.observe(submits)
        self.unit_write.observe(write_s)

    def start_at_zero(self, routes: Iterable[object]) -> None:
        """A latency series that first appears after its first request loses that request to rate(), and a
        dashboard panel over a quiet route stays empty: every (method, route) the app serves is there at 0."""
        for route in routes:
            for method in sorted(getattr(route, "methods", None) or ()):
                if method != "HEAD":
                    self.latency.labels(method, route.path)  # type: ignore[attr-defined]


def _route_template(scope: Scope) -> str:
    """The matched route's path template (`/v1/jobs/{job_id}`), so ids do not become label values."""
    route = scope.get("route")
    if route is not None and getattr(route, "path", None):
        return route.path
    app = scope.get("app")
    for candidate in getattr(getattr(app, "router", None), "routes", []):
        match, _ = candidate.matches(scope)
        if match == Match.FULL and getattr(candidate, "path", None):
            return candidate.path
    return UNMATCHED


class RequestMetrics:
    """ASGI middleware: counts every answer by route template and status, and times it."""

    def __init__(self, app: ASGIApp, metrics: ApiMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500  # an exception that escapes everything is a 500 for the client

        async def send_and_note(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            route = _route_template(scope)
            self.metrics.requests.labels(scope["method"], route, str(status)).inc()
            self.metrics.latency.labels(scope["method"], route).observe(time.perf_counter() - started)


@router.get("/metrics", response_class=Response,
            responses={200: {"content": {"text/plain": {}}, "description": "Prometheus text exposition"}})
def metrics(request: Request) -> Response:
    return Response(generate_latest(request.app.state.metrics.registry), media_type=CONTENT_TYPE_LATEST)
