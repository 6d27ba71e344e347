"""An upgrade in place from the previous release: its database and files, with jobs queued, a file batch half done,
finished jobs and a client's open stream, are taken over by this version (its migrations, the previous release's
flat setting names read with a warning naming the new ones); everything queued finishes once, nothing stored is
lost, the stream resumes where it stopped, and the previous release then refuses the upgraded database, naming
the migrations. The previous release is built from git, from the commit below."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import httpx
import pytest

from shared.migrate import downgrade
from shared.settings import FLAT_NAMES, grouped_variable
from tests.conftest import AUTH, ServiceProcess, submit, wait_finished, wait_until
from tests.test_streaming import follow

pytestmark = pytest.mark.integration

# The last release whose settings were flat and whose migrations ended at 0009.
PREVIOUS_RELEASE = "760e283d22a99578dd9559564b2c9d7599963d27"
PREVIOUS_HEAD = "0009"
ROOT = Path(__file__).resolve().parent.parent


def previous_release(into: Path) -> Path:
    """The previous release's source, from git."""
    archive = subprocess.run(["git", "archive", "--format=tar", PREVIOUS_RELEASE, "api", "cli", "shared", "worker",
                              "migrations", "modellab", "alembic.ini"], cwd=ROOT, capture_output=True, check=True)
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(into, filter="data")
    return into


def flat(env: dict[str, str]) -> dict[str, str]:
    """The same settings under the previous release's names (`KEVLAYA_DATABASE__URL` → `KEVLAYA_DATABASE_URL`)."""
    old_name = {grouped_variable(field): f"KEVLAYA_{old.upper()}" for old, field in FLAT_NAMES.items()}
    return {old_name.get(name, name): value for name, value in env.items()}


def start(kind: str, env: dict[str, str], log: Path, started: list, cwd: Path) -> ServiceProcess:  # noqa: ANN001
    process = ServiceProcess([sys.executable, "-m", "cli", kind], {**env, "PYTHONPATH": str(cwd)}, log, cwd=cwd)
    started.append(process)
    return process


def api_at(process: ServiceProcess, port: str) -> httpx.Client:
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", headers=AUTH, timeout=30)

    def healthy() -> bool:
        assert process.process.poll() is None, process.output()
        try:
            return client.get("/healthz").status_code == 200
        except httpx.TransportError:
            return False

    wait_until(healthy, 90, what="the API to answer")
    return client


def ready(api: httpx.Client, worker: ServiceProcess) -> None:
    def answered() -> bool:
        assert worker.process.poll() is None, worker.output()
        return api.get("/readyz").status_code == 200

    wait_until(answered, 120, interval=0.2, what="a worker with its model loaded")


def cli(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cli", *args], env={**os.environ, **env, "PYTHONPATH": str(cwd)},
                          cwd=cwd, capture_output=True, text=True, timeout=180)


def as_shown_now(job: dict) -> dict:
    """A job the previous release showed, as this version shows it: less the column that only held a constant
    (migration 0010), with no adapter version (migration 0012: one answered before it has none on record)."""
    timings = {k: v for k, v in job["timings"].items() if k != "switch_ms"}
    return {**job, "timings": timings, "adapter_version": None,
            **({"cascade": [as_shown_now(stage) for stage in job["cascade"]]} if job.get("cascade") else {})}


def batch_file(lines: int) -> bytes:
    body = {"messages": [{"role": "user", "content": "Options A cost 3, B cost 5."}], "max_tokens": 6,
            "response_format": {"type": "text"}}
    return "".join(json.dumps({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
                               "body": {**body, "model": ["kev", "laya"][i % 2]}}) + "\n"
                   for i in range(lines)).encode()


