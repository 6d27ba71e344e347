"""A flush-latency probe for `kevlaya load --disk-probe DIR`: what making a write durable costs on a disk, over time.

A submit is answered once its commit is durable, so a disk that stalls its flushes stalls every submit waiting on
a commit. The probe is a process of its own (the load generator's interpreter lock would delay its timings): it
writes 4 KiB and `fdatasync`s it every `interval_s` in a file of its own and records when each flush started and
how long it took. Figures per phase then say whether the disk itself stalled while the submits were timed, apart
from anything the database or the API does."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

SLOW_S = 0.05


class DiskProbe:
    def __init__(self, directory: Path, interval_s: float = 0.01):
        self.directory, self.interval_s = directory, interval_s
        self.record = directory / f".kevlaya-disk-probe-{os.getpid()}.log"
        self._process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> DiskProbe:
        self._process = subprocess.Popen([sys.executable, "-m", "modellab.bench.disk_probe", str(self.directory),
                                          str(self.record), str(self.interval_s)])
        return self

    def __exit__(self, *_exc: object) -> None:
        if self._process is not None:
            self._process.terminate()
            self._process.wait(10)
        self.record.unlink(missing_ok=True)

    def mark(self) -> float:
        """A point in time, to take figures between two of them."""
        return time.time()

    def figures(self, start: float, end: float) -> dict[str, Any]:
        text = self.record.read_text() if self.record.exists() else ""
        flushes = sorted(float(seconds) for at, seconds in (line.split() for line in text.splitlines() if line)
                         if start <= float(at) <= end)
        if not flushes:
            return {"flushes": 0}
        return {"flushes": len(flushes), "p50_ms": round(flushes[len(flushes) // 2] * 1000, 2),
                "p99_ms": round(flushes[min(len(flushes) - 1, int(len(flushes) * 0.99))] * 1000, 2),
                "max_ms": round(flushes[-1] * 1000, 2), "over_50ms": sum(1 for s in flushes if s > SLOW_S)}


def probe(directory: Path, record: Path, interval_s: float) -> None:
    """Flush a 4 KiB write every `interval_s` until terminated; one line per flush: start time, seconds."""
    path = directory / f".kevlaya-disk-probe-{os.getpid()}"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with open(record, "a", buffering=1) as out:
            while True:
                os.pwrite(fd, b"\0" * 4096, 0)
                at, started = time.time(), time.perf_counter()
                os.fdatasync(fd)
                out.write(f"{at:.4f} {time.perf_counter() - started:.6f}\n")
                time.sleep(interval_s)
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)


if __name__ == "__main__":
    import signal

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # the finally above removes the file
    probe(Path(sys.argv[1]), Path(sys.argv[2]), float(sys.argv[3]))
