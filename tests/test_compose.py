"""The deployment files say what docs/architecture.md §2 and §11 require.

There may be no Docker engine where the tests run, so docker-compose.yml is parsed with PyYAML and its
`${VAR}` interpolation is resolved here. When a compose CLI is installed, `config -q` checks the file too.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from sqlalchemy.engine import make_url

ROOT = Path(__file__).resolve().parents[1]
COMPOSE_FILE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"

REQUIRED_ENV = {"POSTGRES_PASSWORD": "pg-s3cret", "REDIS_PASSWORD": "r3dis-s3cret", "FLOWER_BASIC_AUTH": "admin:fl0wer"}
WORKERS = ("worker", "worker-gpu1")  # one service per GPU
MONITORING = {"prometheus", "grafana"}  # the `monitoring` profile
SERVICES = {"redis", "postgres", "migrate", "api", *WORKERS, "flower", *MONITORING}
LONG_RUNNING = SERVICES - {"migrate"}
APP_SERVICES_WITH_DB = ("api", "worker", "migrate")


# --- a small model of compose interpolation -------------------------------------------------------------

class MissingVariable(Exception):
    pass


# An argument may hold one level of nested interpolation: `${NEW:-${OLD:-default}}`.
_VAR = re.compile(r"\$(?:(?P<escaped>\$)|\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?])(?P<arg>(?:[^{}$]|\$\{[^{}]*\})*))?\}|(?P<bare>[A-Za-z_][A-Za-z0-9_]*))")


def interpolate_string(text: str, env: dict[str, str]) -> str:
    def replace(m: re.Match[str]) -> str:
        if m.group("escaped"):
            return "$"
        name = m.group("name") or m.group("bare")
        op, arg = m.group("op"), m.group("arg") or ""
        value = env.get(name)
        unset_or_empty = value is None or (op is not None and op.startswith(":") and value == "")
        if op in ("-", ":-"):
            return interpolate_string(arg, env) if unset_or_empty else value
        if op in ("?", ":?"):
            if unset_or_empty:
                raise MissingVariable(f"{name}: {interpolate_string(arg, env)}")
            return value
        return value or ""

    return _VAR.sub(replace, text)


def interpolate(node, env: dict[str, str]):
    if isinstance(node, str):
        return interpolate_string(node, env)
    if isinstance(node, list):
        return [interpolate(item, env) for item in node]
    if isinstance(node, dict):
        return {key: interpolate(value, env) for key, value in node.items()}
    return node


def raw_compose() -> dict:
    return yaml.safe_load(COMPOSE_FILE.read_text())


def resolved_compose(**overrides: str) -> dict:
    return interpolate(raw_compose(), {**REQUIRED_ENV, **overrides})


def service_env(service: dict, env: dict[str, str] | None = None) -> dict[str, str]:
    """The container environment, as compose builds it (list or map form; a bare name passes through)."""
    env = {**REQUIRED_ENV, **(env or {})}
    declared = service.get("environment") or {}
    if isinstance(declared, list):
        declared = dict(item.split("=", 1) if "=" in item else (item, None) for item in declared)
    out = {}
    for key, value in declared.items():
        if value is None:
            if key in env:
                out[key] = env[key]
        else:
            out[key] = str(value)
    return out


def published_ports(service: dict) -> list[tuple[str | None, str, str]]:
    """(host_ip, published, target) for each entry of `ports`, short or long syntax."""
    out = []
    for entry in service.get("ports") or []:
        if isinstance(entry, dict):
            out.append((entry.get("host_ip"), str(entry.get("published")), str(entry["target"])))
            continue
        parts = str(entry).split("/")[0].rsplit(":", 2)
        if len(parts) == 3:
            out.append((parts[0], parts[1], parts[2]))
        elif len(parts) == 2:
            out.append((None, parts[0], parts[1]))
        else:
            out.append((None, "", parts[0]))
    return out


def duration_seconds(value: str | int | float) -> float:
    """Compose durations: `10m`, `90s`, `1m30s`, `1h`, `500ms` (a bare number is seconds)."""
    if isinstance(value, (int, float)):
        return float(value)
    units = {"h": 3600, "m": 60, "s": 1, "ms": 1e-3, "us": 1e-6}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|us|h|m|s)", value)
    if not parts or "".join(n + u for n, u in parts) != value.strip():
        raise ValueError(f"not a compose duration: {value!r}")
    return sum(float(n) * units[u] for n, u in parts)


def command_tokens(service: dict) -> list[str]:
    command = service.get("command") or []
    return command.split() if isinstance(command, str) else [str(c) for c in command]


def healthcheck_tokens(service: dict) -> list[str]:
    test = service["healthcheck"]["test"]
    return [test] if isinstance(test, str) else list(test)


def volume_targets(service: dict) -> dict[str, tuple[str, bool]]:
    """target -> (source, read_only)."""
    out = {}
    for entry in service.get("volumes") or []:
        if isinstance(entry, dict):
            out[entry["target"]] = (entry.get("source", ""), bool(entry.get("read_only")))
            continue
        source, target, *mode = entry.split(":")
        out[target] = (source, bool(mode) and "ro" in mode[0].split(","))
    return out


# --- the helpers themselves -----------------------------------------------------------------------------

def test_interpolation_model():
    env = {"SET": "x", "EMPTY": ""}
    assert interpolate_string("${SET:-d}/${UNSET:-d}/${EMPTY:-d}/${EMPTY-d}/$$SET/$SET", env) == "x/d/d//$SET/x"
    assert interpolate_string("${UNSET:-${SET:-d}}/${UNSET:-${UNSET:-d}}/${SET:-${UNSET:?unused}}", env) == "x/d/x"
    with pytest.raises(MissingVariable, match="UNSET: need it"):
        interpolate_string("${UNSET:?need it}", env)
    with pytest.raises(MissingVariable):
        interpolate_string("${EMPTY:?need it}", env)
    assert duration_seconds("10m") == 600 and duration_seconds("90s") == 90 and duration_seconds("1m30s") == 90
    with pytest.raises(ValueError):
        duration_seconds("ten minutes")


# --- the compose file -----------------------------------------------------------------------------------

def test_service_set():
    assert set(raw_compose()["services"]) == SERVICES


@pytest.mark.parametrize("missing", sorted(REQUIRED_ENV))
def test_secrets_are_required(missing):
    env = {k: v for k, v in REQUIRED_ENV.items() if k != missing}
    with pytest.raises(MissingVariable, match=missing):
        interpolate(raw_compose(), env)


def test_everything_resolves_with_the_required_variables_only():
    text = json.dumps(resolved_compose())
    assert "${" not in text


def test_only_api_flower_and_grafana_publish_ports_on_the_publish_host():
    raw, resolved = raw_compose()["services"], resolved_compose()["services"]
    publishers = {name for name, svc in raw.items() if svc.get("ports")}
    assert publishers == {"api", "flower", "grafana"}
    for name in ("redis", "postgres", *WORKERS, "migrate", "prometheus"):
        assert not raw[name].get("ports") and raw[name].get("network_mode") != "host", name

    expected = {"api": "8000", "flower": "5555", "grafana": "3000"}
    for name, target in expected.items():
        (raw_host, _, _), = published_ports(raw[name])
        assert raw_host.startswith("${KEVLAYA_PUBLISH_HOST"), f"{name} must bind to the publish-host variable"
        assert published_ports(resolved[name]) == [("127.0.0.1", target, target)], "default binds to loopback"
        opened = resolved_compose(KEVLAYA_PUBLISH_HOST="0.0.0.0")["services"][name]
        assert published_ports(opened) == [("0.0.0.0", target, target)]


def test_long_running_services_have_healthchecks():
    services = raw_compose()["services"]
    for name in LONG_RUNNING:
        check = services[name].get("healthcheck")
        assert check and not check.get("disable") and healthcheck_tokens(services[name])[0] != "NONE", name
    assert "ping" in healthcheck_tokens(services["redis"]) and "redis-cli" in healthcheck_tokens(services["redis"])
    assert "pg_isready" in healthcheck_tokens(services["postgres"])
    assert any("http://127.0.0.1:8000/healthz" in t for t in healthcheck_tokens(services["api"]))
    for name in WORKERS:
        assert healthcheck_tokens(services[name])[-2:] == ["kevlaya", "worker-health"]
    assert any("127.0.0.1:5555/healthcheck" in t for t in healthcheck_tokens(services["flower"]))


def test_start_order():
    services = raw_compose()["services"]

    def conditions(name):
        deps = services[name].get("depends_on") or {}
        assert isinstance(deps, dict), f"{name}: depends_on needs conditions (long syntax)"
        return {dep: spec.get("condition") for dep, spec in deps.items()}

    for name in ("api", *WORKERS):
        assert conditions(name) == {
            "migrate": "service_completed_successfully",
            "redis": "service_healthy",
        }, name
    assert conditions("migrate") == {"postgres": "service_healthy"}
    assert conditions("flower") == {"redis": "service_healthy"}
    assert str(services["migrate"].get("restart")) == "no"
    assert command_tokens(services["migrate"]) == ["db", "upgrade"]


def test_redis_is_durable_and_never_evicts():
    compose = raw_compose()
    redis = compose["services"]["redis"]
    tokens = command_tokens(redis)
    assert tokens[tokens.index("--appendonly") + 1] == "yes"
    assert tokens[tokens.index("--maxmemory-policy") + 1] == "noeviction"
    assert str(redis["image"]).startswith("redis:7")
    source, _ = volume_targets(redis)["/data"]
    assert source in compose["volumes"], "redis data lives in a named volume"


def test_redis_asks_every_client_for_the_password():
    """The API and the worker refuse a Redis beyond localhost without one (shared/redis_auth.py)."""
    compose = resolved_compose()
    redis = compose["services"]["redis"]
    tokens = command_tokens(redis)
    assert tokens[tokens.index("--requirepass") + 1] == REQUIRED_ENV["REDIS_PASSWORD"]
    assert service_env(redis)["REDISCLI_AUTH"] == REQUIRED_ENV["REDIS_PASSWORD"]  # the healthcheck's
    for name in (*APP_SERVICES_WITH_DB, "flower"):
        assert make_url(service_env(compose["services"][name])["KEVLAYA_REDIS__URL"]).password == \
            REQUIRED_ENV["REDIS_PASSWORD"], name


def test_postgres_is_16_with_a_named_volume():
    compose = raw_compose()
    postgres = compose["services"]["postgres"]
    assert str(postgres["image"]).split(":")[1].startswith("16")
    source, _ = volume_targets(postgres)["/var/lib/postgresql/data"]
    assert source in compose["volumes"]


def gpu_ids(service: dict) -> list[str]:
    devices = service["deploy"]["resources"]["reservations"]["devices"]
    assert all(d.get("driver") == "nvidia" and "gpu" in d.get("capabilities", []) for d in devices)
    # `count` would give every replica or copy of the service the first GPU: pinned ids only.
    assert all("count" not in d for d in devices), "pin GPUs with device_ids, never count"
    return [str(i) for d in devices for i in d.get("device_ids", [])]


@pytest.mark.parametrize("name", WORKERS)
def test_each_worker_owns_one_gpu_and_gets_time_to_finish_a_batch(name):
    from shared.settings import ReliabilitySettings

    worker = raw_compose()["services"][name]
    assert len(gpu_ids(worker)) == 1
    grace = duration_seconds(worker["stop_grace_period"])
    assert grace > 10, "docker SIGKILLs after 10 s by default (docs/architecture.md §11)"
    # A task stops claiming new batches after drain_seconds and then finishes the batch it holds.
    assert grace > ReliabilitySettings.model_fields["drain_seconds"].default
    assert worker.get("init") is True
    assert command_tokens(worker) == ["worker"]
    assert service_env(resolved_compose()["services"][name])["KEVLAYA_MODEL__DEVICE"] == "cuda"
    assert volume_targets(worker)["/app/models"] == ("./models", True)


def test_scaled_out_workers_use_distinct_gpus():
    """`--scale worker=2` would give both replicas GPU 0: every GPU has its own worker service instead,
    identical but for the device; the extra ones start only when asked for (a one-GPU host has no GPU 1)."""
    services = raw_compose()["services"]
    ids = [gpu_ids(services[name])[0] for name in WORKERS]
    assert ids == [str(i) for i in range(len(WORKERS))]
    assert "profiles" not in services["worker"]
    for name in WORKERS[1:]:
        assert services[name]["profiles"] == [f"gpu{name.removeprefix('worker-gpu')}"]
        same = {k: v for k, v in services[name].items() if k not in ("deploy", "profiles")}
        assert same == {k: v for k, v in services["worker"].items() if k != "deploy"}, name


def test_flower_requires_basic_auth():
    flower = resolved_compose()["services"]["flower"]
    env = service_env(flower)
    assert env["KEVLAYA_FLOWER__BASIC_AUTH"] == REQUIRED_ENV["FLOWER_BASIC_AUTH"]
    assert env["KEVLAYA_FLOWER__HOST"] == "0.0.0.0" and env["KEVLAYA_FLOWER__PORT"] == "5555"
    assert make_url(env["KEVLAYA_REDIS__URL"]).host == "redis"
    assert "KEVLAYA_DATABASE__URL" not in env, "flower needs no database credentials"


def test_app_services_point_at_postgres_and_redis():
    compose = resolved_compose()
    pg_env = service_env(compose["services"]["postgres"])
    for name in APP_SERVICES_WITH_DB:
        env = service_env(compose["services"][name])
        db = make_url(env["KEVLAYA_DATABASE__URL"])
        assert db.drivername == "postgresql+psycopg", name
        assert (db.host, db.port) == ("postgres", 5432), name
        assert db.username == pg_env["POSTGRES_USER"] and db.database == pg_env["POSTGRES_DB"], name
        assert db.password == REQUIRED_ENV["POSTGRES_PASSWORD"] == pg_env["POSTGRES_PASSWORD"], name
        redis = make_url(env["KEVLAYA_REDIS__URL"])
        assert (redis.drivername, redis.host, redis.port or 6379) == ("redis", "redis", 6379), name
        assert redis.password == REQUIRED_ENV["REDIS_PASSWORD"], name
    api_env = service_env(compose["services"]["api"])
    assert api_env["KEVLAYA_API__HOST"] == "0.0.0.0" and api_env["KEVLAYA_API__PORT"] == "8000"


def test_api_key_passes_through_only_when_set():
    api = resolved_compose()["services"]["api"]
    assert "KEVLAYA_API__KEY" not in service_env(api), "an unset key must not become an empty key"
    assert service_env(api, {"KEVLAYA_API__KEY": "boot"})["KEVLAYA_API__KEY"] == "boot"
    # its flat name of the release before passes through too, for the settings to read (and warn about)
    assert "KEVLAYA_API_KEY" not in service_env(api)
    assert service_env(api, {"KEVLAYA_API_KEY": "boot"})["KEVLAYA_API_KEY"] == "boot"


def test_models_are_mounted_read_only_and_configurable():
    for name in ("api", *WORKERS):  # the API reads the tokenizer to count prompt tokens
        source, read_only = volume_targets(raw_compose()["services"][name])["/app/models"]
        assert source == "./models" and read_only, name
    defaults = service_env(resolved_compose()["services"]["worker"])
    assert defaults["KEVLAYA_MODEL__BASE"] == "/app/models/demo/base"
    assert defaults["KEVLAYA_KEV__PATH"] == "/app/models/demo/kev"
    assert defaults["KEVLAYA_LAYA__PATH"] == "/app/models/demo/laya"
    for name in ("api", *WORKERS):  # the worker writes the GGUF base's cache once, the API reads its tokenizer
        assert service_env(resolved_compose()["services"][name])["KEVLAYA_MODEL__CACHE_DIR"] == "/model-cache"
        source, read_only = volume_targets(raw_compose()["services"][name])["/model-cache"]
        assert source == "model-cache" and read_only == (name == "api"), name
    custom = service_env(resolved_compose(KEVLAYA_MODEL__BASE="/app/models/qwen",
                                          KEVLAYA_KEV__PATH="/app/models/k")["services"]["worker"])
    assert custom["KEVLAYA_MODEL__BASE"] == "/app/models/qwen" and custom["KEVLAYA_KEV__PATH"] == "/app/models/k"
    # the flat names of the release before still choose them, for one release; the new names win
    flat = service_env(resolved_compose(KEVLAYA_BASE_MODEL="/app/models/old",
                                        KEVLAYA_ENGINE_WINDOW_TOKENS="2048")["services"]["worker"])
    assert (flat["KEVLAYA_MODEL__BASE"], flat["KEVLAYA_ENGINE__WINDOW_TOKENS"]) == ("/app/models/old", "2048")
    both = service_env(resolved_compose(KEVLAYA_BASE_MODEL="/app/models/old",
                                        KEVLAYA_MODEL__BASE="/app/models/new")["services"]["worker"])
    assert both["KEVLAYA_MODEL__BASE"] == "/app/models/new"


def test_app_services_share_one_image():
    services = raw_compose()["services"]
    images = {services[name].get("image") for name in ("migrate", "api", *WORKERS, "flower")}
    assert len(images) == 1 and None not in images
    for name in ("migrate", "api", *WORKERS, "flower"):
        assert services[name].get("build") in (".", {"context": "."}), name


# --- the real compose CLI, where there is one -----------------------------------------------------------

def compose_cli() -> list[str] | None:
    candidates = []
    if shutil.which("docker"):
        candidates.append(["docker", "compose"])
    if shutil.which("docker-compose"):
        candidates.append(["docker-compose"])
    for cli in candidates:
        try:
            if subprocess.run([*cli, "version"], capture_output=True, timeout=30).returncode == 0:
                return cli
        except (OSError, subprocess.TimeoutExpired):
            continue
    return None


def run_compose_config(cli: list[str], env: dict[str, str], tmp_path: Path) -> subprocess.CompletedProcess:
    empty_env_file = tmp_path / "empty.env"  # keeps a developer's .env out of the check
    empty_env_file.write_text("")
    base = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "DOCKER_CONFIG")}
    return subprocess.run(
        [*cli, "--env-file", str(empty_env_file), "-f", str(COMPOSE_FILE), "config", "-q"],
        capture_output=True, text=True, timeout=60, env={**base, **env}, cwd=ROOT,
    )


def test_compose_config(tmp_path):
    cli = compose_cli()
    if cli is None:
        # No compose CLI here: the file is at least valid YAML whose anchors merge and whose variables
        # resolve, and an unset secret stops it (what `config -q` would report).
        resolved = resolved_compose()
        for name in ("migrate", "api", "worker"):
            assert "KEVLAYA_DATABASE__URL" in service_env(resolved["services"][name])
        with pytest.raises(MissingVariable):
            interpolate(raw_compose(), {})
        return
    ok = run_compose_config(cli, REQUIRED_ENV, tmp_path)
    assert ok.returncode == 0, ok.stderr
    missing = run_compose_config(cli, {"FLOWER_BASIC_AUTH": "a:b", "REDIS_PASSWORD": "r"}, tmp_path)
    assert missing.returncode != 0 and "POSTGRES_PASSWORD" in missing.stderr


# --- the image ------------------------------------------------------------------------------------------

def dockerfile_instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            out.append((keyword.upper(), rest.strip()))
    return out


def test_dockerfile_runs_kevlaya_unprivileged_in_exec_form():
    instructions = dockerfile_instructions()
    assert instructions[0] == ("FROM", "python:3.12-slim")
    values = {}
    for keyword, rest in instructions:
        values.setdefault(keyword, []).append(rest)
    assert values["WORKDIR"][-1] == "/app"
    user = values["USER"][-1]
    assert user not in ("root", "0") and not user.startswith("0:")
    # The last USER comes after the install, so the service never runs as root.
    last_user = max(i for i, (k, _) in enumerate(instructions) if k == "USER")
    assert all(i < last_user for i, (k, _) in enumerate(instructions) if k == "RUN")
    assert json.loads(values["ENTRYPOINT"][-1]) == ["kevlaya"], "exec form, so signals reach the process"
    assert isinstance(json.loads(values["CMD"][-1]), list)
    assert any('.[cuda]' in run and "pip install" in run for run in values["RUN"])
    copied = {src.rstrip("/") for rest in values["COPY"] for src in rest.split()[:-1] if not src.startswith("--")}
    needed = {"pyproject.toml", "api", "worker", "shared", "migrations", "modellab", "cli"}
    needed |= {name for name in ("README.md", "alembic.ini") if (ROOT / name).exists()}
    assert needed <= copied, needed - copied


def test_dockerignore_keeps_local_state_out():
    patterns = {line.strip() for line in DOCKERIGNORE.read_text().splitlines()}
    for needed in (".git", ".venv", "**/__pycache__", "**/*.db", ".kevlaya", ".env", "**/.pytest_cache", "models"):
        assert needed in patterns, needed


# --- monitoring and Flower's history --------------------------------------------------------------------

MONITORING_DIR = ROOT / "monitoring"
DASHBOARD = MONITORING_DIR / "grafana" / "dashboards" / "kevlaya.json"


def dashboard_metric_names() -> set[str]:
    """Every metric name the dashboard's queries use (kevlaya_ series; PromQL functions are not metrics)."""
    exprs = [target["expr"] for panel in json.loads(DASHBOARD.read_text())["panels"] for target in panel["targets"]]
    assert exprs and all("kevlaya_" in expr for expr in exprs)
    return {name for expr in exprs for name in re.findall(r"\bkevlaya_[a-zA-Z0-9_:]+", expr)}


