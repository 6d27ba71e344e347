"""What every command group shares: failing with a message, and a database ready to use."""

from __future__ import annotations

from typing import NoReturn

import typer


def fail(message: str) -> NoReturn:
    """Print `error: <message>` in red on stderr and exit with status 2."""
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(2)


def require_database() -> None:
    """Fail with one clear line, not a traceback, when KEVLAYA_DATABASE__URL does not answer or is not migrated."""
    from shared.migrate import schema_problem
    from shared.settings import get_settings

    if problem := schema_problem(get_settings().database.url):
        fail(problem)


def require_own_schema() -> None:
    """For the API and the worker, which may start before their database answers: refuse, in one line, a database
    whose schema is not this version's (migrated by a newer version, or not yet upgraded)."""
    from shared.migrate import foreign_schema
    from shared.settings import get_settings

    if problem := foreign_schema(get_settings().database.url):
        fail(problem)
