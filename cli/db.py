"""`kevlaya db`: the database schema."""

from __future__ import annotations

from typing import Annotated

import typer

from cli.common import fail
from shared.settings import get_settings

app = typer.Typer(help="Database schema.", no_args_is_help=True)


@app.command("upgrade")
def db_upgrade(
    revision: Annotated[str, typer.Argument(help="target revision")] = "head",
    wait: Annotated[float, typer.Option(help="seconds to wait for the database to answer")] = 60,
) -> None:
    """Apply migrations to KEVLAYA_DATABASE__URL (waits for the database first)."""
    from shared.logs import masked_url
    from shared.migrate import newer_schema, upgrade, wait_for_database

    url = get_settings().database.url
    try:
        wait_for_database(url, wait)
    except Exception as exc:
        fail(f"database {masked_url(url)} does not answer: {exc}")
    if problem := newer_schema(url):
        fail(problem)
    upgrade(url, revision)
    typer.echo(f"database at {revision}: {masked_url(url)}")  # its output goes to compose's logs