def test_an_upgrade_in_place_keeps_and_finishes_everything_the_previous_release_stored(env, tmp_path, start_process,
                                                                                         monkeypatch):
    old_tree = previous_release(tmp_path / "previous")
    old_env = flat(env)
    for name in os.environ:  # the processes get the previous release's names only
        if name.startswith("KEVLAYA_"):
            monkeypatch.delenv(name)
    assert "KEVLAYA_DATABASE_URL" in old_env and "KEVLAYA_DATABASE__URL" not in old_env
    started = start_process.started
    port = env["KEVLAYA_API__PORT"]

    # -- the previous release: finished jobs, then jobs queued, a batch's lines queued and an open stream --
    downgrade(env["KEVLAYA_DATABASE__URL"], "base")  # an empty database, as the previous release first met it
    migrated = cli(["db", "upgrade"], old_env, old_tree)
    assert migrated.returncode == 0, migrated.stdout + migrated.stderr
    old_api_process = start("api", old_env, tmp_path / "old-api.log", started, old_tree)
    old_api = api_at(old_api_process, port)
    old_worker = start("worker", old_env, tmp_path / "old-worker.log", started, old_tree)
    ready(old_api, old_worker)
    finished_ids = [submit(old_api, adapter, f"Before the upgrade, {adapter}.", max_new_tokens=8)
                    for adapter in ("kev", "laya", "auto")]
    finished_before = {job["id"]: job for job in wait_finished(old_api, finished_ids)}
    assert all(job["status"] == "succeeded" for job in finished_before.values())
    old_worker.kill(15)

    queued_ids = [submit(old_api, adapter, f"Queued across the upgrade, {i}.", max_new_tokens=8)
                  for i, adapter in enumerate(["kev", "laya", "auto"] * 2)]
    uploaded = old_api.post("/v1/files", data={"purpose": "batch"},
                            files={"file": ("lines.jsonl", io.BytesIO(batch_file(6)))})
    assert uploaded.status_code == 200, uploaded.text
    batch = old_api.post("/v1/batches", json={"input_file_id": uploaded.json()["id"],
                                              "endpoint": "/v1/chat/completions", "completion_window": "24h"})
    assert batch.status_code == 200, batch.text
    batch_id = batch.json()["id"]
    wait_until(lambda: old_api.get(f"/v1/batches/{batch_id}").json()["status"] == "in_progress", 60,
               what="the previous release to store the batch's lines")
    watched = queued_ids[0]
    seen_before = follow(old_api, watched, stop_after=1)
    assert [e["event"] for e in seen_before] == ["status"] and seen_before[0]["data"]["status"] == "queued"
    old_api.close()
    old_api_process.kill(15)

    # -- this version, on the same database, files and Redis, with the previous release's variable names --
    upgraded = cli(["db", "upgrade"], old_env, ROOT)
    assert upgraded.returncode == 0, upgraded.stdout + upgraded.stderr
    assert "KEVLAYA_DATABASE_URL is deprecated; use KEVLAYA_DATABASE__URL" in upgraded.stderr
    api_process = start("api", old_env, tmp_path / "api.log", started, ROOT)
    api = api_at(api_process, port)
    resumed = []
    worker = start("worker", old_env, tmp_path / "worker.log", started, ROOT)
    ready(api, worker)
    # a queued job's first event comes from its row and carries no id: the client reconnects from the start
    follow(api, watched, last_event_id=seen_before[-1].get("id"), into=resumed)

    done = {job["id"]: job for job in wait_finished(api, queued_ids)}
    assert all(job["status"] == "succeeded" and job["attempts"] == 1 for job in done.values()), done
    for job_id, before in finished_before.items():  # nothing stored is lost or changed
        after = api.get(f"/v1/jobs/{job_id}").json()
        assert after == as_shown_now(before), job_id
    wait_until(lambda: api.get(f"/v1/batches/{batch_id}").json()["status"] == "completed", 180,
               what="the batch to complete")
    counts = api.get(f"/v1/batches/{batch_id}").json()["request_counts"]
    assert counts == {"total": 6, "completed": 6, "failed": 0}
    output_id = api.get(f"/v1/batches/{batch_id}").json()["output_file_id"]
    lines = [json.loads(line) for line in api.get(f"/v1/files/{output_id}/content").text.splitlines()]
    assert sorted(line["custom_id"] for line in lines) == [f"line-{i}" for i in range(6)]

    ids = [e["id"] for e in resumed if "id" in e]
    assert len(ids) == len(set(ids))  # nothing repeated
    assert resumed[-1]["event"] == "done" and resumed[-1]["data"]["status"] == "succeeded"
    deltas = [e["data"]["text"] for e in resumed if e["event"] == "delta"]
    if deltas:  # followed while it ran: its deltas are its whole text, nothing missing
        assert "".join(deltas) == done[watched]["result"]["text"], resumed
    else:  # it ended before the client came back (a loaded machine): `done` alone is its whole story (docs/api.md)
        assert [e["event"] for e in resumed] == ["done"], resumed
        assert resumed[-1]["data"]["result"]["text"] == done[watched]["result"]["text"]
    for process in (api_process, worker):
        process.log.flush()
        assert "KEVLAYA_DATABASE_URL is deprecated; use KEVLAYA_DATABASE__URL" in process.log_path.read_text()
    api.close()

    # -- the previous release refuses the upgraded database, naming the migrations --
    refused = cli(["api"], old_env, old_tree)
    output = refused.stdout + refused.stderr
    assert refused.returncode == 2, output[-2000:]
    assert "migrated by a newer version of kevlaya" in output and f"up to {PREVIOUS_HEAD}" in output, output[-2000:]
    assert "Traceback" not in output
