"""`/v1/stats`: service statistics over a window, and the live state the status page polls (admin keys only)."""

from __future__ import annotations

from datetime import timedelta
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query

from api.http.deps import SessionDep, SettingsDep, reject_unknown_query_parameters
from api.http.errors import AUTH_ERRORS, ApiError, error_responses
from api.keys.auth import AdminKey
from shared.clock import db_now
from shared.heartbeat import live_workers
from shared.stats import Window, compute_stats, parse_window, queue_depth, recent_batches

router = APIRouter(prefix="/v1/stats", tags=["stats"], dependencies=[Depends(reject_unknown_query_parameters)])

# How far back the live timeline reaches.
TIMELINE = timedelta(minutes=5)


@router.get("", responses=error_responses(403, 422, *AUTH_ERRORS))
def get_stats(_key: AdminKey, session: SessionDep, settings: SettingsDep,
              window: Annotated[str, Query(description="30s, 15m, 2h, 1d: a whole number and a unit",
                                           max_length=16)] = "15m") -> dict[str, Any]:
    """Per adapter: jobs by status, latency percentiles (continuous, as `percentile_cont`), tokens/s, batches,
    failures by code; and the `auto` escalation rate. Jobs created and batches started in the window."""
    try:
        length = parse_window(window)
    except ValueError as exc:
        raise ApiError(422, "invalid_request", f"window: {exc}") from exc
    stats = compute_stats(session, Window.last(length, db_now(session)), settings.engine.max_batch)
    return {"window_name": window, **stats}


@router.get("/live", responses=error_responses(403, 422, *AUTH_ERRORS))
def get_live(_key: AdminKey, session: SessionDep) -> dict[str, Any]:
    """What the status page redraws every few seconds: queue depth, recent batches, workers' heartbeats."""
    now = db_now(session)
    try:
        workers = live_workers()
    except Exception:  # Redis down: the database figures still help
        workers = None
    return {
        "now": now.isoformat(),
        "queue_depth": queue_depth(session),
        "batches": recent_batches(session, now - TIMELINE),
        "timeline_seconds": TIMELINE.total_seconds(),
        "workers": workers,
    }
