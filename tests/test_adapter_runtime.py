"""Adapters loaded, unloaded and reloaded at run time (docs/architecture.md §10): vLLM's routes, every refusal
naming why with nothing recorded, and a reload of Laya under load in real processes where each job is answered
wholly by the version it records."""

from __future__ import annotations

import json
import shutil
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file
from sqlalchemy import func, select

from shared import db
from shared.manifest import adapter_sha256, write_manifest
from shared.models import AdapterAssignment, AdapterVersion, Job
from shared.settings import DEMO_MODEL_DIR
from tests.conftest import AUTH, free_port, start_worker, wait_finished, wait_until

WEIGHTS = "adapter_model.safetensors"


def rewrite_weights(directory: Path, change) -> None:  # noqa: ANN001
    """Change the adapter's tensors (`change(tensors) -> tensors`) and write its manifest again."""
    tensors = change(load_file(directory / WEIGHTS))
    save_file(tensors, directory / WEIGHTS, metadata={"format": "pt"})
    write_manifest(directory)


def perturbed(directory: Path, seed: int = 1) -> None:
    """Another version of the adapter: its B matrices with noise of their own size added (same rank and targets)."""
    rng = np.random.default_rng(seed)

    def change(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {k: (t + rng.normal(0, float(np.abs(t).mean()) * 4 + 0.05, t.shape).astype(t.dtype)
                    if ".lora_B" in k else t) for k, t in tensors.items()}

    rewrite_weights(directory, change)


@pytest.fixture
def adapter_root(tmp_path: Path) -> Path:
    root = tmp_path / "adapters"
    root.mkdir()
    return root


@pytest.fixture
def runtime_env(worker_env: dict[str, str], adapter_root: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    env = {**worker_env, "KEVLAYA_MODEL__ADAPTER_ROOT": str(adapter_root), "KEVLAYA_MODEL__ADAPTER_POLL_S": "0.2"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    from tests.conftest import reset_process_state

    reset_process_state()
    return env


def assignments() -> int:
    with db.session_scope() as session:
        return session.scalar(select(func.count()).select_from(AdapterAssignment))


def refusal(client, name: str, path: Path | str) -> tuple[int, dict]:  # noqa: ANN001
    response = client.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)}, headers=AUTH)
    return response.status_code, response.json() if response.status_code != 200 else {}


