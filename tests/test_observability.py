"""Metrics, structured logs and the status page after a real run: API and worker processes, Redis, SQLite,
jobs on both adapters and an escalated `auto` job."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from shared.settings import EngineSettings
from tests.conftest import API_KEY, start_worker, submit, wait_finished, wait_until
from tests.test_compose import dashboard_metric_names

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[1]
DEFAULT_BUDGET_GIB = EngineSettings.model_fields["vram_budget_gb"].default  # the tests' workers leave it unset
LATENCY_HISTOGRAMS = ("kevlaya_job_queue_wait_seconds", "kevlaya_job_time_to_first_token_seconds",
                      "kevlaya_job_time_per_output_token_seconds", "kevlaya_job_end_to_end_seconds")


def scrape(url: str) -> dict[str, list]:
    """Sample name -> samples, parsed by prometheus_client's own parser."""
    response = httpx.get(url, timeout=10)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    samples: dict[str, list] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample)
    return samples


def value(samples: dict[str, list], name: str, **labels: str) -> float:
    matching = [s.value for s in samples.get(name, []) if all(s.labels.get(k) == v for k, v in labels.items())]
    assert matching, f"no sample {name}{labels}"
    return sum(matching)


def run_jobs(api: httpx.Client) -> list[dict]:
    ids = [submit(api, adapter, f"Option A costs {i}, B costs {9 - i}. Pick.", max_new_tokens=6)
           for i, adapter in enumerate(["kev", "laya", "kev", "laya", "auto"])]
    # a decision is generated under its grammar, and 4 tokens cannot close one: this job fails with `length`
    response = api.post("/v1/jobs", json={"adapter": "laya", "input": "Decide.", "params": {"max_new_tokens": 4}})
    ids.append(response.json()["id"])
    jobs = wait_finished(api, ids)
    assert [j["status"] for j in jobs[:5]] == ["succeeded"] * 5, [j["error"] for j in jobs]
    assert jobs[5]["error"]["code"] == "length" and jobs[5]["result"]["finish_reason"] == "length"
    assert jobs[4]["cascade"], "the auto job was escalated to Kev"
    return jobs


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_metrics_and_logs_after_a_real_run_and_a_silent_worker(env, api, start_process):
    env = {**env, "KEVLAYA_MONITORING__LOG_FORMAT": "json"}
    worker = start_worker(start_process, env, api)
    jobs = run_jobs(api)
    worker_url = f"http://127.0.0.1:{env['KEVLAYA_MONITORING__METRICS_PORT']}/metrics"
    api.get("/v1/jobs/not-a-uuid")  # a 422, to see statuses other than 200 counted

    work = scrape(worker_url)
    for name in LATENCY_HISTOGRAMS:
        for adapter in ("kev", "laya"):
            assert value(work, f"{name}_count", adapter=adapter) >= 1, (name, adapter)
        assert all("adapter" in s.labels for s in work[f"{name}_bucket"])
    # kev: two jobs and the escalated stage; laya: two, the auto job's Laya stage, the failed one
    assert value(work, "kevlaya_jobs_finished_total", adapter="kev", status="succeeded") == 3
    assert value(work, "kevlaya_jobs_finished_total", adapter="laya", status="failed") == 1
    assert value(work, "kevlaya_job_failures_total", adapter="laya", code="length") == 1
    assert value(work, "kevlaya_escalations_total") == 1
    assert value(work, "kevlaya_claim_groups_total") >= 2
    # an escalated job's own tokens are the sum of its stages'
    assert value(work, "kevlaya_completion_tokens_total") == sum(j["tokens"]["completion"] for j in jobs)
    assert value(work, "kevlaya_worker_up") == 1 and value(work, "kevlaya_worker_model_loaded") == 1
    assert value(work, "kevlaya_gpu_memory_budget_bytes") == DEFAULT_BUDGET_GIB * 2**30
    assert value(work, "kevlaya_rows_in_flight") == 0

    served = scrape(f"{api.base_url}/metrics")
    assert value(served, "kevlaya_queue_depth", adapter="kev") == 0
    assert value(served, "kevlaya_workers_up") == 1 and value(served, "kevlaya_workers_model_loaded") == 1
    assert value(served, "kevlaya_http_requests_total", route="/v1/jobs", method="POST", status="202") == 6
    assert value(served, "kevlaya_http_requests_total", route="/v1/jobs/{job_id}", status="422") == 1
    assert value(served, "kevlaya_http_request_duration_seconds_count", route="/v1/jobs/{job_id}") >= 1
    # the job writer's commits: each of the six submits in one of them, each commit timed
    assert value(served, "kevlaya_submit_unit_submits_sum") == 6
    assert 1 <= value(served, "kevlaya_submit_write_seconds_count") == value(served, "kevlaya_submit_unit_submits_count")
    # the API's own loggers reach its log, formatted (before, they had no handler: INFO lost, warnings bare)
    [api_process] = [p for p in start_process.started if p.log_path.name.startswith("api-")]
    api_log = api_process.log_path.read_text(errors="replace")
    assert re.search(r"^\S+ \S+ INFO kevlaya\.api: job writer started \(process \d+\)$", api_log, re.MULTILINE), \
        api_log[:3000]
    # the dashboard's queries use only series these two scrapes have
    assert dashboard_metric_names() <= set(work) | set(served), dashboard_metric_names() - set(work) - set(served)

    # one JSON line per job and per claim group, with ids, adapter, sizes and timings
    lines = [json.loads(line) for line in worker.log_path.read_text().splitlines() if line.startswith("{")]
    job_lines = [line for line in lines if line.get("event") == "job"]
    group_lines = [line for line in lines if line.get("event") == "claim_group"]
    assert {line["job_id"] for line in job_lines} >= {j["id"] for j in jobs}
    first = next(line for line in job_lines if line["job_id"] == jobs[0]["id"])
    assert first["adapter"] == "kev" and first["status"] == "succeeded" and first["batch_id"] == jobs[0]["batch_id"]
    assert first["completion_tokens"] == jobs[0]["tokens"]["completion"]
    for key in ("queue_ms", "ttft_ms", "decode_ms", "total_ms", "prompt_tokens"):
        assert isinstance(first[key], (int, float)), key
    group = next(line for line in group_lines if line["batch_id"] == jobs[0]["batch_id"])
    assert group["size"] >= 1 and group["adapter"] == "kev" and group["tokens"] >= first["completion_tokens"]
    assert {"ts", "level", "logger", "message", "prefill_ms", "decode_ms", "peak_vram_bytes"} <= set(group)

    # a worker that stops (no heartbeat) turns readiness and the API's gauges to 0
    os.killpg(worker.process.pid, signal.SIGSTOP)
    try:
        wait_until(lambda: api.get("/readyz").status_code == 503, 30, what="readiness to drop")
        assert api.get("/readyz").json()["checks"]["worker"] != "ok"
        silent = scrape(f"{api.base_url}/metrics")
        assert value(silent, "kevlaya_workers_up") == 0 and value(silent, "kevlaya_workers_model_loaded") == 0
    finally:
        os.killpg(worker.process.pid, signal.SIGCONT)
    wait_until(lambda: api.get("/readyz").status_code == 200, 30, what="readiness to return")


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_readiness_follows_the_model_load_not_the_next_heartbeat(env, api, start_process):
    """Heartbeats every 100 s: the worker still turns /readyz ready as soon as its model is loaded, because it
    beats once right after the load (the first beat, at start, says the model is not loaded yet)."""
    slow_beats = {**env, "KEVLAYA_RELIABILITY__SWEEP_INTERVAL_S": "100", "KEVLAYA_RELIABILITY__HEARTBEAT_TTL_S": "300"}
    worker = start_process("worker", slow_beats)
    wait_until(lambda: "engine ready" in worker.log_path.read_text(errors="replace"), 60, what="the model to load")
    wait_until(lambda: api.get("/readyz").status_code == 200, 15, what="readiness after the load")
    [status] = api.get("/v1/stats/live").json()["workers"].values()
    assert status["model_loaded"] is True and status["slots"] >= 1


