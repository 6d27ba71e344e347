"""What one look at the queue costs the worker (`queue_snapshot`: queued counts and oldest waits per adapter, the
query the engine runs inside a decode step, docs/architecture.md §4), on a database holding `--jobs` jobs of which
`--queued` are queued. Prints milliseconds per look; `--out` keeps the JSON.

    python -m modellab.bench.queue_look --jobs 20000 --queued 30
    python -m modellab.bench.queue_look --database-url postgresql+psycopg://user@localhost/empty_db
"""

from __future__ import annotations

import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Annotated, Optional

import typer


def main(
    jobs: Annotated[int, typer.Option(min=1, help="jobs in the table")] = 20_000,
    queued: Annotated[int, typer.Option(min=0, help="of them queued; the rest succeeded")] = 30,
    looks: Annotated[int, typer.Option(min=1, help="looks timed, in rounds of this many")] = 200,
    rounds: Annotated[int, typer.Option(min=1, help="rounds; the median round is reported")] = 5,
    database_url: Annotated[Optional[str], typer.Option(help="an empty database to fill (default: a new SQLite "
                                                                "file in a temporary folder)")] = None,
    out: Annotated[Optional[Path], typer.Option(help="write the figures here as JSON")] = None,
) -> None:
    """Fill a database with jobs and time the engine's look at the queue."""
    if queued > jobs:
        raise typer.BadParameter(f"at most --jobs ({jobs})", param_hint="--queued")
    url = database_url or f"sqlite:///{tempfile.mkdtemp(prefix='kevlaya-queue-look-')}/kevlaya.db"
    os.environ["KEVLAYA_DATABASE__URL"] = url  # read by shared.db when it first connects

    from shared.db import reset_engine, session_scope, write_scope
    from shared.migrate import upgrade
    from shared.models import Job
    from worker.ledger.claims import queue_snapshot

    upgrade(url)
    reset_engine()
    now = datetime.now(timezone.utc)
    with write_scope() as session:
        session.add_all(Job(adapter=("kev", "laya")[i % 2], requested_adapter=("kev", "laya")[i % 2],
                            status="queued" if i < queued else "succeeded", input="A or B?", params={},
                            created_at=now - timedelta(seconds=i)) for i in range(jobs))
    per_round = []
    for _ in range(rounds):
        started = time.perf_counter()
        for _ in range(looks):
            with session_scope() as session:
                snapshot = queue_snapshot(session)
        per_round.append((time.perf_counter() - started) / looks * 1000)
    assert sum(snapshot.queued.values()) == queued
    result = {"command": shlex.join(["python", "-m", "modellab.bench.queue_look", *sys.argv[1:]]),
              "database": url.split(":", 1)[0], "jobs": jobs, "queued": queued,
              "ms_per_look": round(statistics.median(per_round), 4), "rounds_ms": [round(r, 4) for r in per_round]}
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
    typer.echo(f"{result['database']}, {jobs} jobs ({queued} queued): {result['ms_per_look']:.3f} ms a look "
               f"(median of {rounds} rounds of {looks})")


if __name__ == "__main__":
    typer.run(main)