def test_monitoring_is_a_profile_of_its_own():
    services = raw_compose()["services"]
    for name in MONITORING:
        assert services[name]["profiles"] == ["monitoring"], name
    for name in SERVICES - MONITORING - {"worker-gpu1"}:
        assert "profiles" not in services[name], f"{name} must start without a profile"


def test_prometheus_scrapes_the_api_and_every_worker_at_their_service_names_and_ports():
    compose = resolved_compose()
    services = compose["services"]
    prometheus = services["prometheus"]
    source, read_only = volume_targets(prometheus)["/etc/prometheus/prometheus.yml"]
    assert (ROOT / source).resolve() == MONITORING_DIR / "prometheus.yml" and read_only
    config = yaml.safe_load((MONITORING_DIR / "prometheus.yml").read_text())
    targets = {target for job in config["scrape_configs"] for group in job["static_configs"]
               for target in group["targets"]}
    paths = {job.get("metrics_path", "/metrics") for job in config["scrape_configs"]}
    assert paths == {"/metrics"}
    expected = {f"api:{service_env(services['api'])['KEVLAYA_API__PORT']}"}
    for name in WORKERS:
        env = service_env(services[name])
        assert env["KEVLAYA_MONITORING__METRICS_HOST"] == "0.0.0.0", "reachable from the prometheus container"
        assert env["KEVLAYA_MONITORING__METRICS_PORT"] != "0"
        assert env["KEVLAYA_MONITORING__METRICS_PORT"] in [str(p) for p in services[name].get("expose", [])]
        expected.add(f"{name}:{env['KEVLAYA_MONITORING__METRICS_PORT']}")
    assert targets == expected
    for target in targets:
        assert target.split(":")[0] in services


