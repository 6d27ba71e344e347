"""Wake-ups published off the request path, coalesced.

A wake-up makes a worker drain the queue, not run one job, so the submits that arrive while one is being
published need no wake-up of their own: they ride on the next one. The job writer (api/jobs/writer.py) only
notes the jobs it committed (after the broker answered a ping, so a broker that is down still means 503 and
nothing stored); one thread per API process publishes, one wake-up per `KEVLAYA_ENGINE__MAX_BATCH` jobs of each
adapter noted since its last publish, less the wake-ups still waiting in the broker for a worker to take them:
those drain the new jobs too (a worker takes a wake-up only after the jobs were committed). While the workers
are busy, a stream of submits is then covered by the one wake-up already waiting, at the cost of a queue-length
read instead of a Celery publish (about a millisecond of the API's time each). If the process dies between a
commit and its wake-up, the worker's sweeper re-publishes for the queued jobs, as it does after a Redis restart
(docs/architecture.md §6).
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable, Iterable

from shared.models import Job
from shared.queue import QueueUnavailable, publish_wakeup, waiting_wakeups

log = logging.getLogger("kevlaya.api")


class WakeupPublisher:
    def __init__(self, max_batch: int, publish: Callable[[uuid.UUID | None, str], None] = publish_wakeup,
                 waiting: Callable[[], int] = waiting_wakeups):
        self.max_batch, self._publish, self._waiting = max_batch, publish, waiting
        self._noted: dict[str, list[uuid.UUID]] = {}  # per adapter, the jobs no wake-up has covered yet
        self._publishing = False
        self._changed = threading.Condition()
        self._thread: threading.Thread | None = None

    def note(self, jobs: Iterable[Job]) -> None:
        """Jobs just committed: a wake-up covering them goes out as soon as the publisher is free."""
        with self._changed:
            for job in jobs:
                self._noted.setdefault(job.adapter, []).append(job.id)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="wakeup-publisher", daemon=True)
                self._thread.start()
            self._changed.notify_all()

    def flush(self, timeout_s: float) -> bool:
        """Wait until every noted job's wake-up has been published (or given up on); False on timeout."""
        with self._changed:
            return self._changed.wait_for(lambda: not self._noted and not self._publishing, timeout_s)

    def _run(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: bool(self._noted))
                noted, self._noted, self._publishing = self._noted, {}, True
            try:
                wanted = [(job_ids[first], adapter) for adapter, job_ids in noted.items()
                          for first in range(0, len(job_ids), self.max_batch)]  # one per batch there is to run
                for job_id, adapter in wanted[self._waiting_now():]:
                    self._publish_one(job_id, adapter)
            finally:
                with self._changed:
                    self._publishing = False
                    self._changed.notify_all()

    def _waiting_now(self) -> int:
        try:
            return self._waiting()
        except Exception:  # unknown: publish them all (a broker that is down is the publish's to report)
            return 0

    def _publish_one(self, job_id: uuid.UUID, adapter: str) -> None:
        try:
            self._publish(job_id, adapter)
        except QueueUnavailable:
            log.warning("a wake-up for %s (job %s and those stored with it) was not published; the sweeper will "
                        "re-publish it", adapter, job_id)
        except Exception:  # the publisher thread must outlive any one failure
            log.exception("publishing a wake-up for %s failed; the sweeper will re-publish it", adapter)
