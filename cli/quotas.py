"""`kevlaya quotas`: each API key's queued jobs and stored bytes against its limits (docs/architecture.md §16)."""

from __future__ import annotations

import uuid
from typing import Annotated, Optional

import typer

from cli.common import fail, require_database

app = typer.Typer(help="Each API key's queued jobs and stored bytes, and its own limits.", no_args_is_help=True)


@app.command("show")
def quotas_show() -> None:
    """Every key's queued jobs and stored bytes, each against its limit (its own, or the settings')."""
    require_database()
    from sqlalchemy import select

    from api.keys.quotas import queued_limit, stored_limit
    from shared import usage
    from shared.db import session_scope
    from shared.models import ApiKey, KeyUsage
    from shared.settings import get_settings

    settings = get_settings()
    with session_scope() as session:
        for key in session.scalars(select(ApiKey).order_by(ApiKey.created_at)):
            row = session.get(KeyUsage, key.id)
            typer.echo(f"{key.id}  {key.name:<20} queued {usage.queued_jobs(session, key.id)}/"
                       f"{queued_limit(row, settings)}  stored {row.stored_bytes if row else 0}/"
                       f"{stored_limit(row, settings)} bytes{'  (revoked)' if key.revoked_at else ''}")


@app.command("set")
def quotas_set(
    key_id: Annotated[str, typer.Argument(help="the key's id (`kevlaya keys list`)")],
    queued_jobs: Annotated[Optional[int], typer.Option(min=1, help="interactive jobs it may have queued")] = None,
    stored_bytes: Annotated[Optional[int], typer.Option(min=1024, help="bytes of jobs and files it may keep")] = None,
    default: Annotated[bool, typer.Option("--default", help="back to the settings' limits "
                                          "(KEVLAYA_QUOTAS__QUEUED_JOBS_PER_KEY, "
                                          "KEVLAYA_QUOTAS__STORED_BYTES_PER_KEY)")] = False,
) -> None:
    """Give one key its own limits (the others keep the settings')."""
    try:
        parsed = uuid.UUID(key_id)
    except ValueError:
        fail(f"{key_id!r} is not a key id (`kevlaya keys list` shows them)")
    if not default and queued_jobs is None and stored_bytes is None:
        fail("give --queued-jobs, --stored-bytes or --default")
    require_database()
    from shared import usage
    from shared.db import write_scope
    from shared.models import ApiKey

    with write_scope() as session:
        if session.get(ApiKey, parsed) is None:
            fail(f"no key with id {key_id}")
        row = usage.lock(session, [parsed])[parsed]
        if default:
            row.max_queued_jobs = row.max_stored_bytes = None
        if queued_jobs is not None:
            row.max_queued_jobs = queued_jobs
        if stored_bytes is not None:
            row.max_stored_bytes = stored_bytes
    typer.echo(f"{key_id}: queued jobs {row.max_queued_jobs or 'default'}, stored bytes "
               f"{row.max_stored_bytes or 'default'}")