def test_each_bad_adapter_is_refused_naming_why_and_nothing_is_recorded(runtime_env, adapter_root, client):
    laya = Path(runtime_env["KEVLAYA_LAYA__PATH"])

    def copy(name: str, source: Path = laya) -> Path:
        return Path(shutil.copytree(source, adapter_root / name))

    named = copy("named")
    cases: list[tuple[str, str | Path, str, str]] = [
        ("Mira", named, "lora_name", "cannot name a role"),
        ("auto", named, "lora_name", "cannot name a role"),
        ("mira/../laya", named, "lora_name", "cannot name a role"),
        ("laya", laya, "lora_path", "outside the allowed directory"),  # the configured one lies elsewhere
        ("laya", adapter_root / ".." / "elsewhere", "lora_path", "outside the allowed directory"),
    ]
    (adapter_root / "link").symlink_to(laya, target_is_directory=True)  # inside by name, outside once resolved
    cases.append(("laya", adapter_root / "link", "lora_path", "outside the allowed directory"))
    missing = copy("missing")
    (missing / WEIGHTS).unlink()
    write_manifest(missing)
    cases.append(("laya", missing, "lora_path", f"missing {WEIGHTS}"))
    unreadable = copy("unreadable")
    (unreadable / "adapter_config.json").write_text("{not json")
    write_manifest(unreadable)
    cases.append(("laya", unreadable, "lora_path", "adapter_config.json cannot be read"))
    unverified = copy("unverified")
    perturbed(unverified)
    (unverified / "MANIFEST.sha256").write_text((laya / "MANIFEST.sha256").read_text())
    cases.append(("laya", unverified, "lora_path", "checksum mismatch"))
    other_base = copy("other-base", DEMO_MODEL_DIR / "laya")  # made for the demo base, not the tiny one served
    cases.append(("laya", other_base, "lora_path", "for another base than the running one"))
    nan = copy("nan")
    rewrite_weights(nan, lambda t: {k: np.where(np.arange(v.size).reshape(v.shape) == 0, np.nan, v).astype(v.dtype)
                                    if ".lora_B" in k else v for k, v in t.items()})
    cases.append(("laya", nan, "lora_path", "NaN or infinite weights"))
    wide = copy("wide")  # rank 40: over the role's block (its configured rank; KEVLAYA_MODEL__ADAPTER_MAX_RANK is 0)

    def widen(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {k: np.concatenate([v, np.zeros((40 - v.shape[0], v.shape[1]), v.dtype)]) if ".lora_A" in k
                else np.concatenate([v, np.zeros((v.shape[0], 40 - v.shape[1]), v.dtype)], axis=1)
                for k, v in tensors.items()}

    rewrite_weights(wide, widen)
    config = json.loads((wide / "adapter_config.json").read_text())
    (wide / "adapter_config.json").write_text(json.dumps({**config, "r": 40}))
    write_manifest(wide)
    cases.append(("laya", wide, "lora_path", "rank 40 is larger than the"))
    targets = copy("targets")  # k_proj: a module neither configured adapter changes
    rewrite_weights(targets, lambda t: {k.replace("q_proj", "k_proj"): v for k, v in t.items()})
    cases.append(("laya", targets, "lora_path", "target modules k_proj are not supported"))

    for name, path, field, why in cases:
        status, body = refusal(client, name, path)
        assert status == 400, (path, body)
        error = body["error"]
        assert error["code"] == "invalid_adapter" and why in error["message"], (path, error)
        assert error["fields"][0]["field"] == field and error["message"].startswith(f"{field}: ")
    assert assignments() == 0

    unload = client.post("/v1/unload_lora_adapter", json={"lora_name": "mira"}, headers=AUTH)
    assert unload.status_code == 404 and "'mira' is not loaded" in unload.json()["error"]["message"]  # never loaded
    assert assignments() == 0

    good = copy("good")
    perturbed(good)
    loaded = client.post("/v1/load_lora_adapter", json={"lora_name": "laya", "lora_path": str(good)}, headers=AUTH)
    assert loaded.status_code == 200 and loaded.text == "Success: LoRA adapter 'laya' added successfully."
    with db.session_scope() as session:
        row = session.get(AdapterAssignment, "laya")
        assert (row.path, row.sha256, row.unloaded, row.generation) == (str(good), adapter_sha256(good), False, 1)


def test_an_unloaded_role_takes_no_submits_and_leaves_the_model_list(runtime_env, client):
    def unload() -> int:
        return client.post("/v1/unload_lora_adapter", json={"lora_name": "laya"}, headers=AUTH).status_code

    assert unload() == 200
    assert unload() == 404  # as vLLM answers for a name it does not hold
    for adapter in ("laya", "auto"):
        refused = client.post("/v1/jobs", json={"adapter": adapter, "input": "x"}, headers=AUTH)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "adapter_unloaded"
        assert "adapter laya is unloaded" in refused.json()["error"]["message"]
    chat = client.post("/v1/chat/completions", headers=AUTH,
                       json={"model": "laya", "messages": [{"role": "user", "content": "x"}]})
    assert chat.status_code == 503
    assert client.post("/v1/jobs", json={"adapter": "kev", "input": "x"}, headers=AUTH).status_code == 202
    with db.session_scope() as session:
        assert session.scalar(select(func.count()).select_from(Job).where(Job.adapter == "laya")) == 0
    listed = [m["id"] for m in client.get("/v1/models", headers=AUTH).json()["data"]]
    assert listed == ["kev"]


def test_a_new_name_becomes_a_role_of_its_own_while_a_spare_block_is_free(runtime_env, adapter_root, client):
    laya = Path(runtime_env["KEVLAYA_LAYA__PATH"])
    mira = Path(shutil.copytree(laya, adapter_root / "mira"))

    def load(name: str):  # noqa: ANN202
        return client.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(mira)}, headers=AUTH)

    def submit(name: str):  # noqa: ANN202
        return client.post("/v1/jobs", json={"adapter": name, "input": "Options: A, B."}, headers=AUTH)

    def chat(name: str):  # noqa: ANN202
        return client.post("/v1/chat/completions", headers=AUTH,
                           json={"model": name, "messages": [{"role": "user", "content": "x"}]})

    for unknown in (submit("mira"), chat("mira")):  # not a role before its load: 422 naming the field
        assert unknown.status_code == 422, unknown.text
    assert submit("mira").json()["error"]["message"].startswith("adapter: 'mira' is not a role")
    assert chat("mira").json()["error"]["message"].startswith("model: 'mira' is not a role")
    batch = client.post("/v1/jobs/batch", headers=AUTH, json={"jobs": [{"adapter": "kev", "input": "x"},
                                                                      {"adapter": "mira", "input": "x"}]})
    assert batch.status_code == 422 and batch.json()["error"]["message"].startswith("jobs.1.adapter: 'mira'")

    assert load("mira").status_code == 200
    assert [m["id"] for m in client.get("/v1/models", headers=AUTH).json()["data"]] == ["kev", "laya", "auto",
                                                                                      "mira"]
    accepted = submit("mira")
    assert accepted.status_code == 202 and accepted.json()["adapter"] == "mira"
    with db.session_scope() as session:
        job = session.get(Job, uuid.UUID(accepted.json()["id"]))
        assert (job.adapter, job.requested_adapter, job.status) == ("mira", "mira", "queued")

    full = load("zed")  # KEVLAYA_MODEL__SPARE_ROLES is 1, and mira holds it
    assert full.status_code == 400 and "no room for another role: mira hold" in full.json()["error"]["message"]
    assert load("mira").status_code == 200  # a reload of a new role in place needs no second block
    assert client.post("/v1/unload_lora_adapter", json={"lora_name": "mira"}, headers=AUTH).status_code == 200
    assert submit("mira").status_code == 503  # unloaded: still a role, refused as unloaded
    assert load("zed").status_code == 200  # mira's block is free again
    assert [m["id"] for m in client.get("/v1/models", headers=AUTH).json()["data"]][-1] == "zed"


