"""Adapters as versioned data (docs/architecture.md §10): an adapter's version is the SHA-256 of its config and
weights, the worker records each version it loads, and every job records the version that answered it."""

from __future__ import annotations

import hashlib
import json
import shutil
import uuid
from datetime import datetime
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import create_engine, inspect, select

from api.batch.file_batches import _result_line
from api.jobs.presenters import job_out
from shared import db
from shared.adapter_identity import AdapterIdentity, describe_adapter
from shared.adapter_versions import last_loaded, record_loaded
from shared.manifest import MANIFEST_NAME, adapter_sha256
from shared.migrate import downgrade, upgrade
from shared.models import AdapterVersion, Job
from shared.settings import DEMO_MODEL_DIR
from tests.conftest import reset_process_state, start_worker, submit, wait_finished
from tests.test_cascade_and_chat import forced_decision


@pytest.fixture
def adapter_copy(tmp_path: Path) -> Path:
    """The demo model's Laya, copied where a test may change it."""
    return Path(shutil.copytree(DEMO_MODEL_DIR / "laya", tmp_path / "laya"))


def flip_a_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def test_the_version_is_the_digest_of_the_config_and_weights_lines_of_the_manifest(adapter_copy):
    """The documented recipe: `sha256sum adapter_config.json adapter_model.safetensors | sha256sum`, which are the
    manifest's own lines for those two files."""
    lines = [line for line in (adapter_copy / MANIFEST_NAME).read_text().splitlines(keepends=True)
             if line.rstrip("\n").endswith(("  adapter_config.json", "  adapter_model.safetensors"))]
    assert len(lines) == 2
    assert adapter_sha256(adapter_copy) == hashlib.sha256("".join(lines).encode()).hexdigest()  # names sorted
    assert adapter_sha256(adapter_copy) == adapter_sha256(DEMO_MODEL_DIR / "laya")  # stable: where it lies is not it


def test_one_weight_byte_changes_the_version_and_files_beside_the_weights_do_not(adapter_copy):
    original = adapter_sha256(adapter_copy)
    weights = adapter_copy / "adapter_model.safetensors"
    flip_a_byte(weights, weights.stat().st_size - 1)  # the last byte: a tensor's, not the header's
    changed = adapter_sha256(adapter_copy)
    assert changed != original
    flip_a_byte(weights, weights.stat().st_size - 1)
    assert adapter_sha256(adapter_copy) == original

    (adapter_copy / "calibration.json").write_text(json.dumps({"exponent": 2.0}))
    assert adapter_sha256(adapter_copy) == original  # recorded beside the version (`calibrated`), not part of it
    config = json.loads((adapter_copy / "adapter_config.json").read_text())
    (adapter_copy / "adapter_config.json").write_text(json.dumps({**config, "lora_alpha": 1}))
    assert adapter_sha256(adapter_copy) != original


