"""Liveness and readiness; no authentication, so the answers name no hosts, ports or paths."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from sqlalchemy import text

from shared.db import new_session
from shared.heartbeat import live_workers
from shared.settings import ADAPTERS

router = APIRouter(tags=["health"])
log = logging.getLogger("kevlaya.api")


class Readiness(BaseModel):
    status: str
    checks: dict[str, str]


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


def adapters_check(workers: dict[str, dict[str, Any]]) -> str:
    """'ok' when every adapter is served by some worker with its model loaded; else which are refused."""
    loaded = [info for info in workers.values() if info.get("model_loaded")]
    refused = [name for name in ADAPTERS
               if all(name in (info.get("unavailable_adapters") or {}) for info in loaded)]
    if not loaded:
        return "unknown (no worker with a loaded model)"
    if refused:
        # The reasons (file paths, verification details) are in the worker's log and heartbeat.
        return f"refused by every worker: {', '.join(refused)}"
    return "ok"


@router.get("/readyz", response_model=Readiness, responses={503: {"model": Readiness, "description": "Not ready"}})
def readyz() -> JSONResponse:
    """Ready = the database answers, Redis answers, a worker with its model loaded is alive, and every adapter
    is served by one."""
    checks: dict[str, str] = {}
    try:
        with new_session() as session:
            session.execute(text("SELECT 1"))
        checks["database"] = "ok"
    except Exception as exc:  # any driver error means not ready
        log.warning("readiness: database unavailable: %s", exc)
        checks["database"] = "unavailable"
    try:
        workers = live_workers()
        checks["redis"] = "ok"
        loaded = [name for name, info in workers.items() if info.get("model_loaded")]
        checks["worker"] = "ok" if loaded else "no worker with a loaded model has reported in"
        checks["adapters"] = adapters_check(workers)
    except Exception as exc:
        log.warning("readiness: redis unavailable: %s", exc)
        checks["redis"] = "unavailable"
        checks["worker"] = checks["adapters"] = "unknown (redis unavailable)"
    ready = all(v == "ok" for v in checks.values())
    return JSONResponse(status_code=200 if ready else 503,
                        content={"status": "ready" if ready else "not_ready", "checks": checks})
