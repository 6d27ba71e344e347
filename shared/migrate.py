"""Apply Alembic migrations from code (the CLI, the local run, tests), wherever the package is installed."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import make_url, text
from sqlalchemy.exc import OperationalError
from tenacity import retry, retry_if_exception_type, stop_after_delay, wait_fixed

import migrations
from shared.db import make_engine


def alembic_config(url: str) -> Config:
    config = Config()
    config.set_main_option("script_location", str(Path(migrations.__file__).parent))
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return config


def wait_for_database(url: str, timeout_s: float = 60) -> None:
    """A container's database may still be starting; retry until it answers or the timeout passes."""

    @retry(retry=retry_if_exception_type(OperationalError), stop=stop_after_delay(timeout_s),
           wait=wait_fixed(1), reraise=True)
    def ping() -> None:
        engine = make_engine(url)
        try:
            with engine.connect() as connection:
                connection.execute(text("SELECT 1"))
        finally:
            engine.dispose()

    ping()


def upgrade(url: str, revision: str = "head") -> None:
    if url.startswith("sqlite:///"):
        Path(url.removeprefix("sqlite:///")).expanduser().parent.mkdir(parents=True, exist_ok=True)
    command.upgrade(alembic_config(url), revision)


def downgrade(url: str, revision: str) -> None:
    command.downgrade(alembic_config(url), revision)


def _revisions(url: str) -> tuple[str | None, str | None, bool]:
    """(the database's revision, this version's newest, whether this version knows the database's revision).
    Raises OperationalError when the database does not answer."""
    from alembic.runtime.migration import MigrationContext
    from alembic.script import ScriptDirectory
    from alembic.util.exc import CommandError

    script = ScriptDirectory.from_config(alembic_config(url))
    engine = make_engine(url)
    try:
        with engine.connect() as connection:
            current = MigrationContext.configure(connection).get_current_revision()
    finally:
        engine.dispose()
    try:
        known = current is None or script.get_revision(current) is not None
    except CommandError:  # alembic names a revision it has no script for this way
        known = False
    return current, script.get_current_head(), known


def _newer(shown: str, current: str | None, head: str | None) -> str:
    return (f"database {shown} was migrated by a newer version of kevlaya (migration {current}); this version "
            f"knows migrations up to {head}: run the newer version, or point KEVLAYA_DATABASE__URL at another "
            "database")


def schema_problem(url: str) -> str | None:
    """Why the database at `url` cannot be used yet — it does not answer, or its schema is not this version's
    newest migration — in one line that says what to do; None when it can."""
    shown = make_url(url).render_as_string(hide_password=True)
    try:
        current, head, known = _revisions(url)
    except OperationalError as exc:
        reason = str(exc.orig).strip().splitlines()[0] if exc.orig else str(exc)
        return f"database {shown} does not answer: {reason}"
    if not known:
        return _newer(shown, current, head)
    if current != head:
        return (f"database {shown} is at migration {current or 'none (no tables)'}, this version needs {head}: "
                "run `kevlaya db upgrade` first")
    return None


def foreign_schema(url: str) -> str | None:
    """`schema_problem` for processes that may start before their database answers (the API, the worker): None
    when it does not answer yet (they report it and retry), the problem when its schema is not theirs."""
    problem = schema_problem(url)
    return None if problem is None or " does not answer: " in problem else problem


def newer_schema(url: str) -> str | None:
    """Why `kevlaya db upgrade` must not touch the database: it was migrated by a newer version."""
    try:
        current, head, known = _revisions(url)
    except OperationalError:
        return None
    return None if known else _newer(make_url(url).render_as_string(hide_password=True), current, head)