def test_an_adapter_is_described_by_its_config(adapter_copy):
    described = describe_adapter("laya", adapter_copy, "models/demo/base")
    config = json.loads((adapter_copy / "adapter_config.json").read_text())
    assert (described.name, described.sha256, described.rank, described.base) == (
        "laya", adapter_sha256(adapter_copy), config["r"], "models/demo/base")
    assert described.target_modules == sorted(config["target_modules"]) and described.calibrated
    (adapter_copy / "calibration.json").unlink()
    assert not describe_adapter("laya", adapter_copy, "models/demo/base").calibrated
    (adapter_copy / "adapter_model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="adapter_model"):
        adapter_sha256(adapter_copy)


def test_a_version_loaded_again_is_the_same_row(database_url, monkeypatch, adapter_copy):
    monkeypatch.setenv("KEVLAYA_DATABASE__URL", database_url)
    reset_process_state()
    laya = describe_adapter("laya", adapter_copy, "models/demo/base")
    flip_a_byte(adapter_copy / "adapter_model.safetensors", 100)
    newer = describe_adapter("laya", adapter_copy, "models/demo/base")

    def load(*versions: AdapterIdentity) -> tuple[list[AdapterVersion], str]:
        """Record `versions` as one worker's load; then the rows, oldest first, and the version loaded last."""
        with db.write_scope() as session:
            record_loaded(session, versions)
        with db.session_scope() as session:
            rows = session.scalars(select(AdapterVersion).order_by(AdapterVersion.first_loaded_at)).all()
            session.expunge_all()
            return rows, last_loaded(session)["laya"].sha256

    [first], _ = load(laya)
    rows, served = load(laya)
    assert [(r.sha256, r.first_loaded_at) for r in rows] == [(laya.sha256, first.first_loaded_at)]
    assert rows[0].loaded_at > first.loaded_at and served == laya.sha256
    rows, served = load(newer)
    assert [r.sha256 for r in rows] == [laya.sha256, newer.sha256] and served == newer.sha256
    rows, served = load(laya)  # a worker goes back to the older version: that one is served again
    assert len(rows) == 2 and served == laya.sha256
    assert (rows[0].rank, rows[0].base, rows[0].calibrated) == (laya.rank, "models/demo/base", True)
    reset_process_state()


def test_the_migration_adds_the_table_and_the_column_and_takes_them_away(database_url):
    """Migration 0012 on both databases: jobs stored before it keep their rows, with no version."""
    jobs = sa.table("jobs", sa.column("id", sa.Uuid()), sa.column("adapter", sa.String()),
                    sa.column("requested_adapter", sa.String()), sa.column("status", sa.String()),
                    sa.column("input", sa.JSON()), sa.column("params", sa.JSON()), sa.column("attempts", sa.Integer()),
                    sa.column("created_at", sa.DateTime()))
    engine = create_engine(database_url)
    try:
        downgrade(database_url, "0011")
        assert "adapter_versions" not in inspect(engine).get_table_names()
        assert "adapter_version" not in {c["name"] for c in inspect(engine).get_columns("jobs")}
        job_id = uuid.uuid4()
        with engine.begin() as connection:
            connection.execute(jobs.insert(), [{"id": job_id, "adapter": "laya", "requested_adapter": "laya",
                                                "status": "succeeded", "input": "x", "params": {}, "attempts": 1,
                                                "created_at": datetime(2025, 1, 1)}])
        upgrade(database_url)
        engine.dispose()
        assert "adapter_versions" in inspect(engine).get_table_names()
        with engine.connect() as connection:
            assert connection.execute(sa.text("SELECT adapter_version FROM jobs")).all() == [(None,)]
        downgrade(database_url, "0011")
        engine.dispose()
        assert "adapter_versions" not in inspect(engine).get_table_names()
        with engine.connect() as connection:
            assert connection.execute(sa.text("SELECT count(*) FROM jobs")).scalar() == 1
        upgrade(database_url)
    finally:
        engine.dispose()


def test_a_batch_output_line_carries_the_version_in_its_chat_completion():
    row = Job(id=uuid.uuid4(), adapter="laya", requested_adapter="laya", answered_by="laya", status="succeeded",
              input="x", params={"output": "text"}, result_text="train", adapter_version="ab" * 32, attempts=1,
              created_at=datetime(2025, 1, 1))
    written, line = _result_line(job_out(row), "req", row)
    assert written and line["response"]["body"]["kevlaya"]["adapter_version"] == "ab" * 32


def adapter_info(metrics_url: str) -> dict[str, dict[str, str]]:
    """adapter -> the labels of its `kevlaya_adapter_info` sample."""
    families = text_string_to_metric_families(httpx.get(metrics_url, timeout=10).text)
    return {s.labels["adapter"]: s.labels for f in families for s in f.samples if s.name == "kevlaya_adapter_info"}


# Any decision Laya writes is sure enough, so an `auto` job escalates exactly when her answer holds none.
@pytest.mark.integration
@pytest.mark.parametrize("env", [{"KEVLAYA_CASCADE__THRESHOLD": "0"}], indirect=True)
def test_each_job_records_the_version_of_the_adapter_that_answered_it(env, api, start_process):
    start_worker(start_process, env, api)
    version = {name: adapter_sha256(Path(env[f"KEVLAYA_{name.upper()}__PATH"])) for name in ("kev", "laya")}
    assert version["kev"] != version["laya"]

    question = "Train or flight to Berlin? Options: train, flight"
    ids = [submit(api, "laya", question, max_new_tokens=6), submit(api, "kev", question, max_new_tokens=6),
           submit(api, "auto", question, max_new_tokens=6),  # noise: no decision, so Kev answers
           submit(api, "auto", question, max_new_tokens=80, response_format=forced_decision("train"))]
    laya, kev, escalated, confident = wait_finished(api, ids)
    assert (laya["adapter_version"], kev["adapter_version"]) == (version["laya"], version["kev"])
    assert escalated["answered_by"] == "kev" and escalated["adapter_version"] == version["kev"]
    assert [(s["adapter"], s["adapter_version"]) for s in escalated["cascade"]] == [
        ("laya", version["laya"]), ("kev", version["kev"])]
    assert confident["answered_by"] == "laya" and confident["adapter_version"] == version["laya"]
    listed = {j["id"]: j["adapter_version"] for j in api.get("/v1/jobs").json()["jobs"] if j["id"] in ids}
    assert listed == {job["id"]: job["adapter_version"] for job in (laya, kev, escalated, confident)}

    chat = api.post("/v1/chat/completions", json={"model": "kev", "max_tokens": 6, "response_format": {"type": "text"},
                                                  "messages": [{"role": "user", "content": question}]})
    assert chat.status_code == 200, chat.text
    assert chat.json()["kevlaya"]["adapter_version"] == version["kev"]
    response = api.post("/v1/responses", json={"model": "laya", "input": question, "max_output_tokens": 6,
                                               "text": {"format": {"type": "text"}}})
    assert response.status_code == 200, response.text
    assert response.json()["kevlaya"]["adapter_version"] == version["laya"]

    models = {m["id"]: m for m in api.get("/v1/models").json()["data"]}
    for name in ("kev", "laya"):
        described = models[name]["kevlaya"]
        assert described["adapter_version"] == version[name] and described["base"] == env["KEVLAYA_MODEL__BASE"]
        assert described["target_modules"] == ["q_proj", "v_proj"] and described["calibrated"] is False
    assert (models["kev"]["kevlaya"]["rank"], models["laya"]["kevlaya"]["rank"]) == (16, 8)
    assert models["auto"]["kevlaya"] is None

    with db.session_scope() as session:
        recorded = {(row.name, row.sha256) for row in session.scalars(select(AdapterVersion))}
    assert recorded == {("kev", version["kev"]), ("laya", version["laya"])}
    info = adapter_info(f"http://127.0.0.1:{env['KEVLAYA_MONITORING__METRICS_PORT']}/metrics")
    assert {name: labels["sha256"] for name, labels in info.items()} == version
    assert {labels["base"] for labels in info.values()} == {env["KEVLAYA_MODEL__BASE"]}


def test_models_list_shows_each_roles_configured_version_and_every_version_loaded(service_env, adapter_copy):
    """`kevlaya models list`: per role, the directory configured and its version; below it each version workers
    loaded, the one loaded last and the configured one marked, with the jobs each answered."""
    from tests.test_cli_and_migrations import kevlaya

    env = {**service_env, "KEVLAYA_LAYA__PATH": str(adapter_copy)}
    base = str(DEMO_MODEL_DIR / "base")
    older = describe_adapter("laya", adapter_copy, base)
    flip_a_byte(adapter_copy / "adapter_model.safetensors", 100)
    configured = describe_adapter("laya", adapter_copy, base)
    with db.write_scope() as session:
        record_loaded(session, [older])
    with db.write_scope() as session:
        record_loaded(session, [configured])
        session.add_all([Job(adapter="laya", requested_adapter="laya", input="x", params={}, status="succeeded",
                             adapter_version=older.sha256) for _ in range(3)])
    listed = kevlaya("models", "list", env=env)
    assert listed.returncode == 0, listed.stderr
    lines = listed.stdout.splitlines()
    laya = lines.index(f"laya: {adapter_copy} version {configured.sha256[:16]}")
    assert lines[laya + 1].startswith(f"  {configured.sha256[:16]}  rank {configured.rank}")
    assert lines[laya + 1].endswith("0 job(s) answered  loaded last, configured")
    assert lines[laya + 2].startswith(f"  {older.sha256[:16]}") and lines[laya + 2].endswith("3 job(s) answered")
    assert any(line.startswith("kev: ") for line in lines)
    assert "  no worker has loaded it yet" in lines  # kev: nothing recorded