def test_the_command_line_loads_and_unloads_with_the_same_checks(runtime_env, adapter_root):
    from tests.test_cli_and_migrations import kevlaya

    laya = Path(runtime_env["KEVLAYA_LAYA__PATH"])
    refused = kevlaya("models", "load", "laya", str(laya), env=runtime_env)
    assert refused.returncode == 2 and "outside the allowed directory" in refused.stderr and assignments() == 0
    good = Path(shutil.copytree(laya, adapter_root / "laya-2"))
    loaded = kevlaya("models", "load", "laya", str(good), env=runtime_env)
    assert loaded.returncode == 0, loaded.stderr
    assert kevlaya("models", "unload", "laya", env=runtime_env).returncode == 0
    again = kevlaya("models", "unload", "laya", env=runtime_env)
    assert again.returncode == 2 and "unloaded already" in again.stderr
    assert "KEVLAYA_MODEL__ADAPTER_ROOT" in kevlaya("models", "load", "--help", env=runtime_env).stdout


PROMPTS = [f"Option {i}: train or flight to city {i}? Options: train, flight" for i in range(8)]


def answers(api, adapter: str, count: int, tokens: int, offset: int = 0) -> list[str]:  # noqa: ANN001
    """Submit `count` greedy jobs of `adapter` as one batch; their ids."""
    jobs = [{"adapter": adapter, "input": PROMPTS[(offset + i) % len(PROMPTS)],
             "params": {"output": "text", "temperature": 0, "max_new_tokens": tokens}} for i in range(count)]
    response = api.post("/v1/jobs/batch", json={"jobs": jobs})
    assert response.status_code == 202, response.text
    return [job["id"] for job in response.json()["jobs"]]


def by_prompt(jobs: list[dict]) -> dict[str, str]:
    texts: dict[str, str] = {}
    for job in jobs:
        assert job["status"] == "succeeded", job
        assert texts.setdefault(job["input"], job["result"]["text"]) == job["result"]["text"]  # greedy: one answer
    return texts