def test_grafana_is_provisioned_with_prometheus_and_the_dashboard_and_needs_a_password():
    services = raw_compose()["services"]
    grafana = services["grafana"]
    mounts = volume_targets(grafana)
    provisioning, read_only = mounts["/etc/grafana/provisioning"]
    assert read_only and (ROOT / provisioning).resolve() == MONITORING_DIR / "grafana" / "provisioning"
    dashboards_dir, _ = mounts["/var/lib/grafana/dashboards"]
    assert (ROOT / dashboards_dir).resolve() == DASHBOARD.parent
    providers = yaml.safe_load((MONITORING_DIR / "grafana/provisioning/dashboards/kevlaya.yml").read_text())
    assert providers["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"
    sources = yaml.safe_load((MONITORING_DIR / "grafana/provisioning/datasources/prometheus.yml").read_text())
    [source] = sources["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    used = {panel["datasource"]["uid"] for panel in json.loads(DASHBOARD.read_text())["panels"]}
    assert used == {source["uid"]}
    # Without GRAFANA_ADMIN_PASSWORD the container refuses to start rather than use admin/admin.
    assert "GF_SECURITY_ADMIN_PASSWORD" in " ".join(grafana["entrypoint"])
    assert service_env(resolved_compose()["services"]["grafana"])["GF_SECURITY_ADMIN_PASSWORD"] == ""
    assert service_env(resolved_compose(GRAFANA_ADMIN_PASSWORD="g")["services"]["grafana"])[
        "GF_SECURITY_ADMIN_PASSWORD"] == "g"


def test_flower_keeps_its_history_on_a_volume_and_its_password_out_of_the_command_line():
    compose = raw_compose()
    flower = compose["services"]["flower"]
    env = service_env(resolved_compose()["services"]["flower"])
    source, read_only = volume_targets(flower)[str(Path(env["KEVLAYA_FLOWER__DB"]).parent)]
    assert source in compose["volumes"] and not read_only
    assert REQUIRED_ENV["FLOWER_BASIC_AUTH"] not in " ".join(command_tokens(flower))
    values = [rest for keyword, rest in dockerfile_instructions() if keyword == "RUN"]
    assert any("chown kevlaya:kevlaya /data" in run for run in values), "the service user must own /data"


def test_the_apis_batch_files_live_on_a_volume_the_service_user_owns():
    compose = raw_compose()
    api = compose["services"]["api"]
    files_dir = service_env(resolved_compose()["services"]["api"])["KEVLAYA_BATCH__FILES_DIR"]
    source, read_only = volume_targets(api)[files_dir]
    assert source in compose["volumes"] and not read_only  # files and batches outlive a new container
    runs = " ".join(rest for keyword, rest in dockerfile_instructions() if keyword == "RUN")
    assert re.search(rf"chown kevlaya:kevlaya [^&]*{re.escape(files_dir)}\b", runs), "the service user must own it"