def chromium() -> str | None:
    configured = os.environ.get("KEVLAYA_TEST_CHROMIUM")
    if configured:
        return configured
    return next((path for path in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if path), None)


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_status_page_shows_the_run_in_a_real_browser(env, api, start_process, tmp_path):
    browser_path = chromium()
    if browser_path is None:
        pytest.skip("no Chromium: install Debian's (`apt-get install chromium`) or set KEVLAYA_TEST_CHROMIUM")
    from playwright.sync_api import expect, sync_playwright

    start_worker(start_process, env, api)
    run_jobs(api)
    stats = api.get("/v1/stats", params={"window": "15m"}).json()
    live = api.get("/v1/stats/live").json()

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=browser_path, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1280, "height": 1100})
        page.goto(f"{api.base_url}/status")
        page.fill("#key", API_KEY)
        page.click("#login button[type=submit]")
        page.wait_for_selector("body[data-loaded=true]", timeout=15000)

        expect(page.locator("#queue-kev")).to_have_text("0")
        expect(page.locator("#queue-laya")).to_have_text("0")
        for adapter in ("kev", "laya"):
            figures = stats["adapters"][adapter]["latency_ms"]["end_to_end"]
            row = page.locator(f"#latency tr[data-adapter={adapter}][data-metric=end_to_end]")
            expect(row.locator("[data-p=p50]")).to_have_text(f"{figures['p50']:.1f}")
            expect(row.locator("[data-p=count]")).to_have_text(str(figures["count"]))
        expect(page.locator("#escalation")).to_have_text("100 %")
        expect(page.locator("#failures tr[data-code=length] td[data-adapter=laya]")).to_have_text("1")
        drawn = page.locator("#timeline rect.batch")
        assert drawn.count() == len(live["batches"]) >= 2
        assert {drawn.nth(i).get_attribute("data-adapters") for i in range(drawn.count())} == {"kev", "laya"}
        budget = page.locator("#memory #budget-line")
        assert int(budget.get_attribute("data-bytes")) == DEFAULT_BUDGET_GIB * 2**30
        expect(page.locator("#memory-now")).to_contain_text(f"budget {DEFAULT_BUDGET_GIB:.2f} GiB")
        expect(page.locator("#workers")).to_contain_text("model loaded")

        shot = tmp_path / "status-page.png"
        page.screenshot(path=str(shot), full_page=True)
        assert shot.stat().st_size > 10_000
        if os.environ.get("KEVLAYA_UPDATE_SCREENSHOT"):  # refresh docs/operations.md's picture
            shutil.copy(shot, ROOT / "docs" / "status-page.png")

        # logging out forgets the key and shows the form again
        page.click("#logout")
        expect(page.locator("#login")).to_be_visible()
        browser.close()
