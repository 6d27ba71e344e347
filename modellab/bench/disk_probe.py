"""A flush-latency probe for `kevlaya load --disk-probe DIR`: what making a write durable costs on a disk, over time.

A submit is answered once its commit is durable, so a disk that stalls its flushes stalls every submit waiting on
a commit. The probe writes 4 KiB and `fdatasync`s it every `interval_s` in a file of its own, in a thread of the
load generator, and keeps each flush's time: figures per phase then say whether the disk itself stalled while
the submits were timed, apart from anything the database or the API does."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

SLOW_S = 0.05


class DiskProbe:
    def __init__(self, directory: Path, interval_s: float = 0.01):
        self.path = directory / f".kevlaya-disk-probe-{os.getpid()}"
        self.interval_s = interval_s
        self.flushes_s: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="disk-probe", daemon=True)

    def __enter__(self) -> DiskProbe:
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def mark(self) -> int:
        """A point in the probe's record, to take figures between two of them."""
        return len(self.flushes_s)

    def figures(self, start: int, end: int) -> dict[str, Any]:
        flushes = sorted(self.flushes_s[start:end])
        if not flushes:
            return {"flushes": 0}
        return {"flushes": len(flushes), "p50_ms": round(flushes[len(flushes) // 2] * 1000, 2),
                "p99_ms": round(flushes[min(len(flushes) - 1, int(len(flushes) * 0.99))] * 1000, 2),
                "max_ms": round(flushes[-1] * 1000, 2), "over_50ms": sum(1 for s in flushes if s > SLOW_S)}

    def _run(self) -> None:
        block = b"\0" * 4096
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            while not self._stop.wait(self.interval_s):
                os.pwrite(fd, block, 0)
                started = time.perf_counter()
                os.fdatasync(fd)
                self.flushes_s.append(time.perf_counter() - started)
        finally:
            os.close(fd)
            self.path.unlink(missing_ok=True)
