"""A real Prometheus server on monitoring/prometheus.yml scrapes a real API and worker; the Grafana dashboard's
queries then run on it. Only the scrape targets (compose service names) and the scrape interval are changed."""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest
import yaml

from tests.conftest import free_port, start_worker, wait_until
from tests.test_compose import DASHBOARD, MONITORING_DIR
from tests.test_observability import run_jobs

pytestmark = pytest.mark.integration
CONFIG = MONITORING_DIR / "prometheus.yml"
ADAPTERS = {"kev", "laya"}
# Grafana's own variables, as Grafana would fill them on a short time range
GRAFANA_VARIABLES = {"__rate_interval": "1m", "__interval": "15s", "__range": "5m"}


@pytest.fixture
def prometheus_binary() -> str:
    """First among the test's fixtures, so a machine without Prometheus skips before starting anything."""
    path = shutil.which("prometheus")
    if path is None:
        pytest.skip("no `prometheus` on PATH: install Debian's (`apt-get install prometheus`)")
    return path


def local_config(targets: dict[str, str]) -> dict:
    """monitoring/prometheus.yml with each compose target replaced by its address here and a 1 s interval."""
    config = yaml.safe_load(CONFIG.read_text())
    config["global"].update(scrape_interval="1s", scrape_timeout="1s", evaluation_interval="1s")
    seen = set()
    for job in config["scrape_configs"]:
        job.pop("scrape_interval", None)
        job.pop("scrape_timeout", None)
        for group in job["static_configs"]:
            seen.update(group["targets"])
            group["targets"] = [targets[target] for target in group["targets"]]
    assert seen == set(targets), f"targets of {CONFIG.name} changed: {sorted(seen)}"
    return config


def dashboard_queries() -> list[tuple[str, str, str]]:
    """(panel title, expr with variables filled in, legend format) for every query of the dashboard."""
    board = json.loads(DASHBOARD.read_text())
    values = {**GRAFANA_VARIABLES}
    for variable in (board.get("templating") or {}).get("list", []):
        current = (variable.get("current") or {}).get("value")
        values[variable["name"]] = current if isinstance(current, str) and current != "$__all" else ".*"

    def fill(expr: str) -> str:
        filled = re.sub(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)", lambda m: values[m.group(1) or m.group(2)], expr)
        assert "$" not in filled, filled
        return filled

    return [(panel["title"], fill(target["expr"]), target.get("legendFormat", ""))
            for panel in board["panels"] for target in panel["targets"]]


def test_worker_series_start_at_zero_for_each_adapter():
    """A series that first appears at its value after an event loses that event to rate(), and a dashboard
    panel over it can stay empty: every per-adapter worker series is there, at 0, before the first batch."""
    from worker.metrics import WorkerMetrics

    for family in WorkerMetrics().registry.collect():
        if family.type == "info":
            continue  # an info metric states what is loaded; it has no value to rate() and nothing before a load
        assert family.samples, f"{family.name}: a labelled metric with no series until its first event"
        for label in ("adapter", "adapters"):
            present = {s.labels[label] for s in family.samples if label in s.labels}
            assert present in (set(), ADAPTERS), (family.name, label, present)


def test_api_latency_series_start_at_zero_for_every_route(client):
    """The same rule for the API: before any request, every route's latency series is there at 0, so the
    first burst of submissions shows on the dashboard's p95 panel (it stayed empty when only one scrape had
    seen the /v1/jobs series)."""
    counts = {(s.labels["method"], s.labels["route"]): s.value
              for family in client.app.state.metrics.registry.collect()
              if family.name == "kevlaya_http_request_duration_seconds"
              for s in family.samples if s.name.endswith("_count")}
    for method, route in [("POST", "/v1/jobs"), ("GET", "/v1/jobs/{job_id}"), ("POST", "/v1/chat/completions")]:
        assert counts.get((method, route)) == 0, (method, route, sorted(counts))


