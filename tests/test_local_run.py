"""The README's run path on a fresh clone: embedded defaults (SQLite file in the working directory, a
Redis it starts itself, the shipped demo model, CPU), jobs submitted with curl get decisions, Flower answers."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import redis

from tests.conftest import free_port, wait_until

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[1]


def curl(*args: str) -> dict:
    output = subprocess.run(["curl", "-sS", "--fail-with-body", *args], check=True, capture_output=True, text=True)
    return json.loads(output.stdout)


@pytest.fixture
def fresh_clone(tmp_path: Path) -> Path:
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True)
    # the tests run on the working tree, which may be ahead of the last commit
    for name in ("api", "worker", "shared", "migrations"):
        shutil.rmtree(clone / name)
        shutil.copytree(REPO / name, clone / name, ignore=shutil.ignore_patterns("__pycache__"))
    return clone


def test_run_on_embedded_defaults_serves_a_job_submitted_with_curl(fresh_clone: Path, tmp_path: Path):
    api_port, flower_port, redis_port = free_port(), free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KEVLAYA_")}
    env.update(KEVLAYA_API_PORT=str(api_port), KEVLAYA_FLOWER_PORT=str(flower_port),
               # a port where nothing listens: `run` must start its own Redis there
               KEVLAYA_REDIS_URL=f"redis://127.0.0.1:{redis_port}/0")
    log = open(tmp_path / "run.log", "wb")
    run = subprocess.Popen([sys.executable, "-m", "shared.cli", "run"], cwd=fresh_clone, env=env,
                           stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{api_port}"
    try:
        def ready() -> bool:
            assert run.poll() is None, (tmp_path / "run.log").read_text()[-3000:]
            try:
                return httpx.get(f"{base}/readyz").status_code == 200
            except httpx.TransportError:
                return False

        wait_until(ready, 180, interval=0.5, what="`kevlaya run` to be ready")
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

        assert (fresh_clone / "kevlaya.db").exists()  # the default SQLite file, in the working directory
        flower = wait_until(lambda: _get(f"http://127.0.0.1:{flower_port}/"), 60, what="Flower")
        assert flower.status_code == 200 and "Flower" in flower.text
    finally:
        os.killpg(run.pid, signal.SIGINT)
        run.wait(60)
        log.close()
    assert run.returncode == 0
    # Ctrl-C stops everything it started, the Redis included
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{base}/healthz")
    with pytest.raises(redis.ConnectionError):
        redis.Redis(port=redis_port).ping()


def _get(url: str) -> httpx.Response | None:
    try:
        return httpx.get(url, timeout=5)
    except httpx.TransportError:
        return None
