"""`kevlaya run`: the whole service on one machine with embedded defaults, as child processes."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import redis

from shared.keys import generate_key
from shared.settings import Settings, get_settings

log = logging.getLogger("kevlaya.run")
STATE_DIR = Path(".kevlaya")


def _redis_answers(url: str) -> bool:
    try:
        return bool(redis.Redis.from_url(url, socket_connect_timeout=1).ping())
    except redis.RedisError:
        return False


def ensure_redis(url: str) -> subprocess.Popen | None:
    """Use the Redis at `url`; if it is local and down, start one (persistent, never evicting)."""
    if _redis_answers(url):
        log.info("redis: using %s", url)
        return None
    parsed = urlparse(url)
    if parsed.hostname not in ("127.0.0.1", "localhost"):
        raise SystemExit(f"redis at {url} does not answer; start it or set KEVLAYA_REDIS_URL")
    server = shutil.which("redis-server")
    if server is None:
        raise SystemExit(
            f"redis at {url} does not answer and `redis-server` is not installed: install Redis "
            "(e.g. `apt-get install redis-server` or `brew install redis`) or set KEVLAYA_REDIS_URL"
        )
    data_dir = STATE_DIR / "redis"
    data_dir.mkdir(parents=True, exist_ok=True)
    port = str(parsed.port or 6379)
    log.info("redis: not running at %s, starting %s on port %s (data in %s)", url, server, port, data_dir)
    process = subprocess.Popen(
        [server, "--bind", "127.0.0.1", "--port", port, "--dir", str(data_dir.resolve()),
         "--appendonly", "yes", "--maxmemory-policy", "noeviction", "--save", ""],
        stdout=subprocess.DEVNULL,
    )
    for _ in range(50):
        if _redis_answers(url):
            return process
        time.sleep(0.1)
    process.terminate()
    raise SystemExit(f"started redis-server but it does not answer at {url}")


def local_api_key(settings: Settings) -> str:
    if settings.api_key:
        return settings.api_key.get_secret_value()
    path = STATE_DIR / "api_key"
    if not path.exists():
        STATE_DIR.mkdir(exist_ok=True)
        path.write_text(generate_key() + "\n")
        path.chmod(0o600)
    return path.read_text().strip()


def run_local(with_flower: bool = True) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = get_settings()
    from shared.migrate import upgrade

    upgrade(settings.database_url)
    log.info("database: %s (migrated)", settings.database_url)
    redis_process = ensure_redis(settings.redis_url)
    key = local_api_key(settings)
    env = {**os.environ, "KEVLAYA_API_KEY": key}
    kevlaya = [sys.executable, "-m", "shared.cli"]
    children = {
        "worker": subprocess.Popen([*kevlaya, "worker"], env=env),
        "api": subprocess.Popen([*kevlaya, "api"], env=env),
    }
    if with_flower:
        children["flower"] = subprocess.Popen([*kevlaya, "flower"], env=env)
    print(
        f"\n  API     http://{settings.api_host}:{settings.api_port}  (docs at /docs)\n"
        + (f"  Flower  http://{settings.flower_host}:{settings.flower_port}\n" if with_flower else "")
        + f"  API key {key}  (saved in {STATE_DIR / 'api_key'} unless KEVLAYA_API_KEY is set)\n"
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
    return exit_code
