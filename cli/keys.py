"""`kevlaya keys`: API keys (stored hashed; the key is shown once)."""

from __future__ import annotations

import uuid
from datetime import datetime, timezone
from typing import Annotated, Optional

import typer

from cli.common import fail, require_database

app = typer.Typer(help="API keys (stored hashed; the key is shown once).", no_args_is_help=True)


@app.command("create")
def keys_create(
    name: Annotated[str, typer.Argument(help="who or what the key is for")],
    admin: Annotated[bool, typer.Option(help="may see every job, not only its own")] = False,
    rate_limit: Annotated[Optional[int], typer.Option(
        min=0, help="jobs a minute this key may submit, in a moving window (a batch of 256 counts 256); 0: unlimited "
        "(default: KEVLAYA_KEYS__DEFAULT_RATE_LIMIT, 600)")] = None,
    weight: Annotated[float, typer.Option(min=0.01, help="the key's share of the slots against other keys with work "
                                          "queued: a key of weight 2 holds twice the slots of one of weight 1")] = 1.0,
) -> None:
    """Create an API key and print it (only this once)."""
    from shared.keys import BOOTSTRAP_NAME
    from shared.settings import get_settings

    if name == BOOTSTRAP_NAME:  # the rows of KEVLAYA_API__KEY's values, revoked when it changes
        fail(f"the name {BOOTSTRAP_NAME!r} is kept for the key of KEVLAYA_API__KEY: choose another")
    require_database()
    from shared.db import session_scope
    from shared.keys import create_key

    per_minute = get_settings().keys.default_rate_limit if rate_limit is None else rate_limit
    with session_scope() as session:
        row, plain = create_key(session, name, admin=admin, rate_limit_per_minute=per_minute or None,
                                share_weight=weight)
    limit = f"{per_minute} jobs a minute" if per_minute else "unlimited"
    typer.echo(f"id:  {row.id}\nkey: {plain}\nrate limit: {limit}")


@app.command("generate")
def keys_generate() -> None:
    """Print a new random key, stored nowhere: a value for KEVLAYA_API__KEY."""
    from shared.keys import generate_key

    typer.echo(generate_key())


@app.command("list")
def keys_list() -> None:
    """List keys (never the keys themselves)."""
    require_database()
    from sqlalchemy import select

    from shared.db import session_scope
    from shared.models import ApiKey

    with session_scope() as session:
        for row in session.scalars(select(ApiKey).order_by(ApiKey.created_at)):
            state = f"revoked {row.revoked_at:%Y-%m-%d %H:%M}" if row.revoked_at else "active"
            weight = f"  weight {row.share_weight:g}" if row.share_weight != 1 else ""
            rate = f"  {row.rate_limit_per_minute} jobs/min" if row.rate_limit_per_minute else ""
            typer.echo(f"{row.id}  {row.name:<20} {'admin' if row.is_admin else 'user ':<6} {state}{weight}{rate}")


@app.command("revoke")
def keys_revoke(key_id: Annotated[str, typer.Argument(help="the key's id (from `keys list`)")]) -> None:
    """Revoke a key at once."""
    from shared.db import session_scope
    from shared.models import ApiKey

    try:
        parsed = uuid.UUID(key_id)
    except ValueError:
        fail(f"key id {key_id!r} is not a UUID")
    require_database()
    with session_scope() as session:
        row = session.get(ApiKey, parsed)
        if row is None:
            fail(f"no key with id {key_id}")
        row.revoked_at = datetime.now(timezone.utc)
    typer.echo(f"revoked {key_id}")
