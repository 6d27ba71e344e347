"""`kevlaya batch`: the installed command against a real API (and worker), as a user runs it."""

from __future__ import annotations

import json
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.conftest import API_KEY, start_worker, wait_until

KEVLAYA = Path(sys.executable).parent / "kevlaya"
pytestmark = pytest.mark.integration


def batch_args(env: dict[str, str], *args: str, key: str = API_KEY) -> list[str]:
    return [str(KEVLAYA), "batch", *args, "--url", f"http://127.0.0.1:{env['KEVLAYA_API__PORT']}", "--key", key]


def kevlaya_batch(env: dict[str, str], cwd: Path, *args: str, key: str = API_KEY) -> subprocess.CompletedProcess:
    return subprocess.run(batch_args(env, *args, key=key), cwd=cwd, capture_output=True, text=True, timeout=300)


def request_line(custom_id: str, model: str = "laya", **body: object) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": model, "messages": [{"role": "user", "content": f"question {custom_id}"}],
                     "max_tokens": 4, **body}}


def write_jsonl(path: Path, lines: list[dict]) -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def status(api: httpx.Client, batch_id: str) -> str:
    return api.get(f"/v1/batches/{batch_id}").json()["status"]


def test_run_answers_every_line_once_and_a_refused_line_in_the_error_file(env, api, start_process, tmp_path):
    start_worker(start_process, env, api)
    good = [request_line(f"r{i}", ("laya", "kev", "auto")[i % 3]) for i in range(12)]
    source = write_jsonl(tmp_path / "questions.jsonl", [*good[:6], request_line("hot", temperature="hot"), *good[6:]])

    done = kevlaya_batch(env, tmp_path, "run", str(source), "--poll", "0.2")

    assert done.returncode == 0, done.stdout + done.stderr
    output = read_jsonl(tmp_path / "questions.output.jsonl")
    assert sorted(line["custom_id"] for line in output) == sorted(line["custom_id"] for line in good)
    assert {line["response"]["status_code"] for line in output} == {200}
    errors = read_jsonl(tmp_path / "questions.errors.jsonl")
    assert [(line["custom_id"], line["response"]["status_code"]) for line in errors] == [("hot", 422)]
    [batch] = api.get("/v1/batches").json()["data"]
    summary = done.stdout.strip().splitlines()
    assert len(summary) == 1 and summary[0].startswith(f"{batch['id']} completed: 13 requests, 12 completed, 1 failed")
    assert not list(tmp_path.glob(".*.part"))


def test_bad_arguments_and_a_refusal_exit_2_and_upload_nothing(env, api, tmp_path):
    missing = tmp_path / "missing.jsonl"
    done = kevlaya_batch(env, tmp_path, "run", str(missing))
    assert done.returncode == 2 and str(missing) in done.stderr, done.stderr
    source = write_jsonl(tmp_path / "questions.jsonl", [request_line("r0")])
    done = kevlaya_batch(env, tmp_path, "run", str(source), "--window", "8d")
    assert done.returncode == 2 and "--window" in done.stderr, done.stderr

    refused = kevlaya_batch(env, tmp_path, "run", str(source), key="kl_not_a_key")
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "invalid API key" in refused.stderr and "Traceback" not in refused.stderr

    assert api.get("/v1/files").json()["data"] == []
    assert api.get("/v1/batches").json()["data"] == []
    assert not (tmp_path / "questions.output.jsonl").exists()


def test_a_batch_that_fails_or_expires_exits_1(env, api, tmp_path):
    malformed = write_jsonl(tmp_path / "malformed.jsonl", [request_line("r0"), {"custom_id": "r1"}])
    failed = kevlaya_batch(env, tmp_path, "run", str(malformed), "--poll", "0.2")
    assert failed.returncode == 1, failed.stdout + failed.stderr
    assert failed.stdout.split()[1] == "failed:" and "line 2: body, method, url: missing" in failed.stderr

    source = write_jsonl(tmp_path / "questions.jsonl", [request_line(f"r{i}") for i in range(2)])
    expired = kevlaya_batch(env, tmp_path, "run", str(source), "--window", "1s", "--poll", "0.2")  # no worker
    assert expired.returncode == 1, expired.stdout + expired.stderr
    assert expired.stdout.split()[1] == "expired:"
    errors = read_jsonl(tmp_path / "questions.errors.jsonl")
    assert sorted((line["custom_id"], line["error"]["code"]) for line in errors) == [
        ("r0", "batch_expired"), ("r1", "batch_expired")]


