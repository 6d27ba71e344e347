"""Service statistics over a time window, computed in SQL from the stored job and batch rows.

Which rows: jobs created in the window, batches started in it. A *run* is one job on one adapter: a kev or
laya job, an `auto` job that Laya answered alone, and each stage of an escalated `auto` job; the escalated
parent itself is not a run (its stages are), so no generation is counted twice.

Percentiles are continuous, as PostgreSQL's `percentile_cont`: of n values sorted ascending v[1..n], the p-th
is at position h = 1 + p·(n−1), interpolated linearly between v[⌊h⌋] and v[⌊h⌋+1]. PostgreSQL computes it
with `percentile_cont`; SQLite, which has no such function, with ROW_NUMBER and COUNT over the ordered values,
the same formula in SQL."""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

from sqlalchemy import bindparam, case, func, select, text
from sqlalchemy.orm import Session

from shared.models import ClaimGroup, Job, JobStatus, UTCDateTime
from shared.settings import ADAPTERS

PERCENTILES = (0.5, 0.95, 0.99)
# name in the answer -> jobs column (milliseconds)
LATENCIES = {"queue_wait": "queue_ms", "time_to_first_token": "ttft_ms", "decode": "decode_ms",
             "end_to_end": "total_ms"}
# always reported, also at zero, so dashboards need no special case
FAILURE_CODES = ("out_of_memory", "numerical_error", "invalid_output", "length", "timeout")
STATUSES = (JobStatus.QUEUED, JobStatus.RUNNING, *JobStatus.FINISHED)

_WINDOW = re.compile(r"(\d{1,7})([smhd])")
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
MAX_WINDOW = timedelta(days=90)


def parse_window(value: str) -> timedelta:
    """`30s`, `15m`, `2h`, `1d` → a timedelta; ValueError says what is accepted."""
    match = _WINDOW.fullmatch(value.strip())
    if match is None:
        raise ValueError(f"{value!r} is not a window: a whole number and a unit s, m, h or d (30s, 15m, 2h, 1d)")
    window = timedelta(seconds=int(match.group(1)) * _UNIT_SECONDS[match.group(2)])
    if not timedelta(seconds=1) <= window <= MAX_WINDOW:
        raise ValueError(f"{value!r}: the window must be between 1s and {MAX_WINDOW.days}d")
    return window


@dataclass(frozen=True)
class Window:
    since: datetime
    until: datetime

    @classmethod
    def last(cls, length: timedelta, now: datetime | None = None) -> Window:
        now = now or datetime.now(timezone.utc)
        return cls(now - length, now)

    def params(self, statement: Any) -> Any:
        # Bound as the column type, so SQLite compares its stored text form and PostgreSQL a timestamptz.
        return statement.bindparams(bindparam("since", self.since, type_=UTCDateTime()),
                                    bindparam("until", self.until, type_=UTCDateTime()))


# Every job created in the window that is a run (see the module docstring).
_RUNS = """
    SELECT j.adapter, j.status, j.error_code, j.queue_ms, j.ttft_ms, j.decode_ms, j.total_ms, j.completion_tokens
    FROM jobs j
    WHERE j.created_at >= :since AND j.created_at < :until
      AND NOT (j.requested_adapter = 'auto' AND j.parent_job_id IS NULL
               AND EXISTS (SELECT 1 FROM jobs c WHERE c.parent_job_id = j.id))
"""


def _postgres_percentiles(column: str) -> str:
    columns = ", ".join(f"percentile_cont({p}) WITHIN GROUP (ORDER BY v) AS p{i}" for i, p in enumerate(PERCENTILES))
    return f"""
        WITH runs AS ({_RUNS}), vals AS (SELECT adapter, {column} AS v FROM runs WHERE {column} IS NOT NULL)
        SELECT adapter, COUNT(*) AS n, {columns} FROM vals GROUP BY adapter
    """


def _floor(dialect: str, expression: str) -> str:
    # SQLite's CAST truncates, which is floor for h >= 1 (FLOOR needs its optional math functions);
    # PostgreSQL's CAST rounds.
    return f"CAST({expression} AS INTEGER)" if dialect == "sqlite" else f"CAST(FLOOR({expression}) AS INTEGER)"