@pytest.mark.integration
@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_a_reload_under_load_loses_and_mixes_nothing(runtime_env, adapter_root, start_process):
    """~100 mixed jobs in flight while Laya is reloaded: none lost, none run twice, and each Laya job's answer is
    the one the version it records gives on its own. Then unload, a job that waits, and a load again; a worker
    started afterwards serves the version asked for, read from the table."""
    from tests.conftest import start_api

    env = {**runtime_env, "KEVLAYA_API__PORT": str(free_port())}
    api = start_api(start_process, env)
    worker = start_worker(start_process, env, api)
    laya = Path(env["KEVLAYA_LAYA__PATH"])
    v1 = adapter_sha256(laya)
    second = Path(shutil.copytree(laya, adapter_root / "laya-v2"))
    perturbed(second)
    v2 = adapter_sha256(second)

    reference = {v1: by_prompt(wait_finished(api, answers(api, "laya", len(PROMPTS), 8)))}
    mixed = []
    for round_ in range(3):  # Kev's longer answers keep rows in flight across the switch
        mixed += answers(api, "kev", 10, 24, offset=round_) + answers(api, "laya", 10, 8, offset=round_)

    def some_laya_done() -> bool:
        return sum(api.get(f"/v1/jobs/{i}").json()["status"] == "succeeded" for i in mixed[10:20]) >= 2

    wait_until(some_laya_done, 60, interval=0.05, what="the first Laya jobs")
    started = time.monotonic()
    loaded = api.post("/v1/load_lora_adapter", json={"lora_name": "laya", "lora_path": str(second)})
    assert loaded.status_code == 200, loaded.text
    for round_ in range(3, 5):  # 100 in all: these come while the switch waits for Laya's rows
        mixed += answers(api, "kev", 10, 24, offset=round_) + answers(api, "laya", 10, 8, offset=round_)
    finished = wait_finished(api, mixed)

    def switched() -> bool:
        with db.session_scope() as session:
            return session.get(AdapterVersion, ("laya", v2)) is not None

    wait_until(switched, 30, what="the worker to switch Laya")
    switch_s = time.monotonic() - started
    reference[v2] = by_prompt(wait_finished(api, answers(api, "laya", len(PROMPTS), 8)))
    assert sum(reference[v1][p] != reference[v2][p] for p in PROMPTS) >= len(PROMPTS) // 2  # the versions differ

    assert len(finished) == 100 and all(job["status"] == "succeeded" for job in finished)  # none lost
    assert all(job["attempts"] == 1 for job in finished)  # none run twice
    kev_version = adapter_sha256(Path(env["KEVLAYA_KEV__PATH"]))
    seen = {v1: 0, v2: 0}
    for job in finished:
        if job["adapter"] == "kev":
            assert job["adapter_version"] == kev_version
            continue
        version = job["adapter_version"]
        assert version in reference, job
        assert job["result"]["text"] == reference[version][job["input"]], (version, job["input"])
        seen[version] += 1
    assert seen[v1] and seen[v2], seen  # the reload came while Laya jobs were in flight and queued
    models = {m["id"]: m for m in api.get("/v1/models").json()["data"]}
    assert models["laya"]["kevlaya"]["adapter_version"] == v2
    print(f"switch seen after {switch_s:.2f}s; jobs per version {seen}")

    # unload: submits refused, a job queued before waits, /v1/models leaves Laya out; a load again serves it
    assert api.post("/v1/unload_lora_adapter", json={"lora_name": "laya"}).status_code == 200
    assert api.post("/v1/jobs", json={"adapter": "laya", "input": "x"}).status_code == 503
    waiting_id = uuid.uuid4()
    with db.write_scope() as session:
        session.add(Job(id=waiting_id, adapter="laya", requested_adapter="laya", input=PROMPTS[0], status="queued",
                        params={"output": "text", "temperature": 0, "max_new_tokens": 8}))
    time.sleep(1.5)  # a sweep and several polls: nothing claims it
    assert api.get(f"/v1/jobs/{waiting_id}").json()["status"] == "queued"
    assert "laya" not in {m["id"] for m in api.get("/v1/models").json()["data"]}
    assert api.post("/v1/load_lora_adapter", json={"lora_name": "laya", "lora_path": str(second)}).status_code == 200
    [answered] = wait_finished(api, [str(waiting_id)], timeout=60)
    assert answered["adapter_version"] == v2 and answered["result"]["text"] == reference[v2][PROMPTS[0]]

    # a worker that starts reads what each role should serve: Laya is v2, not its configured v1
    worker.kill()
    start_worker(start_process, env, api)
    [restarted] = wait_finished(api, answers(api, "laya", 1, 8), timeout=60)
    assert restarted["adapter_version"] == v2 and restarted["result"]["text"] == reference[v2][PROMPTS[0]]
    api.close()


def told(api, adapter: str, offset: int = 0) -> list[str]:  # noqa: ANN001
    """`answers` with the same system message for every role (a new role's profile has none of its own)."""
    jobs = [{"adapter": adapter, "params": {"output": "text", "temperature": 0, "max_new_tokens": 8},
             "input": {"messages": [{"role": "system", "content": "Answer briefly."},
                                    {"role": "user", "content": PROMPTS[(offset + i) % len(PROMPTS)]}]}}
            for i in range(len(PROMPTS))]
    response = api.post("/v1/jobs/batch", json={"jobs": jobs})
    assert response.status_code == 202, response.text
    return [job["id"] for job in response.json()["jobs"]]


def by_user_prompt(jobs: list[dict]) -> dict[str, str]:
    return by_prompt([{**job, "input": job["input"]["messages"][-1]["content"]} for job in jobs])


