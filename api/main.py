"""Builds the FastAPI app: each package's routers, the error handlers, the body-size limit and the request metrics,
the process's intake (prompt budget, job writer), key cache, throttle, file store and batch keeper, and the OpenAPI
schema with the configured bounds."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi.telemetry import TelemetryConfig

from api.batch import routes as batches
from api.batch.keeper import BatchKeeper
from api.batch.lines import fields_of
from api.files import routes as files
from api.files.store import FileStore
from api.http.body_limit import BodySizeLimit
from api.http.docs import install_docs
from api.http.errors import install_error_handlers
from api.jobs import routes as jobs
from api.jobs.intake import Intake
from api.jobs.prompt_budget import PromptBudget
from api.jobs.wakeups import WakeupPublisher
from api.jobs.writer import JobWriter
from api.jobs.writer_process import WriterProcess
from api.keys.auth import KeyCache
from api.keys.throttle import AuthThrottle
from api.openai import models
from api.openai.chat import routes as chat
from api.openai.responses import routes as responses
from api.ops import adapters, health, metrics, stats, status_page
from api.ops.metrics import ApiMetrics, RequestMetrics
from api.streams.follow import reader
from api.streams.notices import notices
from shared.collector import settled_collector
from shared.settings import Settings, get_settings


def _bound(node: dict[str, Any], kind: str, **bounds: Any) -> None:
    """Add `bounds` to the `kind` branch of a schema (a plain schema or an anyOf of it and null)."""
    for branch in node.get("anyOf", [node]):
        if branch.get("type") == kind:
            branch.update(bounds)


def _with_configured_bounds(schema: dict[str, Any], settings: Settings) -> dict[str, Any]:
    """Limits that come from settings, written into the schema so it tells the real bounds."""
    components = schema["components"]["schemas"]
    _bound(components["JobParams"]["properties"]["max_new_tokens"], "integer",
           maximum=settings.limits.max_new_tokens)
    for field in ("max_tokens", "max_completion_tokens"):
        _bound(components["ChatRequest"]["properties"][field], "integer", maximum=settings.limits.max_new_tokens)
    _bound(components["ResponsesRequest"]["properties"]["max_output_tokens"], "integer",
           maximum=settings.limits.max_new_tokens)
    _bound(components["JobCreate"]["properties"]["input"], "string", maxLength=settings.limits.prompt_chars)
    _bound(components["Message"]["properties"]["content"], "string", maxLength=settings.limits.prompt_chars)
    components["JobBatchCreate"]["properties"]["jobs"]["maxItems"] = settings.limits.batch_submit
    for parameter in schema["paths"]["/v1/jobs/{job_id}/wait"]["get"]["parameters"]:
        if parameter["name"] == "timeout":
            _bound(parameter["schema"], "number", maximum=settings.limits.wait_timeout_s)
    schema["info"]["description"] = (
        f"Prompts are limited to {settings.limits.prompt_chars} characters and, with the adapter's system prompt "
        f"and max_new_tokens, to the model's context; request bodies to {settings.limits.body_bytes} bytes. "
        "Every error answer is `{\"error\": {\"code\", \"message\"}}`."
    )
    return schema


def telemetry_config() -> TelemetryConfig | None:
    """FastAPI's OpenTelemetry bridge asks on every request whether a tracer, meter or logger provider is set up.
    Here one only ever is by FastAPI's own auto-configuration (FASTAPI_OTEL_AUTO_CONFIGURE=true, with the
    OpenTelemetry SDK installed): without it the answer is always no, so it is given once instead of per request
    (the API's own metrics are Prometheus', api/ops/metrics.py). None: FastAPI's defaults."""
    if os.getenv("FASTAPI_OTEL_AUTO_CONFIGURE", "").lower() == "true":
        return None
    return {"tracing": False, "metrics": False, "logs": False, "operation_spans": False}


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    with settled_collector():
        writer = app.state.intake.writer
        if isinstance(writer, WriterProcess):
            await writer.start()  # a child that cannot start shows in the log now, not at the first submit
        app.state.batch_keeper.start()
        yield
        app.state.batch_keeper.stop()
        await notices.close()  # the long-polls' Redis subscription
        await reader.close()  # the event streams' reader
        # What was handed to the writer is stored, and what was stored gets its wake-up before the process ends.
        await writer.aclose(30.0)


def create_app() -> FastAPI:
    settings = get_settings()
    app = FastAPI(
        lifespan=_lifespan,
        title="kevlaya",
        version="0.1.0",
        summary="Decision jobs for two LoRA roles (Kev, Laya) on one shared base model.",
        docs_url=None,  # served by install_docs, with local assets
        redoc_url=None,
        telemetry=telemetry_config(),
    )
    install_docs(app)
    install_error_handlers(app)
    routers = [health.router, jobs.router, chat.router, responses.router, files.router, batches.router,
               models.router, adapters.router, stats.router, metrics.router, status_page.router]
    for router in routers:
        app.include_router(router)
    # Uploads are streamed to disk by their route, so they get a limit of their own (their form's few fields
    # on top of the file) and are never held in memory here.
    app.add_middleware(BodySizeLimit, max_bytes=settings.limits.body_bytes,
                       streamed={"/v1/files": settings.batch.files_max_bytes + 64 * 1024})
    app.state.metrics = ApiMetrics()
    app.state.metrics.start_at_zero([*app.routes, *(route for router in routers for route in router.routes)])
    app.add_middleware(RequestMetrics, metrics=app.state.metrics)  # outermost: refused bodies count too
    # Loaded once per app (not at import): counting prompt tokens at submit time needs the tokenizer.
    on_unit = app.state.metrics.note_unit
    writer = (WriterProcess(on_unit) if settings.api.writer == "process"
              else JobWriter(WakeupPublisher(settings.engine.max_batch), on_unit))
    app.state.intake = Intake(settings, PromptBudget.load(settings), writer)
    app.state.key_cache = KeyCache()
    app.state.auth_throttle = AuthThrottle()
    app.state.file_store = FileStore(settings.batch.files_dir)
    intake = app.state.intake
    app.state.batch_keeper = BatchKeeper(settings, app.state.file_store,
                                         lambda job: intake.check(job, names=fields_of(job)))

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
            app.openapi_schema = _with_configured_bounds(schema, settings)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app