def test_cancel_ends_a_batch_no_worker_runs(env, api, tmp_path):
    source = write_jsonl(tmp_path / "questions.jsonl", [request_line(f"r{i}") for i in range(3)])
    with source.open("rb") as content:
        uploaded = api.post("/v1/files", data={"purpose": "batch"}, files={"file": (source.name, content)}).json()
    batch = api.post("/v1/batches", json={"input_file_id": uploaded["id"], "endpoint": "/v1/chat/completions",
                                          "completion_window": "24h"}).json()

    done = kevlaya_batch(env, tmp_path, "cancel", batch["id"])

    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.split()[0] == batch["id"] and done.stdout.split()[1] in ("cancelling", "cancelled")
    wait_until(lambda: status(api, batch["id"]) == "cancelled", 30, what="the batch to be cancelled")


def test_ctrl_c_leaves_the_batch_running_and_the_printed_wait_command_fetches_its_results(
        env, api, start_process, tmp_path):
    source = write_jsonl(tmp_path / "questions.jsonl", [request_line(f"r{i}") for i in range(4)])
    # Ctrl-C as a terminal delivers it to its foreground command, whatever this run inherited (a shell starts a
    # background job with SIGINT ignored, and a child keeps that)
    run = subprocess.Popen(batch_args(env, "run", str(source), "--poll", "0.2"), cwd=tmp_path,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        batches = wait_until(lambda: api.get("/v1/batches").json()["data"], 60, what="the batch to be created")
        wait_until(lambda: status(api, batches[0]["id"]) == "in_progress", 30, what="the batch to be in progress")
        run.send_signal(signal.SIGINT)
        stdout, stderr = run.communicate(timeout=30)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 130, stdout + stderr
    assert status(api, batches[0]["id"]) == "in_progress"  # not cancelled
    [resume] = [line for line in stderr.splitlines() if f"kevlaya batch wait {batches[0]['id']}" in line]

    start_worker(start_process, env, api)
    command = shlex.split(resume[resume.index("kevlaya batch wait"):])
    waited = subprocess.run([str(KEVLAYA), *command[1:], "--key", API_KEY], cwd=tmp_path, capture_output=True,
                            text=True, timeout=300)

    assert waited.returncode == 0, waited.stdout + waited.stderr
    output = read_jsonl(tmp_path / "questions.output.jsonl")
    assert sorted(line["custom_id"] for line in output) == ["r0", "r1", "r2", "r3"]
    assert not (tmp_path / "questions.errors.jsonl").exists()
    assert "errors: none" in waited.stdout


def test_the_key_can_come_from_a_file_and_stay_out_of_the_process_list(env, api, tmp_path):
    source = write_jsonl(tmp_path / "questions.jsonl", [request_line("r0")])
    with source.open("rb") as content:
        uploaded = api.post("/v1/files", data={"purpose": "batch"}, files={"file": (source.name, content)}).json()
    batch = api.post("/v1/batches", json={"input_file_id": uploaded["id"], "endpoint": "/v1/chat/completions",
                                          "completion_window": "24h"}).json()
    key_file, wrong_file = tmp_path / "key", tmp_path / "wrong-key"
    key_file.write_text(API_KEY + "\n")
    wrong_file.write_text("kl_not_a_key\n")
    command = [str(KEVLAYA), "batch", "cancel", batch["id"], "--url", f"http://127.0.0.1:{env['KEVLAYA_API__PORT']}"]
    clean = {name: value for name, value in env.items() if name != "KEVLAYA_API__KEY"}

    refused = subprocess.run([*command, "--key-file", str(wrong_file)], env=clean, cwd=tmp_path,
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "401" in refused.stderr, refused.stderr  # the file's key was the one sent
    done = subprocess.run([*command, "--key-file", str(key_file)], env=clean, cwd=tmp_path, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.split()[0] == batch["id"]
    assert API_KEY not in " ".join(command)  # nothing secret in what `ps` shows
