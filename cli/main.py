"""`kevlaya`: the command-line tool. Heavy imports (torch, uvicorn, the worker) happen inside commands."""

from __future__ import annotations

import json
import os
import socket
import sys
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Annotated, Optional

import typer

from modellab.bench.cli import bench, load
from shared.settings import get_settings

app = typer.Typer(help="Kev & Laya decision-job service.", no_args_is_help=True, add_completion=False)
db_app = typer.Typer(help="Database schema.", no_args_is_help=True)
keys_app = typer.Typer(help="API keys (stored hashed; the key is shown once).", no_args_is_help=True)
models_app = typer.Typer(help="Model directories.", no_args_is_help=True)
dev_app = typer.Typer(help="Development aids: bulk data for measurements.", no_args_is_help=True)
app.add_typer(db_app, name="db")
app.add_typer(keys_app, name="keys")
app.add_typer(models_app, name="models")
app.add_typer(dev_app, name="dev")
app.command("bench")(bench)  # defined beside the benchmark it runs
app.command("load")(load)


def _fail(message: str) -> None:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(2)


@db_app.command("upgrade")
def db_upgrade(
    revision: Annotated[str, typer.Argument(help="target revision")] = "head",
    wait: Annotated[float, typer.Option(help="seconds to wait for the database to answer")] = 60,
) -> None:
    """Apply migrations to KEVLAYA_DATABASE_URL (waits for the database first)."""
    from shared.migrate import upgrade, wait_for_database

    url = get_settings().database_url
    try:
        wait_for_database(url, wait)
    except Exception as exc:
        _fail(f"database {url} does not answer: {exc}")
    upgrade(url, revision)
    typer.echo(f"database at {revision}: {url}")


@keys_app.command("create")
def keys_create(
    name: Annotated[str, typer.Argument(help="who or what the key is for")],
    admin: Annotated[bool, typer.Option(help="may see every job, not only its own")] = False,
    rate_limit: Annotated[Optional[int], typer.Option(help="requests per minute this key may make (default: unlimited)")] = None,
) -> None:
    """Create an API key and print it (only this once)."""
    from shared.db import session_scope
    from shared.keys import create_key

    with session_scope() as session:
        row, plain = create_key(session, name, admin=admin, rate_limit_per_minute=rate_limit)
    typer.echo(f"id:  {row.id}\nkey: {plain}")


@keys_app.command("list")
def keys_list() -> None:
    """List keys (never the keys themselves)."""
    from sqlalchemy import select

    from shared.db import session_scope
    from shared.models import ApiKey

    with session_scope() as session:
        for row in session.scalars(select(ApiKey).order_by(ApiKey.created_at)):
            state = f"revoked {row.revoked_at:%Y-%m-%d %H:%M}" if row.revoked_at else "active"
            typer.echo(f"{row.id}  {row.name:<20} {'admin' if row.is_admin else 'user ':<6} {state}")


@keys_app.command("revoke")
def keys_revoke(key_id: Annotated[str, typer.Argument(help="the key's id (from `keys list`)")]) -> None:
    """Revoke a key at once."""
    from shared.db import session_scope
    from shared.models import ApiKey

    try:
        parsed = uuid.UUID(key_id)
    except ValueError:
        _fail(f"key id {key_id!r} is not a UUID")
    with session_scope() as session:
        row = session.get(ApiKey, parsed)
        if row is None:
            _fail(f"no key with id {key_id}")
        row.revoked_at = datetime.now(timezone.utc)
    typer.echo(f"revoked {key_id}")


def _exec_celery(args: list[str]) -> None:
    """Replace this process with Celery's, so signals (docker stop, Ctrl-C) reach it directly."""
    os.execv(sys.executable, [sys.executable, "-m", "celery", *args])


