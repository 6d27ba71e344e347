"""`kevlaya batch-load` at a tiny size: real Redis, API and worker processes on the demo model; its results must
hold every figure, and its drain must find every line's answer exactly once."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from api.batch.lines import check_file, read_requests
from modellab.bench.batch_load import ENDPOINT, check_exactly_once, write_batch_file

pytestmark = pytest.mark.integration

# `kevlaya batch-load` until cli/main.py registers the command (then this registers nothing)
KEVLAYA = ("from cli.main import app; from modellab.bench.cli import batch_load\n"
           "if not any(c.name == 'batch-load' for c in app.registered_commands):\n"
           "    app.command('batch-load')(batch_load)\n"
           "app()")


def test_batch_load_times_upload_and_drain_and_finds_every_line_once(tmp_path: Path) -> None:
    out = tmp_path / "batch-load.json"
    command = [os.sys.executable, "-c", KEVLAYA, "batch-load", "--lines", "200", "--drain-lines", "30",
               "--probes", "5", "--timeout", "300", "--workdir", str(tmp_path / "work"), "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["command"].startswith("kevlaya batch-load --lines 200 --drain-lines 30")
    assert result["phase"] == "both" and result["machine"]["cpus"] >= 1
    assert set(result["load_average"]) == {"start", "after_upload", "after_drain"}

    upload = result["upload"]
    assert upload["lines"] == 200 and upload["uploaded_file"]["bytes"] == upload["file_bytes"] > 0
    assert upload["status_after_validation"] == "in_progress" and upload["request_counts"]["total"] == 200
    assert upload["stored"]["jobs_stored"] == 200 and upload["worker"].startswith("none")
    assert upload["upload_s"] > 0 and upload["validation_s"] > 0 and upload["validation_polls"] >= 1
    assert upload["upload_plus_validation_s"] == pytest.approx(upload["upload_s"] + upload["validation_s"], abs=0.002)
    memory = upload["api_memory"]
    assert memory["samples"] >= 1 and memory["rss_before_bytes"] > 0
    assert memory["growth_bytes"] == max(memory["rss_peak_sampled_bytes"], memory["hwm_after_bytes"]) \
        - memory["rss_before_bytes"]
    assert isinstance(upload["targets"]["upload_plus_validation_met"], bool)
    assert isinstance(upload["targets"]["memory_growth_below_file_size"], bool)

    drain = result["drain"]
    assert drain["lines"] == 30 and drain["request_counts"] == {"total": 30, "completed": 30, "failed": 0}
    once = drain["exactly_once"]
    assert once == {"ok": True, "output_lines": 30, "error_lines": 0, "missing": 0, "more_than_once": 0,
                    "unknown": 0, "counts_add_up": True}
    assert drain["stored"]["jobs_stored"] == 30
    assert drain["idle"]["probes"] == 5 and drain["idle"]["failures"] == 0
    during = drain["during_drain"]
    assert during["probes"] >= 1 and during["failures"] == 0
    assert sum(s["probes"] for s in during["by_batch_status"].values()) == during["probes"]
    for figures in (drain["idle"], during):
        assert figures["max_ms"] >= figures["p95_ms"] >= figures["p50_ms"] > 0
    assert drain["p95_during_vs_idle"] == round(during["p95_ms"] / drain["idle"]["p95_ms"], 2)
    assert isinstance(drain["targets"]["p95_during_vs_idle_met"], bool)
    assert drain["drain_s"] > 0 and drain["lines_per_s"] == pytest.approx(30 / drain["drain_s"], abs=0.2)
    assert drain["created_to_completed_s"] >= drain["drain_s"]
    # where a probe's time went (from its job row) and the worker's time in the batch's prefills
    goes = drain["where_time_goes"]
    for when in ("probe_jobs_idle", "probe_jobs_during"):
        assert goes[when]["job_total_95_ms"] >= goes[when]["job_total_50_ms"] > 0
        assert 0 <= goes[when]["queue_50_ms"] <= goes[when]["job_total_50_ms"]
    assert goes["batch_claim_groups"] >= 1 and goes["batch_group_prefill_p50_ms"] > 0
    assert 0 < goes["batch_prefill_share_of_drain"] < 1

    table = done.stdout.strip().splitlines()[-7:]  # printed last
    assert table[0].startswith("upload: 200 lines") and table[-1].startswith("exactly once: yes")


def test_the_exactly_once_check_finds_a_line_missing_twice_or_unknown() -> None:
    ids = ["a", "b", "c"]
    ok = [{"custom_id": "a"}, {"custom_id": "b"}]
    counts = {"total": 3, "completed": 2, "failed": 1}
    assert check_exactly_once(ids, ok, [{"custom_id": "c"}], counts)["ok"] is True
    twice = check_exactly_once(ids, ok, [{"custom_id": "a"}], counts)
    assert twice["ok"] is False and twice["more_than_once"] == 1 and twice["missing"] == 1
    unknown = check_exactly_once(ids, ok, [{"custom_id": "c"}, {"custom_id": "z"}],
                                 {"total": 3, "completed": 2, "failed": 2})
    assert unknown["ok"] is False and unknown["unknown"] == 1 and unknown["counts_add_up"] is False
    short = check_exactly_once(ids, ok, [{"custom_id": "c"}], {"total": 2, "completed": 2, "failed": 1})
    assert short["ok"] is False and short["counts_add_up"] is False


def test_the_generated_file_is_a_valid_batch_of_varied_requests(tmp_path: Path) -> None:
    path = tmp_path / "batch.jsonl"
    ids = write_batch_file(path, 300, ("laya", "kev", "auto"), (4, 8), seed=3)
    assert len(set(ids)) == 300 and check_file(path, ENDPOINT, 1_048_576) == 300
    requests = list(read_requests(path, ENDPOINT, lambda job: None, 1_048_576))
    assert [r.custom_id for r in requests] == ids and all(hasattr(r, "job") for r in requests)  # none rejected
    assert {r.job.adapter for r in requests} == {"laya", "kev", "auto"}
    assert {r.job.params.max_new_tokens for r in requests} == {4, 8}
    assert len({json.dumps(r.job.input, default=str) for r in requests}) > 250  # prompts vary