@pytest.mark.integration
@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_a_role_loaded_under_a_new_name_serves_its_own_weights_and_gives_its_block_back(runtime_env, adapter_root,
                                                                                      start_process):
    """A running worker takes `mira` (another version of Laya's adapter) into its spare block: its jobs and chat
    answers are those the same weights give as Laya, and record its version; unloaded, its block serves `zed`."""
    from tests.conftest import start_api

    env = {**runtime_env, "KEVLAYA_API__PORT": str(free_port())}
    api = start_api(start_process, env)
    start_worker(start_process, env, api)
    laya = Path(env["KEVLAYA_LAYA__PATH"])
    mira = Path(shutil.copytree(laya, adapter_root / "mira"))
    perturbed(mira)
    before = by_user_prompt(wait_finished(api, told(api, "laya")))

    started = time.monotonic()
    assert api.post("/v1/load_lora_adapter", json={"lora_name": "mira", "lora_path": str(mira)}).status_code == 200
    own = wait_finished(api, told(api, "mira"), timeout=60)
    print(f"a new role's first answers {time.monotonic() - started:.2f}s after its load")
    assert all(job["answered_by"] == "mira" and job["adapter_version"] == adapter_sha256(mira) for job in own)
    chat = api.post("/v1/chat/completions", json={
        "model": "mira", "max_tokens": 8, "temperature": 0,
        "messages": [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": PROMPTS[0]}]})
    assert chat.status_code == 200 and chat.json()["model"] == "mira", chat.text
    assert chat.json()["kevlaya"]["answered_by"] == "mira"
    assert chat.json()["kevlaya"]["adapter_version"] == adapter_sha256(mira)

    # the same weights as Laya answer as mira did: the new role served them, not the base or another block
    assert api.post("/v1/load_lora_adapter", json={"lora_name": "laya", "lora_path": str(mira)}).status_code == 200
    wait_until(lambda: api.get("/v1/models").json()["data"][1]["kevlaya"]["adapter_version"] == adapter_sha256(mira),
               30, what="Laya to switch")
    assert by_user_prompt(wait_finished(api, told(api, "laya"))) == by_user_prompt(own)
    assert sum(before[p] != by_user_prompt(own)[p] for p in PROMPTS) >= len(PROMPTS) // 2  # another version

    assert api.post("/v1/unload_lora_adapter", json={"lora_name": "mira"}).status_code == 200
    zed = Path(shutil.copytree(laya, adapter_root / "zed"))  # Laya's first version, as `zed`, in mira's block
    assert api.post("/v1/load_lora_adapter", json={"lora_name": "zed", "lora_path": str(zed)}).status_code == 200
    assert by_user_prompt(wait_finished(api, told(api, "zed"), timeout=60)) == before
    api.close()


def test_the_migration_adds_the_assignments_and_takes_them_away(database_url):
    """Migrations 0013 and 0014 on both databases."""
    from sqlalchemy import create_engine, inspect
    from sqlalchemy.orm import Session

    from shared.migrate import downgrade, upgrade

    engine = create_engine(database_url)
    try:
        downgrade(database_url, "0012")
        assert "adapter_assignments" not in inspect(engine).get_table_names()
        upgrade(database_url)
        engine.dispose()
        assert {c["name"] for c in inspect(engine).get_columns("adapter_assignments")} == {
            "role", "path", "sha256", "unloaded", "generation", "requested_at"}
        role = "r" + "-" * 31  # the longest name a role may have is a job's adapter (0014)
        with Session(engine) as session, session.begin():
            session.add(Job(adapter=role, requested_adapter=role, answered_by=role, input="x", params={}))
        with Session(engine) as session:
            assert session.scalar(select(Job.answered_by).where(Job.adapter == role)) == role
    finally:
        engine.dispose()


def test_the_adapter_load_benchmark_loads_a_new_role_and_reloads_laya_on_the_demo_model(tmp_path):
    """The committed command that measures load times (modellab/bench/adapter_load.py) runs end to end."""
    import subprocess
    import sys

    out = tmp_path / "adapter-load.json"
    done = subprocess.run([sys.executable, "-m", "modellab.bench.adapter_load", "--shape", "demo", "--repeats", "2",
                           "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert len(result["new_role_s"]["all"]) == len(result["reload_s"]["all"]) == 2
    assert result["command"].startswith("python -m modellab.bench.adapter_load --shape demo")


@pytest.mark.parametrize("variable", ["KEVLAYA_ROLES__PATH", "KEVLAYA_ROLES__RESERVED_SLOTS"])
def test_a_setting_roles_loaded_at_run_time_cannot_have_is_refused_naming_it(variable, monkeypatch):
    from pydantic import ValidationError

    from shared.settings import Settings

    monkeypatch.setenv(variable, "2")
    with pytest.raises(ValidationError) as refused:
        Settings(_env_file=None)
    assert refused.value.errors()[0]["loc"] == ("roles", variable.removeprefix("KEVLAYA_ROLES__").lower())
    assert "a role loaded at run time" in str(refused.value)
