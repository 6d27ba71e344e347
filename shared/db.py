"""Engine and sessions. One engine per process: the worker child builds its own after the fork."""

from __future__ import annotations

import fcntl
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.orm import Session, sessionmaker

from shared.settings import get_settings


def make_engine(url: str) -> Engine:
    settings = get_settings()
    if url.startswith("sqlite"):
        # As many connections as the API has request threads: past the pool size each checkout would open
        # (and set up) a new connection, and close it again.
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30},
                               pool_size=settings.database.pool_size, max_overflow=settings.database.pool_size,
                               pool_timeout=settings.database.pool_timeout_s)

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_connection, _record):  # noqa: ANN001
            # WAL lets the API read while the worker writes; foreign keys are off by default in SQLite.
            cursor = dbapi_connection.cursor()
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA busy_timeout=30000")
            cursor.execute("PRAGMA foreign_keys=ON")
            cursor.execute(f"PRAGMA synchronous={settings.database.sqlite_synchronous}")
            cursor.close()

        return engine
    return create_engine(url, pool_pre_ping=True, pool_size=settings.database.pool_size, max_overflow=20,
                         pool_timeout=settings.database.pool_timeout_s)


@lru_cache
def get_engine() -> Engine:
    return make_engine(get_settings().database.url)


@lru_cache
def _session_factory() -> sessionmaker[Session]:
    return sessionmaker(get_engine(), expire_on_commit=False)


def reset_engine() -> None:
    """Forget this process's engine (after a fork, or when settings change in tests)."""
    if get_engine.cache_info().currsize:
        get_engine().dispose(close=False)
    get_engine.cache_clear()
    _session_factory.cache_clear()


def new_session() -> Session:
    return _session_factory()()


@contextmanager
def session_scope() -> Iterator[Session]:
    """A unit of work: commits on success, rolls back on error."""
    with new_session() as session, session.begin():
        yield session


@contextmanager
def write_scope() -> Iterator[Session]:
    """A unit of work that writes: `session_scope` inside `one_writer`, so on SQLite the worker's writers and the
    API's take turns on locks that hand over at once. Never opened while holding a lock a writer may wait for."""
    with new_session() as session, one_writer(session), session.begin():
        yield session


_sqlite_writer = threading.Lock()
_lock_files: dict[tuple[int, str], int] = {}  # (process, database file) -> its lock file, opened once


@contextmanager
def one_writer(session: Session) -> Iterator[None]:
    """Held around a write and its commit where the database takes one writer at a time (SQLite). Writers then
    queue on locks that hand over at once (threads of this process on a lock, API processes on an advisory
    lock on a file beside the database) instead of on SQLite's busy handler, which retries after sleeps of up
    to 100 ms: under concurrent submits that was most of the slowest answers' time."""
    bind = session.get_bind()
    if bind.dialect.name != "sqlite":
        yield
        return
    database = bind.url.database
    with _sqlite_writer:
        if not database or database == ":memory:":
            yield
            return
        lock_file = _lock_file(database)
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


def _lock_file(database: str) -> int:
    # Per process: a forked child must not share its parent's open file (and with it the parent's lock).
    key = (os.getpid(), database)
    if key not in _lock_files:
        _lock_files[key] = os.open(f"{database}-writer.lock", os.O_RDWR | os.O_CREAT, 0o600)
    return _lock_files[key]
