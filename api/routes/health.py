"""Liveness and readiness; no authentication."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from sqlalchemy import text

from shared.db import new_session
from shared.heartbeat import live_workers

router = APIRouter(tags=["health"])


@router.get("/healthz")
def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz")
def readyz() -> JSONResponse:
    """Ready = the database answers, Redis answers, and a worker with its model loaded is alive."""
    checks: dict[str, str] = {}
    try:
        with new_session() as session:
            session.execute(text("SELECT 1"))
        checks["database"] = "ok"
    except Exception as exc:  # any driver error means not ready
        checks["database"] = f"error: {exc.__class__.__name__}: {exc}"
    try:
        workers = live_workers()
        checks["redis"] = "ok"
        loaded = [name for name, info in workers.items() if info.get("model_loaded")]
        checks["worker"] = "ok" if loaded else "no worker with a loaded model has reported in"
    except Exception as exc:
        checks["redis"] = f"error: {exc.__class__.__name__}: {exc}"
        checks["worker"] = "unknown (redis unavailable)"
    ready = all(v == "ok" for v in checks.values())
    return JSONResponse(status_code=200 if ready else 503,
                        content={"status": "ready" if ready else "not_ready", "checks": checks})