def _window_function_percentiles(dialect: str, column: str) -> str:
    # Per adapter: n, and for each p the position floor(h) and the fraction h - floor(h).
    positions = ", ".join(f"{_floor(dialect, f'1 + {p} * (COUNT(*) - 1)')} AS lo{i}, "
                          f"(1 + {p} * (COUNT(*) - 1)) - {_floor(dialect, f'1 + {p} * (COUNT(*) - 1)')} AS f{i}"
                          for i, p in enumerate(PERCENTILES))
    wanted = ", ".join(f"s.lo{i}, s.lo{i} + 1" for i in range(len(PERCENTILES)))
    values = ", ".join(f"SUM(CASE WHEN r.rn = s.lo{i} THEN r.v * (1 - s.f{i}) "
                       f"WHEN r.rn = s.lo{i} + 1 THEN r.v * s.f{i} ELSE 0 END) AS p{i}"
                       for i in range(len(PERCENTILES)))
    return f"""
        WITH runs AS ({_RUNS}), vals AS (SELECT adapter, {column} AS v FROM runs WHERE {column} IS NOT NULL),
        ranked AS (SELECT adapter, v, ROW_NUMBER() OVER (PARTITION BY adapter ORDER BY v) AS rn FROM vals),
        sizes AS MATERIALIZED (SELECT adapter, COUNT(*) AS n, {positions} FROM vals GROUP BY adapter)
        SELECT r.adapter, MAX(s.n) AS n, {values}
        FROM ranked r JOIN sizes s ON s.adapter = r.adapter AND r.rn IN ({wanted})
        GROUP BY r.adapter
    """


def percentile_sql(dialect: str, column: str, *, portable: bool = False) -> str:
    """Percentiles of one jobs column per adapter: `percentile_cont` on PostgreSQL, the window-function form
    elsewhere (or everywhere with `portable`). One query per column: a sort of one column is cheaper than one
    sort over all of them."""
    if dialect == "postgresql" and not portable:
        return _postgres_percentiles(column)
    return _window_function_percentiles(dialect, column)


_COUNTS = f"""
    WITH runs AS ({_RUNS})
    SELECT adapter, status, error_code, COUNT(*) AS n FROM runs GROUP BY adapter, status, error_code
"""

_BATCHES = """
    SELECT adapters, COUNT(*) AS n, AVG(size) AS mean_size,
           SUM(CASE WHEN decode_ms IS NOT NULL THEN tokens END) AS tokens,
           SUM(prefill_ms + decode_ms) AS busy_ms
    FROM batches WHERE started_at >= :since AND started_at < :until
    GROUP BY adapters
"""

# Denominator: auto jobs past Laya's stage (answered by her, or escalated); queued and cancelled ones not yet.
# The window's rows are taken first (MATERIALIZED): otherwise a planner may walk the parent index for every
# top-level job of all time (parent_job_id IS NULL) and filter by time afterwards.
_ESCALATION = """
    WITH windowed AS MATERIALIZED (
        SELECT id, status, requested_adapter, parent_job_id FROM jobs
        WHERE created_at >= :since AND created_at < :until),
    parents AS (
        SELECT j.status,
               CASE WHEN EXISTS (SELECT 1 FROM jobs c WHERE c.parent_job_id = j.id AND c.adapter = 'kev')
                    THEN 1 ELSE 0 END AS escalated
        FROM windowed j
        WHERE j.requested_adapter = 'auto' AND j.parent_job_id IS NULL)
    SELECT COUNT(*) AS jobs, SUM(escalated) AS escalated,
           SUM(CASE WHEN escalated = 1 OR status IN ('succeeded', 'failed') THEN 1 ELSE 0 END) AS decided
    FROM parents
"""


def _empty_adapter() -> dict[str, Any]:
    return {
        "jobs": {status: 0 for status in STATUSES},
        "latency_ms": {name: {"count": 0, **{f"p{round(p * 100)}": None for p in PERCENTILES}}
                       for name in LATENCIES},
        "completion_tokens_per_s": None,
        "batches": 0,
        "mean_batch_size": None,
        "mean_batch_occupancy": None,
        "failures": {code: 0 for code in FAILURE_CODES},
    }


def _batch_figures(target: dict[str, Any], row: Any, max_batch: int) -> None:
    target["batches"] = row.n
    target["mean_batch_size"] = float(row.mean_size) if row.mean_size is not None else None
    target["mean_batch_occupancy"] = target["mean_batch_size"] / max_batch if row.mean_size is not None else None
    busy_ms = float(row.busy_ms or 0)
    target["completion_tokens_per_s"] = (int(row.tokens or 0) / busy_ms * 1000) if busy_ms > 0 else None


