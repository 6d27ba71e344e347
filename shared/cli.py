"""`kevlaya`: the command-line tool. Heavy imports (torch, uvicorn, the worker) happen inside commands."""

from __future__ import annotations

import json
import os
import socket
import sys
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Annotated, Optional

import typer

from shared.settings import get_settings

app = typer.Typer(help="Kev & Laya decision-job service.", no_args_is_help=True, add_completion=False)
db_app = typer.Typer(help="Database schema.", no_args_is_help=True)
keys_app = typer.Typer(help="API keys (stored hashed; the key is shown once).", no_args_is_help=True)
models_app = typer.Typer(help="Model directories.", no_args_is_help=True)
app.add_typer(db_app, name="db")
app.add_typer(keys_app, name="keys")
app.add_typer(models_app, name="models")


def _fail(message: str) -> None:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(2)


@db_app.command("upgrade")
def db_upgrade(
    revision: Annotated[str, typer.Argument(help="target revision")] = "head",
    wait: Annotated[float, typer.Option(help="seconds to wait for the database to answer")] = 60,
) -> None:
    """Apply migrations to KEVLAYA_DATABASE_URL (waits for the database first)."""
    from shared.migrate import upgrade, wait_for_database

    url = get_settings().database_url
    try:
        wait_for_database(url, wait)
    except Exception as exc:
        _fail(f"database {url} does not answer: {exc}")
    upgrade(url, revision)
    typer.echo(f"database at {revision}: {url}")


@keys_app.command("create")
def keys_create(
    name: Annotated[str, typer.Argument(help="who or what the key is for")],
    admin: Annotated[bool, typer.Option(help="may see every job, not only its own")] = False,
    rate_limit: Annotated[Optional[int], typer.Option(help="requests per minute to record for this key")] = None,
) -> None:
    """Create an API key and print it (only this once)."""
    from shared.db import session_scope
    from shared.keys import create_key

    with session_scope() as session:
        row, plain = create_key(session, name, admin=admin, rate_limit_per_minute=rate_limit)
    typer.echo(f"id:  {row.id}\nkey: {plain}")


@keys_app.command("list")
def keys_list() -> None:
    """List keys (never the keys themselves)."""
    from sqlalchemy import select

    from shared.db import session_scope
    from shared.models import ApiKey

    with session_scope() as session:
        for row in session.scalars(select(ApiKey).order_by(ApiKey.created_at)):
            state = f"revoked {row.revoked_at:%Y-%m-%d %H:%M}" if row.revoked_at else "active"
            typer.echo(f"{row.id}  {row.name:<20} {'admin' if row.is_admin else 'user ':<6} {state}")


@keys_app.command("revoke")
def keys_revoke(key_id: Annotated[str, typer.Argument(help="the key's id (from `keys list`)")]) -> None:
    """Revoke a key at once."""
    from shared.db import session_scope
    from shared.models import ApiKey

    try:
        parsed = uuid.UUID(key_id)
    except ValueError:
        _fail(f"key id {key_id!r} is not a UUID")
    with session_scope() as session:
        row = session.get(ApiKey, parsed)
        if row is None:
            _fail(f"no key with id {key_id}")
        row.revoked_at = datetime.now(timezone.utc)
    typer.echo(f"revoked {key_id}")


def _exec_celery(args: list[str]) -> None:
    """Replace this process with Celery's, so signals (docker stop, Ctrl-C) reach it directly."""
    os.execv(sys.executable, [sys.executable, "-m", "celery", *args])


@app.command("api")
def api(reload: Annotated[bool, typer.Option(help="restart on code changes (development)")] = False) -> None:
    """Serve the REST API on KEVLAYA_API_HOST:KEVLAYA_API_PORT."""
    import uvicorn

    settings = get_settings()
    uvicorn.run("api.main:app", host=settings.api_host, port=settings.api_port, reload=reload,
                proxy_headers=True, log_level="info")


@app.command("worker")
def worker(loglevel: Annotated[str, typer.Option(help="Celery log level")] = "INFO") -> None:
    """Run the GPU worker: one Celery prefork child at concurrency 1 that loads the model."""
    _exec_celery(["-A", "worker.tasks", "worker", "--pool", "prefork", "--concurrency", "1",
                      "--prefetch-multiplier", "1", "-E", "-n", f"kevlaya@{socket.gethostname()}",
                      "--loglevel", loglevel])


@app.command("worker-health")
def worker_health() -> None:
    """Exit 0 when a worker on this host has reported in with its model loaded (for health checks)."""
    from shared.heartbeat import live_workers

    host = socket.gethostname()
    mine = {k: v for k, v in live_workers().items() if k.split(":")[0] == host}
    typer.echo(json.dumps(mine, indent=2))
    if not any(info.get("model_loaded") for info in mine.values()):
        raise typer.Exit(1)


@app.command("flower")
def flower() -> None:
    """Serve Flower (queue monitoring) on KEVLAYA_FLOWER_HOST:KEVLAYA_FLOWER_PORT."""
    settings = get_settings()
    args = ["--broker", settings.redis_url, "flower",
            f"--address={settings.flower_host}", f"--port={settings.flower_port}"]
    if settings.flower_basic_auth:
        args.append(f"--basic-auth={settings.flower_basic_auth.get_secret_value()}")
    elif settings.flower_host not in ("127.0.0.1", "localhost", "::1"):
        _fail("Flower listens beyond localhost: set KEVLAYA_FLOWER_BASIC_AUTH=user:password")
    _exec_celery(args)


@models_app.command("random")
def models_random(
    out: Annotated[Path, typer.Argument(help="directory to write base/, kev/ and laya/ into")],
    shape: Annotated[str, typer.Option(help="tiny, qwen2.5-1.5b, qwen2.5-3b or llama-2-7b")] = "tiny",
    seed: Annotated[int, typer.Option()] = 0,
) -> None:
    """Build a random-weight base model of a real shape plus Kev/Laya LoRA adapters (tests, benchmarks)."""
    from worker.model_factory import SHAPES, build_random_model

    if shape not in SHAPES:
        _fail(f"--shape must be one of {', '.join(SHAPES)}")
    paths = build_random_model(out, shape, seed=seed)
    for name, path in paths.items():
        typer.echo(f"{name}: {path}")


@models_app.command("verify")
def models_verify() -> None:
    """Check the SHA-256 manifests of the configured base model and adapters."""
    from shared.manifest import verify_manifest

    settings = get_settings()
    bad = False
    for name, path in (("base", settings.base_model), ("kev", settings.kev.path), ("laya", settings.laya.path)):
        problems = verify_manifest(Path(path))
        bad |= bool(problems)
        typer.echo(f"{name} ({path}): " + ("ok" if not problems else "; ".join(problems)))
    if bad:
        raise typer.Exit(1)


@app.command("run")
def run(
    flower: Annotated[bool, typer.Option(help="also serve Flower")] = True,
) -> None:
    """Run everything locally: migrate, find or start Redis, then the API, one worker and Flower."""
    from shared.local_run import run_local

    sys.exit(run_local(with_flower=flower))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
