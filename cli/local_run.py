"""`kevlaya run`: the whole service on one machine with embedded defaults, as child processes."""

from __future__ import annotations

import logging
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlparse

from shared import redis_server
from shared.keys import generate_key, weak_key_problem
from shared.logs import masked_url
from shared.redis_auth import has_password, with_password
from shared.settings import Settings, get_settings

log = logging.getLogger("kevlaya.run")
STATE_DIR = Path(".kevlaya")


def ensure_redis(url: str) -> tuple[str, subprocess.Popen | None]:
    """The Redis URL the service is to use, and the server started for it, if one was. The Redis at `url` is used
    when it answers; one on this host started here (persistent, never evicting) asks for a password, generated and
    kept in `.kevlaya/redis_password`: without one any local user reads every job's live output and writes into it."""
    parsed = urlparse(url)
    local = parsed.hostname in ("127.0.0.1", "localhost")
    kept = (STATE_DIR / "redis_password").read_text().strip() if (STATE_DIR / "redis_password").is_file() else None
    if local and kept and not has_password(url):  # ours from an earlier start may still run: it wants the password
        guarded = with_password(url, kept)
        if redis_server.answers(guarded):
            log.info("redis: using %s", masked_url(guarded))
            return guarded, None
    if redis_server.answers(url):
        if not has_password(url):
            log.warning("redis: %s has no password: every local user can read and write its queue and the jobs' live "
                        "output (stop it to have `kevlaya run` start one with a password)", url)
        log.info("redis: using %s", masked_url(url))
        return url, None
    if not local:
        raise SystemExit(f"redis at {masked_url(url)} does not answer; start it or set KEVLAYA_REDIS__URL")
    try:
        binary = redis_server.redis_server_binary()
    except redis_server.RedisServerError as exc:
        raise SystemExit(f"redis at {masked_url(url)} does not answer and none can be started: {exc}") from None
    data_dir = STATE_DIR / "redis"
    port = parsed.port or 6379
    password = parsed.password or kept_secret("redis_password", lambda: secrets.token_urlsafe(32))[0]
    log.info("redis: not running at %s, starting %s on port %s (data in %s, password in %s)", masked_url(url), binary,
             port, data_dir, "KEVLAYA_REDIS__URL" if parsed.password else STATE_DIR / "redis_password")
    try:
        process = redis_server.start_redis_server(port, data_dir, persistent=True, binary=binary, password=password)
    except redis_server.RedisServerError as exc:
        raise SystemExit(str(exc)) from None
    return (url if parsed.password else with_password(url, password)), process


def kept_secret(name: str, make: Callable[[], str]) -> tuple[str, bool]:
    """The secret kept in `.kevlaya/<name>`, made (and written readable by this user alone) on first use; True when
    made now."""
    path = STATE_DIR / name
    STATE_DIR.mkdir(mode=0o700, exist_ok=True)
    try:
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # never readable by others, even briefly
    except FileExistsError:
        return path.read_text().strip(), False
    secret = make()
    with os.fdopen(descriptor, "w") as file:
        file.write(secret + "\n")
    return secret, True


def local_api_key(settings: Settings) -> tuple[str, str]:
    """The admin key, and what to print about it: the key itself only when it was made now (shown once), else where
    it is kept."""
    if settings.api.key:
        return settings.api.key.get_secret_value(), "from KEVLAYA_API__KEY"
    key, made = kept_secret("api_key", generate_key)
    path = STATE_DIR / "api_key"
    return key, (f"{key}  (new: shown this once, kept in {path}, readable by you alone)" if made else f"in {path}")


def flower_login(settings: Settings) -> tuple[str, str]:
    """Flower's `user:password`, and what to print about it, as for the API key: KEVLAYA_FLOWER__BASIC_AUTH, else a
    generated password kept in `.kevlaya/flower_auth`."""
    if settings.flower.basic_auth:
        return settings.flower.basic_auth.get_secret_value(), "login from KEVLAYA_FLOWER__BASIC_AUTH"
    login, made = kept_secret("flower_auth", lambda: f"kevlaya:{secrets.token_urlsafe(18)}")
    path = STATE_DIR / "flower_auth"
    user, _, password = login.partition(":")
    return login, (f"login {user} / {password}  (new: shown this once, kept in {path})" if made
                   else f"login in {path}")


def run_local(with_flower: bool = True) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Everything this command and its children create (the database, keys, uploaded and output files, Redis's
    # append-only file, the model cache) is private to this user from the start, not chmod-ed afterwards.
    os.umask(0o077)
    settings = get_settings()
    if settings.api.key and (problem := weak_key_problem(settings.api.key.get_secret_value())):
        log.error("%s", problem)
        return 2
    from shared.migrate import newer_schema, upgrade

    if problem := newer_schema(settings.database.url):
        log.error("%s", problem)
        return 2
    upgrade(settings.database.url)
    log.info("database: %s (migrated)", masked_url(settings.database.url))
    kevlaya = [sys.executable, "-m", "cli"]
    # The base first (a GGUF base is read into its cache once), so the API and the worker both start on it.
    if subprocess.run([*kevlaya, "models", "prepare"]).returncode != 0:
        return 2
    redis_url, redis_process = ensure_redis(settings.redis.url)
    key, key_note = local_api_key(settings)
    # Secrets reach the children in their environment, which only this user can read; never on a command line.
    env = {**os.environ, "KEVLAYA_API__KEY": key, "KEVLAYA_REDIS__URL": redis_url}
    children = {
        "worker": subprocess.Popen([*kevlaya, "worker"], env=env),
        "api": subprocess.Popen([*kevlaya, "api"], env=env),
    }
    flower_note = ""
    if with_flower:
        login, flower_note = flower_login(settings)
        children["flower"] = subprocess.Popen([*kevlaya, "flower"], env={**env, "KEVLAYA_FLOWER__BASIC_AUTH": login})
    print(
        f"\n  API     http://{settings.api.host}:{settings.api.port}  (docs at /docs)\n"
        + (f"  Flower  http://{settings.flower.host}:{settings.flower.port}  {flower_note}\n" if with_flower else "")
        + f"  API key {key_note}\n"
        "  Ctrl-C stops everything.\n",
        flush=True,
    )

    stopping = False

    def stop(_signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    exit_code = 0
    while not stopping:
        for name, child in children.items():
            if child.poll() is not None:
                log.error("%s exited with code %s; stopping the others", name, child.returncode)
                exit_code, stopping = 1, True
        time.sleep(0.5)
    for child in children.values():
        if child.poll() is None:
            child.terminate()
    for child in children.values():
        try:
            child.wait(timeout=30)
        except subprocess.TimeoutExpired:
            child.kill()
    if redis_process is not None:
        redis_process.terminate()
        redis_process.wait(timeout=10)
    log.info("everything stopped (exit code %s)", exit_code)
    return exit_code