@app.command("api")
def api(reload: Annotated[bool, typer.Option(help="restart on code changes (development)")] = False) -> None:
    """Serve the REST API on KEVLAYA_API_HOST:KEVLAYA_API_PORT."""
    import uvicorn

    settings = get_settings()
    # h11 (not httptools) because it bounds the request line and headers; httptools takes any size.
    uvicorn.run("api.main:create_app", factory=True, host=settings.api_host, port=settings.api_port,
                reload=reload, workers=None if reload else settings.api_workers, proxy_headers=True,
                log_level="info", http="h11",
                h11_max_incomplete_event_size=settings.max_header_bytes)


@app.command("worker")
def worker(loglevel: Annotated[str, typer.Option(help="Celery log level")] = "INFO") -> None:
    """Run the GPU worker: one Celery prefork child at concurrency 1 that loads the model."""
    _exec_celery(["-A", "worker.tasks", "worker", "--pool", "prefork", "--concurrency", "1",
                      "--prefetch-multiplier", "1", "-E", "-n", f"kevlaya-{os.getpid()}@{socket.gethostname()}",
                      "--loglevel", loglevel])


@app.command("worker-health")
def worker_health() -> None:
    """Exit 0 when a worker on this host has reported in with its model loaded (for health checks)."""
    from shared.heartbeat import live_workers

    host = socket.gethostname()
    mine = {k: v for k, v in live_workers().items() if k.split(":")[0] == host}
    typer.echo(json.dumps(mine, indent=2))
    if not any(info.get("model_loaded") for info in mine.values()):
        raise typer.Exit(1)


@app.command("flower")
def flower() -> None:
    """Serve Flower (queue monitoring) on KEVLAYA_FLOWER_HOST:KEVLAYA_FLOWER_PORT."""
    settings = get_settings()
    args = ["flower", f"--address={settings.flower_host}", f"--port={settings.flower_port}"]
    if settings.flower_db:  # task history survives a restart of Flower
        args += ["--persistent=True", f"--db={settings.flower_db}"]
    # Secrets travel in the environment, not on the command line, where `ps` shows them to every user.
    os.environ["CELERY_BROKER_URL"] = settings.redis_url
    os.environ.pop("FLOWER_BASIC_AUTH", None)
    if settings.flower_basic_auth:
        os.environ["FLOWER_BASIC_AUTH"] = settings.flower_basic_auth.get_secret_value()
    elif settings.flower_host not in ("127.0.0.1", "localhost", "::1"):
        _fail("Flower listens beyond localhost: set KEVLAYA_FLOWER_BASIC_AUTH=user:password")
    _exec_celery(args)


@models_app.command("random")
def models_random(
    out: Annotated[Path, typer.Argument(help="directory to write base/, kev/ and laya/ into")],
    shape: Annotated[str, typer.Option(help="tiny, slow-load, qwen2.5-1.5b, qwen2.5-3b or llama-2-7b")] = "tiny",
    seed: Annotated[int, typer.Option()] = 0,
) -> None:
    """Build a random-weight base model of a real shape plus Kev/Laya LoRA adapters (tests, benchmarks)."""
    from modellab.model_factory import SHAPES, build_random_model

    if shape not in SHAPES:
        _fail(f"--shape must be one of {', '.join(SHAPES)}")
    paths = build_random_model(out, shape, seed=seed)
    for name, path in paths.items():
        typer.echo(f"{name}: {path}")


