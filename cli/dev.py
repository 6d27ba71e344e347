"""`kevlaya dev`: development aids (bulk data for measurements, the settings' documentation)."""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path
from typing import Annotated

import typer

from cli.common import fail, require_database

app = typer.Typer(help="Development aids: bulk data for measurements, the settings' documentation.",
                  no_args_is_help=True)


@app.command("seed-jobs")
def dev_seed_jobs(
    count: Annotated[int, typer.Argument(help="job rows to insert (their batches come with them)")],
    hours: Annotated[float, typer.Option(help="spread the jobs' creation over the last this many hours")] = 24,
    seed: Annotated[int, typer.Option()] = 0,
    time_stats: Annotated[str, typer.Option(
        help="then time GET /v1/stats for these windows (comma-separated; empty: skip)")] = "15m,1h,1d",
    repeat: Annotated[int, typer.Option(help="timed requests per window (the median is printed)")] = 3,
) -> None:
    """Insert realistic job and batch rows into KEVLAYA_DATABASE__URL, then time /v1/stats on them."""
    import statistics
    import time

    from fastapi.testclient import TestClient

    from api.main import create_app
    from modellab.bench.seed import seed_jobs
    from shared.db import get_engine, session_scope
    from shared.keys import create_key
    from shared.models import ApiKey

    require_database()
    done = seed_jobs(get_engine(), count, hours=hours, seed=seed)
    typer.echo(f"inserted {done['jobs']:,} jobs and {done['batches']:,} batches in {done['seconds']:.1f}s "
               f"({done['jobs'] / done['seconds']:,.0f} jobs/s)")
    windows = [w.strip() for w in time_stats.split(",") if w.strip()]
    if not windows:
        return
    with session_scope() as session:
        row, key = create_key(session, "seed-jobs timing", admin=True)
        row_id = row.id
    headers = {"Authorization": f"Bearer {key}"}
    try:
        with TestClient(create_app()) as client:
            for window in windows:
                seconds = []
                for _ in range(repeat):
                    started = time.perf_counter()
                    response = client.get("/v1/stats", params={"window": window}, headers=headers)
                    seconds.append(time.perf_counter() - started)
                    if response.status_code != 200:
                        fail(f"/v1/stats?window={window}: {response.status_code} {response.text}")
                runs = sum(a["latency_ms"]["end_to_end"]["count"] for a in response.json()["adapters"].values())
                typer.echo(f"GET /v1/stats?window={window}: median {statistics.median(seconds) * 1000:,.0f} ms "
                           f"over {repeat} requests ({runs:,} finished runs in the window)")
    finally:
        with session_scope() as session:  # the timing key must not outlive the measurement
            session.get(ApiKey, row_id).revoked_at = datetime.now(timezone.utc)


@app.command("settings-doc")
def dev_settings_doc(
    write: Annotated[bool, typer.Option(
        "--write", help="replace the block between the settings markers of the file instead of printing")] = False,
    target: Annotated[Path | None, typer.Option(
        help="the Markdown file to write (default: docs/configuration.md)")] = None,
) -> None:
    """The Configuration tables as Markdown, generated from the settings' Field descriptions and groups."""
    from shared import settings_doc

    markdown = settings_doc.render()
    if not write:
        typer.echo(markdown)
        return
    path = target or settings_doc.TARGET
    text = path.read_text()
    try:
        updated = settings_doc.with_block(text, markdown)
    except ValueError as error:
        fail(f"{path}: {error}")
    if updated == text:
        typer.echo(f"{path}: up to date")
        return
    path.write_text(updated)
    typer.echo(f"{path}: Configuration tables rewritten")
