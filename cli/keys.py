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
    rate_limit: Annotated[Optional[int], typer.Option(help="requests per minute this key may make (default: unlimited)")] = None,
    weight: Annotated[float, typer.Option(min=0.01, help="the key's share of the slots against other keys with work "
                                          "queued: a key of weight 2 holds twice the slots of one of weight 1")] = 1.0,
) -> None:
    """Create an API key and print it (only this once)."""
    require_database()
    from shared.db import session_scope
    from shared.keys import create_key

    with session_scope() as session:
        row, plain = create_key(session, name, admin=admin, rate_limit_per_minute=rate_limit,
                                share_weight=weight)
    typer.echo(f"id:  {row.id}\nkey: {plain}")


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
            typer.echo(f"{row.id}  {row.name:<20} {'admin' if row.is_admin else 'user ':<6} {state}{weight}")


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