@models_app.command("build-demo")
def models_build_demo(
    out: Annotated[Path, typer.Option(help="directory to write base/, kev/, laya/ and BUILD.json into")] = Path(
        "models/demo"),
    data_dir: Annotated[Path, typer.Option(help="where the generated train/val/test data is written")] = Path(
        "build/demo-data"),
    device: Annotated[str, typer.Option(help="auto, cpu or cuda (CUDA: adapters trained on an NF4 base)")] = "auto",
    quick: Annotated[bool, typer.Option(help="a tiny model, a few steps each (tests); not the shipped one")] = False,
    seed: Annotated[int, typer.Option(help="the one seed every stage derives its randomness from")] = 0,
) -> None:
    """Build the demo model reproducibly: data, BPE tokenizer, pretrained base, Kev and Laya adapters, manifests."""
    import logging
    import shlex

    from modellab.demo_model import build_demo

    if device not in ("auto", "cpu", "cuda"):
        _fail("--device must be auto, cpu or cuda")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    command = shlex.join(["kevlaya", *sys.argv[1:]])
    try:
        build = build_demo(out, data_dir=data_dir, device=device, quick=quick, seed=seed, command=command)
    except ValueError as exc:
        _fail(str(exc))
    for name, seconds in build["stage_seconds"].items():
        typer.echo(f"{name:<12} {seconds:8.1f}s")
    typer.echo(f"{'total':<12} {build['total_seconds']:8.1f}s")
    typer.echo(f"base {build['parameters']['base'] / 1e6:.2f}M parameters; sizes (bytes): {build['bytes']}")
    typer.echo(f"pretrain {build['pretrain']['tokens_per_second']:,.0f} tokens/s; adapters "
               + ", ".join(f"{k} {v['tokens_per_second']:,.0f} tokens/s" for k, v in build["adapters"].items()))
    for name, score in build["test"].items():
        typer.echo(f"test {name:<22} valid JSON {score['valid_rate']:6.1%}  accuracy {score['accuracy']:6.1%}")
    typer.echo(f"written to {out}")


@models_app.command("verify")
def models_verify() -> None:
    """Check the SHA-256 manifests of the configured base model and adapters."""
    from shared.manifest import verify_manifest

    settings = get_settings()
    bad = False
    for name, path in (("base", settings.base_model), ("kev", settings.kev.path), ("laya", settings.laya.path)):
        problems = verify_manifest(Path(path))
        bad |= bool(problems)
        typer.echo(f"{name} ({path}): " + ("ok" if not problems else "; ".join(problems)))
    if bad:
        raise typer.Exit(1)


@app.command("train")
def train(
    data: Annotated[Path, typer.Argument(help='JSONL file of {"prompt", "completion", "label"?} records')],
    adapter: Annotated[str, typer.Option(help="kev or laya: picks the preset (r, alpha, lr, system prompt)")],
    base: Annotated[Path, typer.Option(help="base model directory (Hugging Face format, with its tokenizer)")],
    out: Annotated[Path, typer.Option(help="directory to write the adapter, training.json and the manifest into")],
    r: Annotated[Optional[int], typer.Option(help="LoRA rank (preset: kev 16, laya 8)")] = None,
    alpha: Annotated[Optional[int], typer.Option(help="LoRA alpha (preset: kev 32, laya 16)")] = None,
    lr: Annotated[Optional[float], typer.Option(help="peak learning rate (preset: kev 1e-4, laya 2e-4)")] = None,
    targets: Annotated[str, typer.Option(help="comma-separated module names to adapt")] = "q_proj,v_proj",
    epochs: Annotated[float, typer.Option(help="passes over the (resampled) data")] = 1.0,
    max_steps: Annotated[Optional[int], typer.Option(help="optimizer steps; overrides --epochs")] = None,
    batch_size: Annotated[int, typer.Option(help="samples per micro-batch")] = 16,
    grad_accum: Annotated[int, typer.Option(help="micro-batches per optimizer step")] = 1,
    max_seq_tokens: Annotated[int, typer.Option(help="longer samples (prompt + completion) are left out")] = 512,
    eval_file: Annotated[Optional[Path], typer.Option(help="labelled JSONL to score decisions on afterwards")] = None,
    system_prompt: Annotated[Optional[str], typer.Option(help="(default: the adapter's serving system prompt)")] = None,
    seed: Annotated[int, typer.Option()] = 0,
    device: Annotated[str, typer.Option(help="auto, cpu or cuda (CUDA: QLoRA on an NF4 base)")] = "auto",
) -> None:
    """Train a Kev or Laya LoRA adapter on a base model (QLoRA on CUDA, full-precision base on the CPU)."""
    import logging

    from modellab.training import DataError, TrainConfig, TrainingDiverged, preset, train_adapter

    if adapter not in ("kev", "laya"):
        _fail("--adapter must be kev or laya")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    defaults = preset(adapter)
    try:
        config = TrainConfig(
            base_model=base, data_file=data, output_dir=out, adapter=adapter,
            system_prompt=defaults["system_prompt"] if system_prompt is None else system_prompt,
            r=defaults["r"] if r is None else r, alpha=defaults["alpha"] if alpha is None else alpha,
            lr=defaults["lr"] if lr is None else lr,
            target_modules=tuple(t.strip() for t in targets.split(",") if t.strip()), epochs=epochs,
            max_steps=max_steps, batch_size=batch_size, grad_accum=grad_accum, max_seq_tokens=max_seq_tokens,
            eval_file=eval_file, seed=seed, device=device,
        )
        report = train_adapter(config)
    except DataError as exc:  # every problem with its line number, no traceback: the file is at fault
        typer.secho(f"error: {exc.path} cannot be used for training; nothing was trained", fg=typer.colors.RED,
                    err=True)
        typer.echo(str(exc), err=True)
        raise typer.Exit(2)
    except (ValueError, OSError, TrainingDiverged) as exc:
        _fail(str(exc))
    typer.echo(report.summary())
    typer.echo(f"adapter written to {out}")


