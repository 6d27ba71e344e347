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


def schema_problem(url: str) -> str | None:
    """Why the database at `url` cannot be used yet — it does not answer, or its schema is not at the newest
    migration — in one line that says what to do; None when it can."""
    from alembic.runtime.migration import MigrationContext
    from alembic.script import ScriptDirectory

    shown = make_url(url).render_as_string(hide_password=True)
    head = ScriptDirectory.from_config(alembic_config(url)).get_current_head()
    engine = make_engine(url)
    try:
        with engine.connect() as connection:
            current = MigrationContext.configure(connection).get_current_revision()
    except OperationalError as exc:
        reason = str(exc.orig).strip().splitlines()[0] if exc.orig else str(exc)
        return f"database {shown} does not answer: {reason}"
    finally:
        engine.dispose()
    if current != head:
        return (f"database {shown} is at migration {current or 'none (no tables)'}, this version needs {head}: "
                "run `kevlaya db upgrade` first")
    return None
