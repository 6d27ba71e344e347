"""Serving commands: `run` (everything locally), `api`, `worker`, `worker-health` and `flower`."""

from __future__ import annotations

import copy
import json
import os
import re
import socket
import sys
from typing import Annotated, Any

import typer

from cli.common import fail, require_own_schema
from shared.settings import get_settings


def require_guarded_redis() -> None:
    """Refuse, in one line, a Redis beyond this host without a password (shared/redis_auth.py)."""
    from shared.redis_auth import redis_url_problem

    settings = get_settings()
    if problem := redis_url_problem(settings.redis.url, settings.redis.allow_no_password):
        fail(problem)


def _run_celery(args: list[str]) -> None:
    """Run Celery's command line in this process: the process is Celery's, so signals (docker stop, Ctrl-C)
    reach it directly, as they would after an exec, without starting a second interpreter."""
    from celery.bin.celery import celery

    celery.main(args=args, prog_name="celery", auto_envvar_prefix="CELERY")


def api_log_config(log_format: str) -> dict[str, Any]:
    """uvicorn's own logging, plus the service's loggers (`kevlaya.*`) on stderr in KEVLAYA_MONITORING__LOG_FORMAT.
    Given to uvicorn, so every API process it starts applies it; without it those loggers had no handler, their INFO
    lines were lost and their warnings printed bare."""
    from uvicorn.config import LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    formatter = "shared.logs.JsonFormatter" if log_format == "json" else "shared.logs.TextFormatter"
    config["formatters"]["kevlaya"] = {"()": formatter}
    config["handlers"]["kevlaya"] = {"formatter": "kevlaya", "class": "logging.StreamHandler",
                                     "stream": "ext://sys.stderr"}
    config["loggers"]["kevlaya"] = {"handlers": ["kevlaya"], "level": "INFO", "propagate": False}
    return config


def api(reload: Annotated[bool, typer.Option(help="restart on code changes (development)")] = False) -> None:
    """Serve the REST API on KEVLAYA_API__HOST:KEVLAYA_API__PORT."""
    import uvicorn

    from api.http.connection_limits import connection_caps
    from api.http.head_limit import BoundedHeadProtocol
    from api.keys.bootstrap import retire_replaced_keys, start_problem

    require_own_schema()
    require_guarded_redis()
    settings = get_settings()
    if problem := start_problem(settings):
        fail(problem)
    for note in retire_replaced_keys(settings):
        typer.echo(note, err=True)
    caps = connection_caps(settings)
    if caps.clamped:
        typer.secho(f"KEVLAYA_CONNECTIONS__MAX={settings.connections.max} is more than the descriptor limit "
                    f"{caps.fd_limit} allows: {caps.total} (raise `ulimit -n` for more)", fg=typer.colors.YELLOW,
                    err=True)
    typer.echo(f"connections: at most {caps.total} per API process, {caps.per_address} per client address "
               f"(descriptor limit {caps.fd_limit})", err=True)
    # No WebSocket routes: an upgrade would hand the socket to a protocol outside the connection caps.
    uvicorn.run("api.main:create_app", factory=True, host=settings.api.host, port=settings.api.port,
                reload=reload, workers=None if reload else settings.api.workers, proxy_headers=True,
                log_level="info", log_config=api_log_config(settings.monitoring.log_format), http=BoundedHeadProtocol,
                ws="none", backlog=caps.backlog, timeout_keep_alive=settings.connections.idle_timeout_s)


def worker(loglevel: Annotated[str, typer.Option(help="Celery log level")] = "INFO") -> None:
    """Run the GPU worker: one Celery prefork child at concurrency 1 that loads the model."""
    require_own_schema()
    require_guarded_redis()
    # Without mingle and gossip: they sync revoked tasks and clocks with the other workers, and a job's state is its
    # row, never a Celery revoke; mingle also waited a second at every start for neighbours' replies.
    _run_celery(["-A", "worker.tasks", "worker", "--pool", "prefork", "--concurrency", "1",
                  "--prefetch-multiplier", "1", "-E", "--without-mingle", "--without-gossip",
                  "-n", f"kevlaya-{os.getpid()}@{socket.gethostname()}", "--loglevel", loglevel])


def worker_health() -> None:
    """Exit 0 when a worker on this host has reported in with its model loaded (for health checks)."""
    from shared.heartbeat import live_workers

    host = socket.gethostname()
    mine = {k: v for k, v in live_workers().items() if k.split(":")[0] == host}
    typer.echo(json.dumps(mine, indent=2))
    if not any(info.get("model_loaded") for info in mine.values()):
        raise typer.Exit(1)


LOCAL_NAMES = ("127.0.0.1", "localhost", "::1")


def _flower_answers_only(hosts: tuple[str, ...]) -> None:
    """Flower (Tornado) answers whatever Host a request names, so a web page whose name was rebound to this address
    could read it in the user's browser. Its pages are served here only to requests naming one of `hosts` (others
    get 404); Flower has no option of its own for this."""
    from flower.app import Flower
    from tornado.routing import HostMatches, Rule

    pattern = "^(" + "|".join(re.escape(host) for host in hosts) + ")$"
    build = Flower.__init__

    def checked(self: Flower, *args: Any, **kwargs: Any) -> None:
        build(self, *args, **kwargs)
        self.default_router.rules = [Rule(HostMatches(pattern), self.wildcard_router)]

    Flower.__init__ = checked  # type: ignore[method-assign]


def flower() -> None:
    """Serve Flower (queue monitoring) on KEVLAYA_FLOWER__HOST:KEVLAYA_FLOWER__PORT."""
    settings = get_settings()
    args = ["flower", f"--address={settings.flower.host}", f"--port={settings.flower.port}"]
    if settings.flower.db:  # task history survives a restart of Flower
        args += ["--persistent=True", f"--db={settings.flower.db}"]
    # Secrets travel in the environment, not on the command line, where `ps` shows them to every user.
    os.environ["CELERY_BROKER_URL"] = settings.redis.url
    os.environ.pop("FLOWER_BASIC_AUTH", None)
    if settings.flower.basic_auth:
        os.environ["FLOWER_BASIC_AUTH"] = settings.flower.basic_auth.get_secret_value()
    elif settings.flower.host not in LOCAL_NAMES:
        fail("Flower listens beyond localhost: set KEVLAYA_FLOWER__BASIC_AUTH=user:password")
    if settings.flower.host in LOCAL_NAMES:  # beyond, the names it is reached by are not known here
        _flower_answers_only(("127.0.0.1", "localhost", "[::1]", "::1"))
    _run_celery(args)


def run(
    flower: Annotated[bool, typer.Option(help="also serve Flower")] = True,
) -> None:
    """Run everything locally: migrate, find or start Redis, then the API, one worker and Flower."""
    from cli.local_run import run_local

    sys.exit(run_local(with_flower=flower))
