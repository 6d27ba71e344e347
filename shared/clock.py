"""One clock for every process: the database's. Leases, claims, sweeps and a job's timestamps are written and
compared in it, so a host whose clock runs ahead cannot expire another worker's lease, nor one running behind
write leases that are already over, and a job's queue and total times never mix two hosts' clocks
(docs/architecture.md §3).

The database is read once a minute; in between, its time is carried forward on this process's monotonic clock,
which no change of the wall clock moves. So a reading costs no round trip, and the times one process writes
never go backwards."""

from __future__ import annotations

import threading
import time
from datetime import datetime, timedelta, timezone

from sqlalchemy import text
from sqlalchemy.orm import Session

RESYNC_S = 60.0

# Each dialect's current time, not the transaction's start: a claim in a long transaction must not be stamped
# with when it began. SQLite's has millisecond resolution.
_NOW = {
    "postgresql": "SELECT clock_timestamp()",
    "sqlite": "SELECT strftime('%Y-%m-%d %H:%M:%f', 'now')",
}


class _Reading:
    __slots__ = ("at", "monotonic")

    def __init__(self, at: datetime, monotonic: float):
        self.at, self.monotonic = at, monotonic


_readings: dict[str, _Reading] = {}
_lock = threading.Lock()


def _read(session: Session) -> datetime:
    value = session.scalar(text(_NOW[session.get_bind().dialect.name]))
    if isinstance(value, str):
        value = datetime.fromisoformat(value)
    return value.astimezone(timezone.utc) if value.tzinfo is not None else value.replace(tzinfo=timezone.utc)


def db_now(session: Session) -> datetime:
    """The database's time now (UTC, aware), to within its resolution."""
    database = session.get_bind().url.render_as_string(hide_password=True)
    now = time.monotonic()
    with _lock:
        reading = _readings.get(database)
    if reading is None or now - reading.monotonic > RESYNC_S:
        at = _read(session)
        now = time.monotonic()
        reading = _Reading(at, now)
        with _lock:
            previous = _readings.get(database)
            # A resync does not step back by the database's resolution past a time already handed out; a real
            # change of the database's clock (over a second) is followed.
            if previous is not None:
                carried = previous.at + timedelta(seconds=now - previous.monotonic)
                if at < carried < at + timedelta(seconds=1):
                    reading = _Reading(carried, now)
            _readings[database] = reading
    return reading.at + timedelta(seconds=now - reading.monotonic)


def elapsed_ms(later: datetime, earlier: datetime) -> float:
    """Milliseconds from `earlier` to `later`, never below 0: two processes' readings of the database's clock
    can differ by its resolution or by a resync that kept a carried time (up to a second), so a time stamped
    by one (a job's creation in the API) can lie just after one stamped by another (its start in a worker)."""
    return max(0.0, (later - earlier).total_seconds() * 1000)
