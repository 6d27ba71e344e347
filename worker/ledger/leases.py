"""Leases kept alive while the engine holds jobs, so only a dead worker's jobs ever expire (docs/architecture.md §3)."""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

from shared.db import write_scope
from worker.ledger.claims import renew_leases

log = logging.getLogger("kevlaya.worker")


@contextmanager
def leases_kept(group_ids: Callable[[], Iterable[uuid.UUID]], lease_s: float) -> Iterator[None]:
    """Renew the leases of the claim groups `group_ids()` names, every third of the lease, while the block runs."""
    stop = threading.Event()

    def renew() -> None:
        while not stop.wait(lease_s / 3):
            for group_id in group_ids():
                try:
                    with write_scope() as session:
                        renew_leases(session, group_id, lease_s)
                except Exception:  # the next renewal may succeed; expiry is the safety net
                    log.exception("lease renewal failed for claim group %s", group_id)

    thread = threading.Thread(target=renew, name="lease-renewal", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