class Prometheus:
    def __init__(self, executable: str, config: dict, directory: Path):
        self.config_path = directory / "prometheus.yml"
        self.config_path.write_text(yaml.safe_dump(config, sort_keys=False))
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log_path = directory / "prometheus.log"
        self.log = open(self.log_path, "wb")
        self.process = subprocess.Popen(
            [executable, f"--config.file={self.config_path}", f"--storage.tsdb.path={directory / 'data'}",
             f"--web.listen-address={self.url.removeprefix('http://')}"],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        self.http = httpx.Client(base_url=self.url, timeout=10)

    def output(self) -> str:
        self.log.flush()
        return self.log_path.read_text(errors="replace")[-4000:]

    def ready(self) -> bool:
        assert self.process.poll() is None, self.output()
        try:
            return self.http.get("/-/ready").status_code == 200
        except httpx.TransportError:
            return False

    def query(self, expr: str) -> list[dict]:
        body = self.http.get("/api/v1/query", params={"query": expr}).json()
        assert body["status"] == "success", (expr, body.get("errorType"), body.get("error"))
        assert body["data"]["resultType"] == "vector", expr
        return body["data"]["result"]

    def by(self, expr: str, *labels: str) -> dict:
        """One query's samples keyed by the given labels' values."""
        return {tuple(s["metric"].get(k, "") for k in labels): float(s["value"][1]) for s in self.query(expr)}

    def stop(self) -> None:
        self.http.close()
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(15)
        self.log.close()


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_real_prometheus_scrapes_the_service_and_runs_every_dashboard_query(prometheus_binary, env, api,
                                                                          start_process, tmp_path):
    promtool = shutil.which("promtool")
    if promtool:  # the file as compose mounts it, before any change
        checked = subprocess.run([promtool, "check", "config", str(CONFIG)], capture_output=True, text=True)
        assert checked.returncode == 0, checked.stdout + checked.stderr

    api_target = api.base_url.host + f":{api.base_url.port}"
    worker_target = f"127.0.0.1:{env['KEVLAYA_MONITORING__METRICS_PORT']}"
    absent_target = f"127.0.0.1:{free_port()}"  # worker-gpu1 without its profile: nothing listens there
    config = local_config({"api:8000": api_target, "worker:9109": worker_target, "worker-gpu1:9109": absent_target})
    prometheus = Prometheus(prometheus_binary, config, tmp_path)
    try:
        wait_until(prometheus.ready, 30, what="Prometheus to be ready")
        start_worker(start_process, env, api)

        # every target scraped at least once before any job, so rate() sees the counters rise
        def up() -> dict:
            return prometheus.by("up", "job", "instance")

        expected_up = {("kevlaya-api", api_target): 1, ("kevlaya-worker", worker_target): 1,
                       ("kevlaya-worker", absent_target): 0}
        wait_until(lambda: up() == expected_up, 20, interval=0.5, what=f"targets up as {expected_up}: {up()}")

        jobs = run_jobs(api)
        # kev: two jobs and the escalated stage; laya: two, the auto job's Laya stage, the failed one
        finished = {("kev", "succeeded"): 3, ("kev", "failed"): 0, ("laya", "succeeded"): 3, ("laya", "failed"): 1}

        def scraped() -> dict:
            return prometheus.by("sum by (adapter, status) (kevlaya_jobs_finished_total)", "adapter", "status")

        wait_until(lambda: scraped() == finished, 20, interval=0.5, what=f"jobs finished as {finished}: {scraped()}")
        assert up() == expected_up

        per_adapter = {(a,): sum(n for (adapter, _), n in finished.items() if adapter == a) for a in ADAPTERS}
        assert prometheus.by("sum by (adapter) (kevlaya_job_end_to_end_seconds_count)", "adapter") == per_adapter
        for name in ("queue_wait", "time_to_first_token", "time_per_output_token"):
            counts = prometheus.by(f"sum by (adapter) (kevlaya_job_{name}_seconds_count)", "adapter")
            assert set(counts) == {(a,) for a in ADAPTERS} and all(n >= 1 for n in counts.values()), (name, counts)
        failures = prometheus.by("sum by (adapter, code) (kevlaya_job_failures_total) > 0", "adapter", "code")
        assert failures == {("laya", "length"): 1}
        assert prometheus.by("sum(kevlaya_escalations_total)") == {(): 1}
        tokens = sum(j["tokens"]["completion"] for j in jobs)
        assert prometheus.by("sum(kevlaya_completion_tokens_total)") == {(): tokens}
        # the API is another target, scraped on its own schedule: its counter is waited for like the worker's
        def posted() -> dict:
            return prometheus.by('sum(kevlaya_http_requests_total{route="/v1/jobs", method="POST", status="202"})')

        wait_until(lambda: posted() == {(): len(jobs)}, 20, interval=0.5, what=f"{len(jobs)} posts: {posted()}")

        # the dashboard: every query parses and runs on this Prometheus, and has series for its legend
        quantiles_seen = 0
        for title, expr, legend in dashboard_queries():
            result = prometheus.query(expr)
            assert any(math.isfinite(float(s["value"][1])) for s in result), f"{title}: no data for {expr}: {result}"
            for label in re.findall(r"\{\{\s*(\w+)\s*\}\}", legend):
                assert all(label in s["metric"] for s in result), (title, expr, label)
            if expr.startswith("histogram_quantile(") and "adapter" in expr:
                finite = {s["metric"]["adapter"] for s in result if math.isfinite(float(s["value"][1]))}
                assert finite == ADAPTERS, f"{title}: values for {finite} only, from {expr}"
                quantiles_seen += 1
        assert quantiles_seen >= 8, "latency quantiles per adapter are the dashboard's main panels"
        assert prometheus.by("sum(kevlaya_worker_up)") == {(): 1}
        assert prometheus.by("sum by (adapter) (kevlaya_queue_depth)", "adapter") == {(a,): 0 for a in ADAPTERS}
    except BaseException:
        print(prometheus.output())
        raise
    finally:
        prometheus.stop()
