"""Per-key quotas, checked where rows are stored (docs/architecture.md §16): queued interactive jobs and stored
bytes.

An `Admission` locks the usage rows of the keys it checks (shared/usage.py: `FOR UPDATE` on PostgreSQL, the one
write lock on SQLite) in the transaction that stores the rows it admits, so two submits or uploads of one key,
in any process, are checked one after the other against what the other stored: the limit holds exactly. Over
a limit: 429 `queued_jobs_limit` (the queue drains: retry later) or 413 `storage_quota_exceeded` (delete, or
wait for retention), each naming the limit and the setting."""

from __future__ import annotations

import threading
import uuid
from collections import Counter
from collections.abc import Iterable

from sqlalchemy.orm import Session

from api.http.errors import RETRY_AFTER_S, ApiError
from shared import usage
from shared.models import Job, KeyUsage, Priority
from shared.settings import Settings


def queued_limit(row: KeyUsage | None, settings: Settings) -> int:
    return settings.quotas.queued_jobs_per_key if row is None or row.max_queued_jobs is None else row.max_queued_jobs


def stored_limit(row: KeyUsage | None, settings: Settings) -> int:
    return settings.quotas.stored_bytes_per_key if row is None or row.max_stored_bytes is None else row.max_stored_bytes


def over_storage(what: str, stored: int, adding: int, limit: int) -> ApiError:
    return ApiError(413, "storage_quota_exceeded",
                    f"{what}: this key stores {stored} bytes (jobs and files) and this would add {adding}; its limit "
                    f"is {limit} bytes (KEVLAYA_QUOTAS__STORED_BYTES_PER_KEY, or the key's own): delete jobs or files "
                    "(DELETE /v1/jobs/{id}, /v1/files/{id}, /v1/batches/{id}), nothing was stored")


class Admission:
    """The quotas of some keys, read once in the storing transaction, then charged submit by submit."""

    def __init__(self, session: Session, key_ids: Iterable[uuid.UUID], settings: Settings):
        self.session, self.settings = session, settings
        self.rows = usage.lock(session, key_ids)
        self.queued: dict[uuid.UUID, int] = {}
        self.stored = {key_id: row.stored_bytes for key_id, row in self.rows.items()}

    def take_jobs(self, key_id: uuid.UUID | None, jobs: list[Job]) -> ApiError | None:
        """Admit new jobs of one submit (all or none) and charge them; else the error that refuses them."""
        if key_id is None or not jobs:
            return None
        row = self.rows.get(key_id)
        interactive = sum(1 for job in jobs if (job.priority or Priority.INTERACTIVE) == Priority.INTERACTIVE)
        if key_id not in self.queued:
            self.queued[key_id] = usage.queued_jobs(self.session, key_id)
        limit = queued_limit(row, self.settings)
        if interactive and self.queued[key_id] + interactive > limit:
            return ApiError(429, "queued_jobs_limit",
                            f"this key has {self.queued[key_id]} jobs queued and the limit is {limit} "
                            "(KEVLAYA_QUOTAS__QUEUED_JOBS_PER_KEY, or the key's own); nothing was stored: retry once "
                            "some have run", headers={"Retry-After": RETRY_AFTER_S})
        adding = sum(job.stored_bytes or 0 for job in jobs)
        if error := self.take_bytes(key_id, adding, "jobs"):
            return error
        self.queued[key_id] += interactive
        return None

    def take_bytes(self, key_id: uuid.UUID, adding: int, what: str) -> ApiError | None:
        """Admit `adding` stored bytes of the key and charge them; else the error that refuses them."""
        limit = stored_limit(self.rows.get(key_id), self.settings)
        stored = self.stored.get(key_id, 0)
        if stored + adding > limit:
            return over_storage(what, stored, adding, limit)
        self.stored[key_id] = stored + adding
        usage.charge(self.session, key_id, adding)
        return None


class UploadsInFlight:
    """Bytes of uploads still arriving in this process, per key: an upload's early stop counts them with what the
    key has stored (the storing transaction still checks exactly)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._bytes: Counter[uuid.UUID] = Counter()

    def add(self, key_id: uuid.UUID, size: int) -> None:
        with self._lock:
            self._bytes[key_id] += size
            if self._bytes[key_id] <= 0:
                del self._bytes[key_id]

    def of(self, key_id: uuid.UUID) -> int:
        with self._lock:
            return self._bytes.get(key_id, 0)


uploads_in_flight = UploadsInFlight()
