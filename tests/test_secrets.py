"""No secret in logs or on screen (RELIABILITY.md, Security): `kevlaya db upgrade` and `kevlaya run` show database
URLs with the password masked; `kevlaya run` shows the admin key once, when it makes it, and where it is kept after;
the Flower it starts asks for a login and answers only requests that name a local host. Real commands, a real
PostgreSQL with a password role, loopback only."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from sqlalchemy.engine import make_url

from tests.conftest import free_port, login_role, wait_until

KEVLAYA = Path(sys.executable).parent / "kevlaya"
PASSWORD = f"pw{uuid.uuid4().hex}"
POSTGRESQL = pytest.mark.parametrize("database_url", ["postgresql"], indirect=True)


@pytest.fixture
def password_url(database_url: str) -> Iterator[str]:
    """This test's database as a role that logs in with PASSWORD."""
    with login_role(database_url, PASSWORD) as url:
        yield url


def kevlaya(*args: str, env: dict[str, str], cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(KEVLAYA), *args], env={**os.environ, **env}, cwd=cwd, capture_output=True, text=True,
                          timeout=120)


@POSTGRESQL
def test_db_upgrade_shows_the_url_without_its_password(service_env, password_url):
    done = kevlaya("db", "upgrade", env={"KEVLAYA_DATABASE__URL": password_url})
    assert done.returncode == 0, done.stderr
    assert PASSWORD not in done.stdout + done.stderr
    assert ":***@" in done.stdout
    unreachable = make_url(password_url).set(host="127.0.0.1", port=free_port())
    refused = kevlaya("db", "upgrade", "--wait", "0.5",
                      env={"KEVLAYA_DATABASE__URL": unreachable.render_as_string(hide_password=False)})
    assert refused.returncode == 2 and "does not answer" in refused.stderr
    assert PASSWORD not in refused.stdout + refused.stderr


class Run:
    """`kevlaya run` in `cwd`, its output collected."""

    def __init__(self, env: dict[str, str], cwd: Path) -> None:
        self.log = cwd / f"run-{time.monotonic_ns()}.log"
        with self.log.open("wb") as log:
            self.process = subprocess.Popen([str(KEVLAYA), "run"], env={**os.environ, **env}, cwd=cwd, stdout=log,
                                            stderr=subprocess.STDOUT, start_new_session=True)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def banner(self) -> str:
        wait_until(lambda: "Ctrl-C stops everything" in self.output() or self.process.poll() is not None, 120,
                   what="kevlaya run's banner")
        assert self.process.poll() is None, self.output()
        return self.output()

    def stop(self) -> str:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGINT)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(10)
        return self.output()


@POSTGRESQL
def test_kevlaya_run_shows_the_key_once_no_password_and_a_flower_behind_a_login(worker_env, password_url, tmp_path):
    flower_port = free_port()
    env = {**worker_env, "KEVLAYA_DATABASE__URL": password_url, "KEVLAYA_API__PORT": str(free_port()),
           "KEVLAYA_FLOWER__PORT": str(flower_port), "KEVLAYA_API__KEY": "", "KEVLAYA_FLOWER__BASIC_AUTH": ""}
    first = Run(env, tmp_path)
    try:
        banner = first.banner()
        key = (tmp_path / ".kevlaya" / "api_key").read_text().strip()
        assert banner.count(key) == 1, banner  # shown once, as it is made
        assert (tmp_path / ".kevlaya" / "api_key").stat().st_mode & 0o077 == 0
        login = (tmp_path / ".kevlaya" / "flower_auth").read_text().strip()
        user, _, password = login.partition(":")
        flower = f"http://127.0.0.1:{flower_port}/api/workers"

        def flower_answers() -> bool:
            try:
                return httpx.get(flower, timeout=2).status_code == 401
            except httpx.TransportError:
                return False

        wait_until(flower_answers, 60, what="Flower to answer, asking for a login")
        assert httpx.get(flower, auth=(user, password), timeout=10).status_code == 200
        assert httpx.get(flower, auth=(user, "wrong"), timeout=10).status_code == 401
        rebound = httpx.get(flower, auth=(user, password), headers={"Host": f"evil.example:{flower_port}"},
                            timeout=10)
        assert rebound.status_code == 404  # a page whose name was rebound to 127.0.0.1 reads nothing
    finally:
        output = first.stop()
    assert PASSWORD not in output and login not in output.replace(f"{user} / {password}", "")

    second = Run(env, tmp_path)
    try:
        banner = second.banner()
    finally:
        output = second.stop()
    assert key not in output and password not in output, banner  # the second start names where they are kept
    assert ".kevlaya/api_key" in banner and ".kevlaya/flower_auth" in banner
    assert PASSWORD not in output


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)  # the SQLite file is one of the files checked
def test_kevlaya_run_creates_its_database_keys_and_files_private_to_its_user(worker_env, tmp_path):
    """A local user other than the one who runs it reads nothing `kevlaya run` made: every file and directory it
    creates has no group or world bits, from the moment it is created."""
    env = {**worker_env, "KEVLAYA_DATABASE__URL": f"sqlite:///{tmp_path / 'run.db'}",
           "KEVLAYA_API__PORT": str(free_port()), "KEVLAYA_FLOWER__PORT": str(free_port()),
           "KEVLAYA_BATCH__FILES_DIR": ".kevlaya/files", "KEVLAYA_API__KEY": "", "KEVLAYA_FLOWER__BASIC_AUTH": ""}
    run = Run(env, tmp_path)
    try:
        run.banner()
        key = (tmp_path / ".kevlaya" / "api_key").read_text().strip()
        api = f"http://127.0.0.1:{env['KEVLAYA_API__PORT']}"
        wait_until(lambda: _answers(f"{api}/healthz"), 60, what="the API")
        uploaded = httpx.post(f"{api}/v1/files", headers={"Authorization": f"Bearer {key}"},
                              data={"purpose": "batch"}, files={"file": ("in.jsonl", b'{"x": 1}\n')}, timeout=30)
        assert uploaded.status_code in (200, 400, 422), uploaded.text  # stored or refused: either way on disk first
    finally:
        run.stop()
    made = [tmp_path / "run.db", *(tmp_path / ".kevlaya").rglob("*"), tmp_path / ".kevlaya"]
    assert any(p.name == "api_key" for p in made) and any(p.name == "files" for p in made)
    loose = {str(p.relative_to(tmp_path)): oct(p.stat().st_mode & 0o777) for p in made if p.stat().st_mode & 0o077}
    assert not loose, loose


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.TransportError:
        return False