@app.command("run")
def run(
    flower: Annotated[bool, typer.Option(help="also serve Flower")] = True,
) -> None:
    """Run everything locally: migrate, find or start Redis, then the API, one worker and Flower."""
    from cli.local_run import run_local

    sys.exit(run_local(with_flower=flower))


@app.command("eval")
def evaluate(
    scenarios: Annotated[Path, typer.Option(help="held-out test scenarios (JSONL from the demo build)")] = Path(
        "models/demo/test_scenarios.jsonl"),
    out: Annotated[Path, typer.Option(help="directory for results.json and results.png")] = Path("models/eval"),
    modes: Annotated[str, typer.Option(help="comma-separated: base, laya, kev, auto")] = "base,laya,kev,auto",
    limit: Annotated[Optional[int], typer.Option(help="evaluate only the first N scenarios")] = None,
    batch_size: Annotated[int, typer.Option(help="jobs per forward pass; 1 = each job served alone")] = 1,
    compare_precision: Annotated[bool, typer.Option(
        help="also run Laya and Kev with the other base precision (NF4 vs fp16 on CUDA, fp32 vs NF4 on the CPU) "
             "and report how often they reach the same decision")] = False,
) -> None:
    """Decision accuracy, valid-JSON rate and latency per mode on the held-out split, through the real runtime.

    Uses the configured base model and adapters (KEVLAYA_BASE_MODEL, KEVLAYA_KEV__PATH, KEVLAYA_LAYA__PATH)."""
    import json
    import logging
    import shlex

    from modellab.evaluation import MODES, agreement, load_scenarios, plot, run_evaluation, table
    from worker.runtime import AdapterRuntime, uses_nf4

    chosen = tuple(m.strip() for m in modes.split(",") if m.strip())
    if not chosen or any(m not in MODES for m in chosen):
        _fail(f"--modes takes a comma-separated subset of {', '.join(MODES)}")
    if batch_size < 1:
        _fail("--batch-size must be at least 1")
    if not scenarios.exists():
        _fail(f"no scenarios at {scenarios}: build them with `kevlaya models build-demo` or pass --scenarios")
    logging.basicConfig(level=logging.WARNING)
    settings = get_settings()
    items = load_scenarios(scenarios, limit)
    runtime = AdapterRuntime.load(settings)
    report = run_evaluation(runtime, settings, items, chosen, batch_size)
    if compare_precision:
        nf4 = uses_nf4(runtime.device, settings.quantization)
        other = settings.model_copy(update={"quantization": "none" if nf4 else "nf4"})
        del runtime
        second = run_evaluation(AdapterRuntime.load(other), other, items, ("laya", "kev"), batch_size)
        nf4_run, reference = (report, second) if nf4 else (second, report)
        report["precision_comparison"] = {
            "reference": "fp16" if second["device"] == "cuda" else "fp32",
            "nf4_modes": nf4_run["modes"],
            "reference_modes": {m: reference["modes"][m] for m in ("laya", "kev") if m in reference["modes"]},
            "agreement": {m: agreement(nf4_run["answers"][m], reference["answers"][m])
                          for m in ("laya", "kev") if m in report["answers"]},
        }
    report["command"] = shlex.join(["kevlaya", *sys.argv[1:]])
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(report, indent=2) + "\n")
    plot(report, out / "results.png")
    typer.echo(table(report))
    if comparison := report.get("precision_comparison"):
        for mode, value in comparison["agreement"].items():
            typer.echo(f"NF4 vs {comparison['reference']} on {report['device']}, {mode}: same decision {value:.1%}, "
                       f"accuracy {comparison['nf4_modes'][mode]['accuracy']:.1%} vs "
                       f"{comparison['reference_modes'][mode]['accuracy']:.1%}")
    typer.echo(f"written {out / 'results.json'} and {out / 'results.png'}")