def compute_stats(session: Session, window: Window, max_batch: int, *, portable: bool = False) -> dict[str, Any]:
    dialect = session.get_bind().dialect.name
    adapters = {name: _empty_adapter() for name in ADAPTERS}
    mixed: dict[str, Any] | None = None

    for row in session.execute(window.params(text(_COUNTS))):
        entry = adapters.setdefault(row.adapter, _empty_adapter())
        entry["jobs"][row.status] = entry["jobs"].get(row.status, 0) + row.n
        if row.status == JobStatus.FAILED and row.error_code:
            entry["failures"][row.error_code] = entry["failures"].get(row.error_code, 0) + row.n

    for metric, column in LATENCIES.items():
        for row in session.execute(window.params(text(percentile_sql(dialect, column, portable=portable)))):
            entry = adapters.setdefault(row.adapter, _empty_adapter())
            values = {f"p{round(p * 100)}": float(getattr(row, f"p{i}")) for i, p in enumerate(PERCENTILES)}
            entry["latency_ms"][metric] = {"count": int(row.n), **values}

    for row in session.execute(window.params(text(_BATCHES))):
        if "," in row.adapters:
            mixed = {"batches": 0}
            _batch_figures(mixed, row, max_batch)
        else:
            _batch_figures(adapters.setdefault(row.adapters, _empty_adapter()), row, max_batch)

    auto = session.execute(window.params(text(_ESCALATION))).one()
    decided, escalated = int(auto.decided or 0), int(auto.escalated or 0)
    return {
        "window": {"since": window.since.isoformat(), "until": window.until.isoformat(),
                   "seconds": (window.until - window.since).total_seconds()},
        "adapters": adapters,
        "mixed_batches": mixed,
        "auto": {"jobs": int(auto.jobs or 0), "decided": decided, "escalated": escalated,
                 "escalation_rate": escalated / decided if decided else None},
    }


def queue_depth(session: Session) -> dict[str, int]:
    """Queued jobs per adapter, every adapter listed (from the claim index)."""
    depth = {name: 0 for name in ADAPTERS}
    rows = session.execute(text("SELECT adapter, COUNT(*) AS n FROM jobs WHERE status = 'queued' GROUP BY adapter"))
    for row in rows:
        depth[row.adapter] = row.n
    return depth


def recent_batches(session: Session, since: datetime, limit: int = 200) -> list[dict[str, Any]]:
    """Batches started since `since`, oldest first: what the status page draws as a timeline.

    A batch closes in the commit of its last job, so one whose worker was killed never closes. An unfinished
    batch none of whose jobs still runs in it is `abandoned` (its jobs were stored, or given back to the queue
    by the lease sweeper); `last_stored_at` is when it stored its last job, if it stored any."""
    rows = session.scalars(select(ClaimGroup).where(ClaimGroup.started_at >= since)
                           .order_by(ClaimGroup.started_at.desc()).limit(limit)).all()
    open_ids = [b.id for b in rows if b.finished_at is None]
    running: set[Any] = set()
    last_stored: dict[Any, datetime | None] = {}
    if open_ids:  # one pass over the open batches' jobs: whether any still runs, and the last one stored
        still_running = func.sum(case((Job.status == JobStatus.RUNNING, 1), else_=0))
        for batch_id, stored, runs in session.execute(
                select(Job.batch_id, func.max(Job.finished_at), still_running)
                .where(Job.batch_id.in_(open_ids)).group_by(Job.batch_id)):
            last_stored[batch_id] = stored
            if runs:
                running.add(batch_id)

    def iso(moment: datetime | None) -> str | None:
        return moment.isoformat() if moment else None

    return [{
        "id": str(b.id), "adapters": b.adapters, "size": b.size, "worker": b.worker,
        "started_at": b.started_at.isoformat(), "finished_at": iso(b.finished_at),
        "abandoned": b.finished_at is None and b.id not in running, "last_stored_at": iso(last_stored.get(b.id)),
        "prefill_ms": b.prefill_ms, "decode_ms": b.decode_ms, "tokens": b.tokens,
        "peak_vram_bytes": b.peak_vram_bytes,
    } for b in reversed(rows)]