@dev_app.command("seed-jobs")
def dev_seed_jobs(
    count: Annotated[int, typer.Argument(help="job rows to insert (their batches come with them)")],
    hours: Annotated[float, typer.Option(help="spread the jobs' creation over the last this many hours")] = 24,
    seed: Annotated[int, typer.Option()] = 0,
    time_stats: Annotated[str, typer.Option(
        help="then time GET /v1/stats for these windows (comma-separated; empty: skip)")] = "15m,1h,1d",
    repeat: Annotated[int, typer.Option(help="timed requests per window (the median is printed)")] = 3,
) -> None:
    """Insert realistic job and batch rows into KEVLAYA_DATABASE_URL, then time /v1/stats on them."""
    import statistics
    import time

    from fastapi.testclient import TestClient

    from api.main import create_app
    from modellab.bench.seed import seed_jobs
    from shared.db import get_engine, session_scope
    from shared.keys import create_key
    from shared.models import ApiKey

    done = seed_jobs(get_engine(), count, hours=hours, seed=seed)
    typer.echo(f"inserted {done['jobs']:,} jobs and {done['batches']:,} batches in {done['seconds']:.1f}s "
               f"({done['jobs'] / done['seconds']:,.0f} jobs/s)")
    windows = [w.strip() for w in time_stats.split(",") if w.strip()]
    if not windows:
        return
    with session_scope() as session:
        row, key = create_key(session, "seed-jobs timing", admin=True)
        row_id = row.id
    headers = {"Authorization": f"Bearer {key}"}
    try:
        with TestClient(create_app()) as client:
            for window in windows:
                seconds = []
                for _ in range(repeat):
                    started = time.perf_counter()
                    response = client.get("/v1/stats", params={"window": window}, headers=headers)
                    seconds.append(time.perf_counter() - started)
                    if response.status_code != 200:
                        _fail(f"/v1/stats?window={window}: {response.status_code} {response.text}")
                runs = sum(a["latency_ms"]["end_to_end"]["count"] for a in response.json()["adapters"].values())
                typer.echo(f"GET /v1/stats?window={window}: median {statistics.median(seconds) * 1000:,.0f} ms "
                           f"over {repeat} requests ({runs:,} finished runs in the window)")
    finally:
        with session_scope() as session:  # the timing key must not outlive the measurement
            session.get(ApiKey, row_id).revoked_at = datetime.now(timezone.utc)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
